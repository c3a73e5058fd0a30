//! The CUDA backend's column-major product mapping, checked against a written-out BLAS on the CPU.

use super::ColMajor;
use arbor_core::backend::{Backend, Gemm, Loc, Mem};
use arbor_core::rng::Rng;
use arbor_ops::cpu::HostBuffer;
use arbor_ops::CpuBackend;

/// BLAS's column-major `C = α·op(A)·op(B) + β·C` for one matrix, written out.
#[allow(clippy::too_many_arguments)]
fn sgemm_column_major(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
) {
    for j in 0..n {
        for i in 0..m {
            let mut s = 0.0;
            for p in 0..k {
                let x = if ta { a[p + i * lda] } else { a[i + p * lda] };
                let y = if tb { b[j + p * ldb] } else { b[p + j * ldb] };
                s += x * y;
            }
            c[i + j * ldc] = s + beta * c[i + j * ldc];
        }
    }
}

/// The arguments handed to cuBLAS compute, in column-major terms, exactly the row-major
/// product the CPU backend computes, for every transpose, padding, batch and accumulation.
#[test]
fn the_column_major_call_computes_the_row_major_product() {
    let mut rng = Rng::new(2);
    let cpu = CpuBackend::new();
    for case in 0..16 {
        let (ta, tb, accumulate) = (case & 1 == 1, case & 2 == 2, case & 4 == 4);
        let (m, n, k, batch) = (3 + case % 3, 4, 5, 1 + case / 8);
        let (ar, ac) = if ta { (k, m) } else { (m, k) };
        let (br, bc) = if tb { (n, k) } else { (k, n) };
        let (lda, ldb, ldc) = (ac + 1, bc + 2, n + 1);
        let (sa, sb, sc) = (ar * lda + 3, br * ldb, m * ldc + 1);
        let g = Gemm {
            m,
            n,
            k,
            a: Loc { buf: 0, offset: 0 },
            lda,
            ta,
            b: Loc { buf: 1, offset: 0 },
            ldb,
            tb,
            b_fixed: false,
            c: Loc { buf: 2, offset: 0 },
            ldc,
            accumulate,
            batch,
            stride_a: sa,
            stride_b: sb,
            stride_c: sc,
        };
        let mut fill = |len: usize| (0..len).map(|_| rng.range(-1.0, 1.0)).collect::<Vec<f32>>();
        let data = [fill(batch * sa), fill(batch * sb), fill(batch * sc)];
        let mut bufs: Vec<HostBuffer> = data.iter().cloned().map(HostBuffer::from).collect();
        cpu.gemm(&mut Mem { data: &mut bufs, index: &[] }, &g).unwrap();

        let cm = ColMajor::of(&g);
        assert!(cm.swapped);
        let mut c = data[2].clone();
        for t in 0..batch {
            sgemm_column_major(
                cm.trans,
                (cm.m, cm.n, cm.k),
                &data[1][t * cm.stride.0..],
                cm.ld.0,
                &data[0][t * cm.stride.1..],
                cm.ld.1,
                if accumulate { 1.0 } else { 0.0 },
                &mut c[t * sc..],
                ldc,
            );
        }
        for (i, (x, y)) in c.iter().zip(&bufs[2]).enumerate() {
            assert!((x - y).abs() <= 1e-5, "case {case}, element {i}: cuBLAS call {x}, CPU {y}");
        }
    }
}
