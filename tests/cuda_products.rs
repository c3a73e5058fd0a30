//! The CUDA backend's own matrix-product kernel (`arbor_gemm`, for products too small for
//! cuBLAS to pay), compiled for the host and checked against the CPU backend's products.

mod common;

use arbor::backend::{Loc, Mem};
use arbor::rng::Rng;
use arbor::{Backend, CpuBackend};
use common::host_c::{c_array, run_on_host};

/// The CUDA backend's own product kernel (`arbor_gemm`), compiled for the host with a block's
/// threads run one phase at a time, gives the CPU backend's products: every transpose, padded
/// rows, batches with strides, accumulation, one slice of the inner dimension or sixteen, k = 0,
/// several products into their own outputs (a wave) or summed into one (a chain).
#[test]
fn the_product_kernel_computes_what_the_cpu_backend_does() {
    use arbor::backend::Gemm;
    use arbor::cuda::codegen::PRELUDE;
    use arbor::cuda::gemm::{GemmGrid, GEMM_BLOCK, GEMM_BODIES, GEMM_SHARED};
    // (m, n, k, ta, tb, batch, accumulate, products, chain)
    let cases = [
        (1, 7, 70, false, false, 1, false, 1, false),
        (5, 9, 13, true, false, 1, true, 1, false),
        (6, 3, 40, false, true, 2, true, 2, false),
        (7, 6, 33, true, true, 3, false, 3, false),
        (3, 10, 150, false, false, 1, false, 2, true),
        (9, 5, 21, true, false, 2, true, 3, true),
        (4, 8, 0, false, false, 1, false, 1, false),
        (70, 33, 5, true, false, 1, false, 4, false),
    ];
    let mut rng = Rng::new(31);
    for (case, &(m, n, k, ta, tb, batch, accumulate, count, chain)) in cases.iter().enumerate() {
        // Stored shapes with a padded row stride, then a gap between the matrices of a batch.
        let (ar, ac) = if ta { (k, m) } else { (m, k) };
        let (br, bc) = if tb { (n, k) } else { (k, n) };
        let (lda, ldb, ldc) = (ac + 2, bc + 1, n + 3);
        let (sa, sb, sc) = (ar * lda + 5, br * ldb + 2, m * ldc + 1);
        let (la, lb, lc) = (batch * sa, batch * sb, batch * sc);
        let mut values = |len: usize| (0..len).map(|_| rng.range(-1.0, 1.0)).collect::<Vec<f32>>();
        // Each product's A and B; C: one for a chain, one each otherwise.
        let outs = if chain { 1 } else { count };
        let (a, b, c) = (values(count * la), values(count * lb), values(outs * lc));
        let grid = GemmGrid::of(m, n, k, batch, count, chain);
        let mut p = format!("#define ARBOR_HOST 1\n{PRELUDE}{GEMM_BODIES}#include <stdio.h>\n");
        p += &c_array("const float", "a", &a);
        p += &c_array("const float", "b", &b);
        p += &c_array("float", "c", &c);
        let ptr = |name: &str, at: usize, i: usize| if i < count { format!("{name} + {}", i * at) } else { "0".into() };
        let cptr = |i: usize| if i < outs { format!("c + {}", i * lc) } else { "0".into() };
        let ab: Vec<String> = (0..4).flat_map(|i| [ptr("a", la, i), ptr("b", lb, i)]).collect();
        let cs: Vec<String> = (0..4).map(cptr).collect();
        let acc = i32::from(accumulate);
        p += &format!(
            "float shared[{GEMM_SHARED}];\n\
             int main(void) {{\n\
             for (long long blk = 0; blk < {blocks}; ++blk) {{\n\
               for (int lt = 0; lt < {GEMM_BLOCK}; ++lt) arbor_gemm_tile_body(blk, lt, {m}, {n}, {k}, {batch}, {ks}, \
                 {chunk}, {count}, {chain}, {lda}, {sa}, {ta}, {ldb}, {sb}, {tb}, {ab}, shared);\n\
               for (int lt = 0; lt < {GEMM_BLOCK}; ++lt) arbor_gemm_store_body(blk, lt, {m}, {n}, {batch}, {ks}, \
                 {count}, {chain}, {ldc}, {sc}, {cs}, {acc}, {acc}, {acc}, {acc}, shared);\n\
             }}\n\
             for (int i = 0; i < {len}; ++i) printf(\"%.9g\\n\", c[i]);\n\
             return 0;\n}}\n",
            blocks = grid.blocks,
            ks = grid.ks,
            chunk = grid.chunk,
            chain = i32::from(chain),
            ta = i32::from(ta),
            tb = i32::from(tb),
            ab = ab.join(", "),
            cs = cs.join(", "),
            len = outs * lc,
        );
        let got = run_on_host(&format!("gemm{case}"), &p);

        // The CPU backend: the products one after another, a chain's into the one C (the first
        // as `accumulate` says, the rest adding).
        let cpu = CpuBackend::new();
        let all = [a.clone(), b.clone(), c.clone()].concat();
        let mut buf = cpu.alloc(all.len()).unwrap();
        cpu.write(&mut buf, 0, &all).unwrap();
        let mut bufs = [buf];
        let ibufs: [Vec<u32>; 0] = [];
        let mut mem = Mem { data: &mut bufs, index: &ibufs };
        let at = |offset: usize| Loc { buf: 0, offset };
        let c0 = count * (la + lb);
        for i in 0..count {
            let out = if chain { c0 } else { c0 + i * lc };
            let g = Gemm {
                accumulate: accumulate || (chain && i > 0),
                batch,
                stride_a: sa,
                stride_b: sb,
                stride_c: sc,
                ..Gemm::single(
                    (m, n, k),
                    (at(i * la), lda, ta),
                    (at(count * la + i * lb), ldb, tb, false),
                    (at(out), ldc),
                )
            };
            cpu.gemm(&mut mem, &g).unwrap();
        }
        let mut want = vec![0.0; outs * lc];
        cpu.read(&bufs[0], c0, &mut want).unwrap();
        assert_eq!(got.len(), want.len(), "case {case}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "case {case}, element {i}: kernel {g}, CPU {w}");
        }
    }
}
