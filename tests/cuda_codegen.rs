//! The CUDA C generated for fused kernels, checked without a GPU: one kernel per fused step of
//! each plan with the parameters its loads and stores call for, a stable cache key, and — since
//! the generated body is also C — every kernel of the model zoo compiled for the host and run
//! against the CPU backend on the same bindings (gathers by index and sums over child sets
//! included), and so are the CUDA backend's own fill, zeroing, scatter-add and row-sum kernels.

mod common;

use arbor::backend::{Combine, IndexLoc, Loc, Mem, Rows, NO_ROW};
use arbor::cuda::codegen::{cache_key, generate, Binding, Generated, Param};
use arbor::fusion::Kernel;
use arbor::rng::Rng;
use arbor::{nn, Backend, CpuBackend};
use common::host_c::{c_array, compile_on_host, run_on_host};
use common::kernels::{bindings, cells, fused, kernels};
use std::io::Write;
use std::process::{Command, Stdio};

/// One kernel per fused step, with a data pointer per non-zero load, index pointers per indexed
/// load and a pointer per store; the same text every time, and a cache key that changes with the
/// text and the architecture.
#[test]
fn one_kernel_per_fused_step_with_its_parameters() {
    let f = nn::tree_lstm(4, 3).unwrap();
    assert_eq!(fused(f.forward_plan()).len(), f.forward_plan().counts().1);
    for (_, k) in kernels(&f) {
        let b = bindings(&f, &k, false);
        let g = generate(&k, &b).unwrap();
        let count = |p: fn(&Param) -> bool| g.params.iter().filter(|x| p(x)).count();
        assert_eq!(count(|p| matches!(p, Param::Data(_))), b.iter().filter(|b| **b != Binding::Zeros).count());
        assert_eq!(
            count(|p| matches!(p, Param::Index(_))),
            b.iter().filter(|b| matches!(b, Binding::Indexed | Binding::IndexedSet(_))).count()
        );
        assert_eq!(
            count(|p| matches!(p, Param::Offsets(_))),
            b.iter().filter(|b| matches!(b, Binding::IndexedSet(_))).count()
        );
        assert_eq!(count(|p| matches!(p, Param::Store(_))), k.stores.len());
        assert_eq!(g.width, k.stores.iter().map(|&s| k.nodes[s].shape.cols()).max().unwrap());
        assert!(g.source.contains(&format!("extern \"C\" __global__ void {}(", g.name)));
        assert_eq!(generate(&k, &b).unwrap(), g, "generation is deterministic");
        assert_ne!(cache_key(&g.source, "sm_90"), cache_key(&g.source, "sm_80"));
    }
    // The recurrent forward kernel: gathers fused in, c and h stored, 3 columns per row.
    let k = &fused(f.forward_plan())[0];
    let g = generate(k, &bindings(&f, k, false)).unwrap();
    assert_eq!((g.rows, g.width, g.threads(10)), (1, 3, 30));
    let other = generate(k, &bindings(&f, k, true)).unwrap();
    assert_ne!(g.name, other.name, "bindings are part of the kernel's identity");
    // A fixed value: the key depends only on the text, never on the run or the machine.
    assert_eq!(cache_key("__global__ void k() {}", "sm_90"), "5a198191bc140966");
}

/// Random data for one binding of a load of `block` elements per vertex.
struct Bound {
    data: Vec<f32>,
    offsets: Vec<u32>,
    index: Vec<u32>,
    /// A weighted set's weight per member.
    weights: Vec<f32>,
}

fn bind(b: Binding, n: usize, block: usize, rng: &mut Rng) -> Bound {
    let source_rows = 6;
    let mut values = |len: usize| (0..len).map(|_| rng.range(-1.5, 1.5)).collect::<Vec<f32>>();
    match b {
        Binding::Contiguous => Bound { data: values(n * block), offsets: vec![], index: vec![], weights: vec![] },
        Binding::Broadcast => Bound { data: values(block), offsets: vec![], index: vec![], weights: vec![] },
        Binding::Zeros => Bound { data: vec![], offsets: vec![], index: vec![], weights: vec![] },
        Binding::Indexed => Bound {
            data: values(source_rows * block),
            offsets: vec![],
            index: (0..n).map(|v| if v % 3 == 1 { NO_ROW } else { ((v * 5) % source_rows) as u32 }).collect(),
            weights: vec![],
        },
        Binding::IndexedSet(reduce) => {
            let mut offsets = vec![0u32];
            let mut index = Vec::new();
            for v in 0..n {
                index.extend((0..v % 4).map(|c| ((v + 2 * c) % source_rows) as u32));
                offsets.push(index.len() as u32);
            }
            let weights = if reduce.feature().is_some() { values(index.len()) } else { vec![] };
            Bound { data: values(source_rows * block), offsets, index, weights }
        }
    }
}

/// The kernel's stores as the CPU backend computes them (every load and store in one data
/// buffer, every index list in one index buffer).
fn on_cpu(k: &Kernel, bindings: &[Binding], bound: &[Bound], n: usize) -> Vec<Vec<f32>> {
    let cpu = CpuBackend::new();
    let (mut data, mut index) = (Vec::new(), Vec::new());
    let mut rows = Vec::new();
    for (b, x) in bindings.iter().zip(bound) {
        let at = Loc { buf: 0, offset: data.len() };
        data.extend(&x.data);
        let weights = Loc { buf: 0, offset: data.len() };
        data.extend(&x.weights);
        let mut idx = |v: &[u32]| {
            let at = IndexLoc { buf: 0, offset: index.len() };
            index.extend(v);
            at
        };
        rows.push(match b {
            Binding::Contiguous => Rows::Contiguous(at),
            Binding::Broadcast => Rows::Broadcast(at),
            Binding::Zeros => Rows::Zeros,
            Binding::Indexed => Rows::Indexed { data: at, index: idx(&x.index) },
            Binding::IndexedSet(reduce) => {
                let offsets = idx(&x.offsets);
                Rows::IndexedSet { data: at, offsets, index: idx(&x.index), combine: Combine::of(*reduce, at, weights) }
            }
        });
    }
    let mut stores = Vec::new();
    for &s in &k.stores {
        stores.push(Loc { buf: 0, offset: data.len() });
        data.extend(vec![0.0; n * k.nodes[s].shape.numel()]);
    }
    let mut buf = cpu.alloc(data.len()).unwrap();
    cpu.write(&mut buf, 0, &data).unwrap();
    let mut ibuf = cpu.alloc_index(index.len().max(1)).unwrap();
    cpu.write_index(&mut ibuf, 0, &index).unwrap();
    let mut bufs = [buf];
    cpu.fused(&mut Mem { data: &mut bufs, index: &[ibuf] }, k, n, &rows, &stores).unwrap();
    stores
        .iter()
        .zip(&k.stores)
        .map(|(at, &s)| {
            let mut out = vec![0.0; n * k.nodes[s].shape.numel()];
            cpu.read(&bufs[0], at.offset, &mut out).unwrap();
            out
        })
        .collect()
}

/// A C program that runs the generated body on every thread index, reading the vertex count and
/// each parameter's values from stdin and writing the stores to stdout.
fn host_program(g: &Generated) -> String {
    let mut main = String::from(
        "#include <stdio.h>\n#include <stdlib.h>\n\
         static void* take(long long* len) {\n\
         \x20   if (fread(len, 8, 1, stdin) != 1) exit(2);\n\
         \x20   void* p = malloc(*len * 4 + 4);\n\
         \x20   if (fread(p, 4, *len, stdin) != (size_t)*len) exit(3);\n\
         \x20   return p;\n}\n\
         int main(void) {\n    long long n, len;\n    if (fread(&n, 8, 1, stdin) != 1) return 1;\n",
    );
    let mut args = vec!["n".to_string()];
    for p in &g.params {
        let (ty, name) = match p {
            Param::Data(k) => ("const float*", format!("L{k}")),
            Param::Offsets(k) => ("const unsigned*", format!("O{k}")),
            Param::Index(k) => ("const unsigned*", format!("I{k}")),
            Param::Weights(k) => ("const float*", format!("W{k}")),
            Param::Store(k) => ("float*", format!("S{k}")),
            Param::Rows(k) => {
                main.push_str(&format!("    long long R{k};\n    if (fread(&R{k}, 8, 1, stdin) != 1) return 1;\n"));
                args.push(format!("R{k}"));
                continue;
            }
        };
        main.push_str(&format!("    {ty} {name} = take(&len);\n"));
        if matches!(p, Param::Store(_)) {
            main.push_str(&format!("    long long len_{name} = len;\n"));
        }
        args.push(name);
    }
    main.push_str(&format!(
        "    for (long long t = 0; t < n * {} * {}; ++t) {}_body(t, {});\n",
        g.rows,
        g.width,
        g.name,
        args.join(", ")
    ));
    for p in &g.params {
        if let Param::Store(k) = p {
            main.push_str(&format!("    fwrite(S{k}, 4, len_S{k}, stdout);\n"));
        }
    }
    main.push_str("    return 0;\n}\n");
    format!("#define ARBOR_HOST 1\n{}\n{main}", g.source)
}

/// What the host program of `g` reads on its standard input: `n`, then every parameter (arrays
/// as a length and the values; row counts as one number).
fn host_input(k: &Kernel, g: &Generated, bound: &[Bound], n: usize) -> Vec<u8> {
    let mut input: Vec<u8> = (n as i64).to_le_bytes().to_vec();
    let put = |input: &mut Vec<u8>, words: Vec<[u8; 4]>| {
        input.extend((words.len() as i64).to_le_bytes());
        input.extend(words.into_iter().flatten());
    };
    let blocks: Vec<usize> = k.loads().map(|l| k.nodes[l].shape.numel()).collect();
    for p in &g.params {
        match *p {
            Param::Rows(j) => input.extend(((bound[j].data.len() / blocks[j].max(1)) as i64).to_le_bytes()),
            Param::Data(j) => put(&mut input, bound[j].data.iter().map(|x| x.to_le_bytes()).collect()),
            Param::Offsets(j) => put(&mut input, bound[j].offsets.iter().map(|x| x.to_le_bytes()).collect()),
            Param::Index(j) => put(&mut input, bound[j].index.iter().map(|x| x.to_le_bytes()).collect()),
            Param::Weights(j) => put(&mut input, bound[j].weights.iter().map(|x| x.to_le_bytes()).collect()),
            Param::Store(s) => put(&mut input, vec![[0; 4]; n * k.nodes[k.stores[s]].shape.numel()]),
        }
    }
    input
}

/// The kernel's stores as the generated code computes them, compiled for the host.
fn on_host(k: &Kernel, g: &Generated, bound: &[Bound], n: usize, dir: &std::path::Path) -> Vec<Vec<f32>> {
    let exe = compile_on_host(dir, &g.name, &host_program(g));
    let input = host_input(k, g, bound, n);
    let mut child = Command::new(&exe).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("the kernel runs");
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{} failed", exe.display());
    let mut values = out.stdout.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    k.stores.iter().map(|&s| values.by_ref().take(n * k.nodes[s].shape.numel()).collect()).collect()
}

/// Every fused kernel of every cell, forward and backward, computes on the host what the CPU
/// backend computes (1e-5, the difference between libm's `expf` and the CPU backend's own).
#[test]
fn generated_kernels_compute_what_the_cpu_backend_does() {
    let dir = std::env::temp_dir().join(format!("arbor-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Rng::new(5);
    let n = 7;
    let mut checked = 0;
    for f in cells() {
        for (_, k) in kernels(&f) {
            for plain in [false, true] {
                let b = bindings(&f, &k, plain);
                if plain && b == bindings(&f, &k, false) {
                    continue;
                }
                let g = generate(&k, &b).unwrap();
                let bound: Vec<Bound> =
                    k.loads().zip(&b).map(|(i, &b)| bind(b, n, k.nodes[i].shape.numel(), &mut rng)).collect();
                let want = on_cpu(&k, &b, &bound, n);
                let got = on_host(&k, &g, &bound, n, &dir);
                for (s, (w, h)) in want.iter().zip(&got).enumerate() {
                    assert_eq!(w.len(), h.len());
                    for (i, (x, y)) in w.iter().zip(h).enumerate() {
                        // Both NaN (a logarithm of a random negative input) is agreement too.
                        assert!(
                            (x - y).abs() <= 1e-5 * (1.0 + x.abs()) || (x.is_nan() && y.is_nan()),
                            "{} ({}), store {s}, element {i}: CPU {x}, generated {y}\n{}",
                            f.name(),
                            k.signature(),
                            g.source
                        );
                    }
                }
                checked += 1;
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(checked >= 15, "only {checked} kernels checked");
}

/// A gather whose row number lies past the rows its data holds stops the kernel (`abort` in the
/// host build, `__trap` on the GPU) instead of reading outside the data.
#[test]
fn a_gather_past_its_rows_stops_the_kernel() {
    let f = nn::tree_lstm(5, 4).unwrap();
    let k = fused(f.forward_plan()).into_iter().next().expect("a forward kernel");
    let b = bindings(&f, &k, false);
    let g = generate(&k, &b).unwrap();
    let n = 5;
    let mut rng = Rng::new(3);
    let blocks: Vec<usize> = k.loads().map(|l| k.nodes[l].shape.numel()).collect();
    let mut bound: Vec<Bound> = b.iter().zip(&blocks).map(|(&b, &block)| bind(b, n, block, &mut rng)).collect();
    let dir = std::env::temp_dir().join(format!("arbor-gather-{}", std::process::id()));
    let exe = compile_on_host(&dir, &g.name, &host_program(&g));
    let run = |bound: &[Bound]| {
        let mut child = Command::new(&exe).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(&host_input(&k, &g, bound, n)).unwrap();
        child.wait_with_output().unwrap().status.success()
    };
    assert!(run(&bound), "in-range gathers run");
    let (j, rows) = b
        .iter()
        .enumerate()
        .find(|(_, b)| **b == Binding::Indexed)
        .map(|(j, _)| (j, bound[j].data.len() / blocks[j]))
        .expect("an indexed load");
    bound[j].index[2] = rows as u32;
    assert!(!run(&bound), "a row number past the data stopped the kernel");
    let _ = std::fs::remove_dir_all(dir);
}

/// The scatter-add helpers stop (`abort` on the host, `__trap` on the GPU) on a row number past
/// their destination's rows, or an index set reaching past its index, and run when all are in
/// range.
#[test]
fn a_scatter_past_its_rows_stops_the_kernel() {
    use arbor::cuda::codegen::PRELUDE;
    use arbor::cuda::helpers::HELPER_BODIES;
    let dir = std::env::temp_dir().join(format!("arbor-scatter-bounds-{}", std::process::id()));
    // Two source rows of width 2 into a destination of 3 rows; sets of the second call: {0, 1}, {2}.
    let program = |index: [u32; 2], last_offset: u32| {
        format!(
            "#define ARBOR_HOST 1\n{PRELUDE}{HELPER_BODIES}\n\
             int main(void) {{\n\
             const float src[4] = {{1, 2, 3, 4}}; float data[6] = {{0}};\n\
             const unsigned index[2] = {{{}, {}}}; const unsigned offsets[3] = {{0, 2, {last_offset}}};\n\
             for (long long t = 0; t < 4; ++t) arbor_scatter_indexed_body(t, src, 2, 2, data, 3, index);\n\
             for (long long t = 0; t < 4; ++t) arbor_scatter_set_body(t, src, 2, 2, data, 3, offsets, index, 2, 0, data);\n\
             for (long long t = 0; t < 4; ++t) arbor_scatter_set_body(t, src, 2, 2, data, 3, offsets, index, 2, 2, data);\n\
             return 0;\n}}\n",
            index[0], index[1]
        )
    };
    let runs = |name: &str, index: [u32; 2], last: u32| {
        let exe = compile_on_host(&dir, name, &program(index, last));
        Command::new(&exe).output().expect("the helpers run").status.success()
    };
    assert!(runs("in_range", [2, 0], 2), "in-range scatters run");
    assert!(runs("no_row", [NO_ROW, 1], 2), "a missing row is skipped");
    assert!(!runs("past_rows", [3, 0], 2), "a row number past the destination stopped the kernel");
    assert!(!runs("past_index", [0, 1], 3), "an index set past its index stopped the kernel");
    let _ = std::fs::remove_dir_all(dir);
}

/// The backend's own kernels (scatter-adds by index and by index set — summed, averaged, to the
/// largest, weighted —, several by index in one call, row sums with and without accumulation, fill), compiled for the host, compute what the
/// CPU backend does.
#[test]
fn helper_kernels_compute_what_the_cpu_backend_does() {
    use arbor::cuda::codegen::PRELUDE;
    use arbor::cuda::helpers::HELPER_BODIES;
    let (block, n, rows) = (3usize, 5usize, 11usize);
    let mut rng = Rng::new(9);
    let mut values = |len: usize| (0..len).map(|_| rng.range(-1.0, 1.0)).collect::<Vec<f32>>();
    let (src, data) = (values(n * block), values(rows * block));
    let index: Vec<u32> = vec![2, NO_ROW, 0, 2, 3];
    let (offsets, set): (Vec<u32>, Vec<u32>) = (vec![0, 2, 2, 3, 5, 6], vec![1, 3, 0, 2, 1, 3]);
    let sums_in = values(rows * block);
    // The rows a max's gradient is routed by, and a weighted sum's weight per member.
    let compared = values(rows * block);
    let weights = values(set.len());
    let mut c = format!("#define ARBOR_HOST 1\n{PRELUDE}{HELPER_BODIES}#include <stdio.h>\n");
    c += &c_array("const float", "src", &src);
    c += &c_array("const float", "by", &compared);
    c += &c_array("const float", "w", &weights);
    for name in ["a", "b", "a2", "a3", "bm", "bx", "bw"] {
        c += &c_array("float", name, &data);
    }
    c += &c_array("const unsigned", "index", &index);
    c += &c_array("const unsigned", "offsets", &offsets);
    c += &c_array("const unsigned", "set", &set);
    c += &c_array("float", "s", &sums_in);
    c += &c_array("float", "d0", &[0.5f32; 3]);
    c += &c_array("float", "d1", &[0.5f32; 3]);
    c += &format!(
        "int main(void) {{\n\
         for (long long t = 0; t < {nb}; ++t) arbor_scatter_indexed_body(t, src, {block}, {n}, a, {rows}, index);\n\
         for (long long t = 0; t < {nb}; ++t) arbor_scatter_set_body(t, src, {block}, {n}, b, {rows}, offsets, set, {sets}, 0, b);\n\
         for (long long t = 0; t < {nb}; ++t) arbor_scatter_set_body(t, src, {block}, {n}, bm, {rows}, offsets, set, {sets}, 1, bm);\n\
         for (long long t = 0; t < {nb}; ++t) arbor_scatter_set_body(t, src, {block}, {n}, bx, {rows}, offsets, set, {sets}, 2, by);\n\
         for (long long t = 0; t < {nb}; ++t) arbor_scatter_set_body(t, src, {block}, {n}, bw, {rows}, offsets, set, {sets}, 3, w);\n\
         for (long long t = 0; t < {block}; ++t) arbor_sum_rows_body(t, s, {rows}, {block}, d0, 0);\n\
         for (long long t = 0; t < {block}; ++t) arbor_sum_rows_body(t, s, {rows}, {block}, d1, 1);\n\
         for (long long t = 0; t < {rb}; ++t) arbor_fill_body(t, s, {rb}, 2.5f);\n\
         for (long long t = 0; t < 2 * {nb}; ++t) arbor_scatter_indexed4_body(t, {block}, {n}, 2, src, a2, {rows}, index, \
             src, a3, {rows}, index, 0, 0, 0, 0, 0, 0, 0, 0);\n\
         float* out[] = {{a, b, d0, d1, s, a2, a3, bm, bx, bw}};\n\
         int len[] = {{{rb}, {rb}, {block}, {block}, {rb}, {rb}, {rb}, {rb}, {rb}, {rb}}};\n\
         for (int k = 0; k < 10; ++k) for (int i = 0; i < len[k]; ++i) printf(\"%.9g\\n\", out[k][i]);\n\
         return 0;\n}}\n",
        nb = n * block,
        rb = rows * block,
        sets = set.len(),
    );
    let got = run_on_host("helpers", &c);

    // The same on the CPU backend: one data buffer [src | a | b | s | d0 | d1 | bm | bx | by | bw
    // | w], one index buffer.
    let cpu = CpuBackend::new();
    let parts = [&src, &data, &data, &sums_in, &vec![0.5; 3], &vec![0.5; 3], &data, &data, &compared, &data, &weights];
    let at: Vec<usize> = parts.iter().scan(0, |end, p| Some(std::mem::replace(end, *end + p.len()))).collect();
    let mut all: Vec<f32> = parts.iter().flat_map(|p| p.iter().copied()).collect();
    let mut buf = cpu.alloc(all.len()).unwrap();
    cpu.write(&mut buf, 0, &all).unwrap();
    let idx = [index.clone(), offsets.clone(), set.clone()].concat();
    let mut ibuf = cpu.alloc_index(idx.len()).unwrap();
    cpu.write_index(&mut ibuf, 0, &idx).unwrap();
    let mut bufs = [buf];
    let ibufs = [ibuf];
    let mut mem = Mem { data: &mut bufs, index: &ibufs };
    let loc = |k: usize| Loc { buf: 0, offset: at[k] };
    let il = |offset: usize| IndexLoc { buf: 0, offset };
    cpu.scatter_add(&mut mem, loc(0), block, n, &Rows::Indexed { data: loc(1), index: il(0) }).unwrap();
    let set_rows = |data: usize, combine: Combine| Rows::IndexedSet {
        data: loc(data),
        offsets: il(n),
        index: il(2 * n + 1),
        combine,
    };
    cpu.scatter_add(&mut mem, loc(0), block, n, &set_rows(2, Combine::Sum)).unwrap();
    cpu.scatter_add(&mut mem, loc(0), block, n, &set_rows(6, Combine::Mean)).unwrap();
    cpu.scatter_add(&mut mem, loc(0), block, n, &set_rows(7, Combine::Max { by: loc(8) })).unwrap();
    cpu.scatter_add(&mut mem, loc(0), block, n, &set_rows(9, Combine::Weighted { weights: loc(10), feature: 0 }))
        .unwrap();
    cpu.sum_rows(&mut mem, loc(3), rows, block, loc(4), false).unwrap();
    cpu.sum_rows(&mut mem, loc(3), rows, block, loc(5), true).unwrap();
    cpu.fill(&mut mem, loc(3), rows * block, 2.5).unwrap();
    cpu.read(&bufs[0], 0, &mut all).unwrap();
    let want: Vec<f32> = [
        &all[at[1]..at[1] + rows * block],
        &all[at[2]..at[2] + rows * block],
        &all[at[4]..at[4] + block],
        &all[at[5]..at[5] + block],
        &all[at[3]..at[3] + rows * block],
        // Two scatters in one call of the four-way kernel: each as the scatter by index.
        &all[at[1]..at[1] + rows * block],
        &all[at[1]..at[1] + rows * block],
        // A mean's, a max's and a weighted sum's gradient sent to the sets.
        &all[at[6]..at[6] + rows * block],
        &all[at[7]..at[7] + rows * block],
        &all[at[9]..at[9] + rows * block],
    ]
    .concat();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-6, "element {i}: helper {g}, CPU {w}");
    }
}

/// The kernels that round GEMM inputs to bfloat16 and IEEE half, compiled for the host, give the
/// bits the `half` crate gives (round to nearest even) for edge cases and random bit patterns.
#[test]
fn sixteen_bit_conversions_round_like_the_half_crate() {
    use arbor::cuda::codegen::PRELUDE;
    use arbor::cuda::helpers::HELPER_BODIES;
    let mut bits: Vec<u32> = [
        0.0f32,
        -0.0,
        1.0,
        -1.5,
        65504.0,
        65519.99,
        65520.0,
        -70000.0,
        1e-8,
        2f32.powi(-24),
        2f32.powi(-25),
        3.0 * 2f32.powi(-26),
        6.1e-5,
        2f32.powi(-14),
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-8),
        f32::MAX,
        f32::MIN_POSITIVE / 4.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ]
    .iter()
    .map(|x| x.to_bits())
    .collect();
    let mut rng = Rng::new(16);
    bits.extend((0..4000).map(|_| rng.next_u64() as u32));
    // Bit patterns near the f16 range, where subnormals and rounding carries live.
    bits.extend((0..4000).map(|_| 0x3000_0000 + (rng.next_u64() % 0x1800_0000) as u32));
    let mut c = format!("#define ARBOR_HOST 1\n{PRELUDE}{HELPER_BODIES}#include <stdio.h>\n");
    c += &c_array("const unsigned", "bits", &bits);
    c += &format!(
        "int main(void) {{\n\
         for (int i = 0; i < {n}; ++i) {{ float x; memcpy(&x, &bits[i], 4);\n\
         printf(\"%u %u\\n\", arbor_bf16(x), arbor_f16(x)); }}\n\
         return 0;\n}}\n",
        n = bits.len()
    );
    let dir = std::env::temp_dir().join(format!("arbor-convert-{}", std::process::id()));
    let exe = compile_on_host(&dir, "convert", &c);
    let out = Command::new(&exe).output().expect("the conversions run");
    std::fs::remove_dir_all(&dir).ok();
    let lines: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect();
    assert_eq!(lines.len(), bits.len());
    for (&b, line) in bits.iter().zip(&lines) {
        let x = f32::from_bits(b);
        let got: Vec<u16> = line.split(' ').map(|v| v.parse().unwrap()).collect();
        let want = [half::bf16::from_f32(x).to_bits(), half::f16::from_f32(x).to_bits()];
        if x.is_nan() {
            assert!(half::bf16::from_bits(got[0]).is_nan() && half::f16::from_bits(got[1]).is_nan(), "{x}");
        } else {
            assert_eq!(got, want, "{x:e} ({b:#010x}): kernels give bf16 {:#06x}, f16 {:#06x}", got[0], got[1]);
        }
    }
}

/// The optimizer kernels (`arbor::cuda::optim`), compiled for the host, give the CPU optimizer's
/// bits for every rule, with and without weight decay, over four steps (Adam's bias corrections
/// move) under gates that clip, leave and skip: dense tensors, table rows (sparse gradients,
/// state kept per row), the scaling; their sum of squares equals the CPU's to rounding, and the
/// gate they decide from it the CPU's to rounding, skipping the step when a value is not finite.
#[test]
fn optimizer_kernels_give_the_cpu_optimizers_bits() {
    use arbor::cuda::codegen::PRELUDE;
    use arbor::cuda::optim::OPTIM_BODIES;
    use arbor::optim::Update;
    use common::optim::{
        configs, data, host_reference, Data, CLIP, DIM as dim, GATES, N as n, ROWS as steps, VOCAB as vocab,
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let dir = std::env::temp_dir().join(format!("arbor-optim-{}", std::process::id()));
    for (case, config) in configs().into_iter().enumerate() {
        let (rule, wd) = (config.rule, config.weight_decay);
        let Data { p: p0, table: table0, dense: dense_grads, rows: row_grads } = data(case as u64);
        // The CPU optimizer.
        let (reference, cpu, cpu_gate) = host_reference(config, case as u64);
        let want: Vec<u32> = reference.iter().flat_map(|v| bits(v)).collect();
        let norm = 2.5f32;
        // The kernels, one thread index at a time.
        let mut c = format!("#define ARBOR_HOST 1\n{PRELUDE}{OPTIM_BODIES}#include <stdio.h>\n");
        let floats = |name: &str, v: &[f32]| {
            format!(
                "{}float {name}[{}]; \n",
                c_array("static const unsigned", &format!("{name}_bits"), &bits(v)),
                v.len()
            )
        };
        c += &floats("p", &p0);
        c += &floats("e", &table0);
        c += &format!("float m[{n}], v[{n}], em[{}], ev[{}];\n", vocab * dim, vocab * dim);
        let mut body = String::from("memcpy(p, p_bits, sizeof p); memcpy(e, e_bits, sizeof e);\n");
        for (t, rows) in steps.iter().enumerate() {
            let u = Update::new(config, t as u64 + 1);
            let coeffs = format!(
                "{}, {:e}f, {:e}f, {:e}f, {:e}f, {:e}f, {:e}f, {:e}f, {:e}f",
                u.rule_code(),
                config.lr,
                config.weight_decay,
                u.momentum(),
                config.beta1,
                config.beta2,
                config.eps,
                u.bc1,
                u.bc2
            );
            c += &floats(&format!("g{t}"), &dense_grads[t]);
            c += &floats(&format!("r{t}"), &row_grads[t]);
            c += &c_array("static const unsigned", &format!("rows{t}"), rows);
            let gate = match GATES[t] {
                Some([f, a]) => {
                    c += &format!("static const float gate{t}[2] = {{{f:e}f, {a:e}f}};\n");
                    format!("gate{t}")
                }
                None => "0".into(),
            };
            body += &format!(
                "memcpy(g{t}, g{t}_bits, sizeof g{t}); memcpy(r{t}, r{t}_bits, sizeof r{t});\n\
                 for (long long t = 0; t < {n}; ++t) arbor_update_body(t, {n}, p, g{t}, m, v, {gate}, {coeffs});\n\
                 for (long long t = 0; t < {nr}; ++t) arbor_update_rows_body(t, {k}, {dim}, rows{t}, {vocab}, e, r{t}, em, ev, {gate}, {coeffs});\n",
                nr = rows.len() * dim,
                k = rows.len(),
            );
        }
        c += &format!(
            "int main(void) {{\n{body}\
             float clipped[{n}]; memcpy(clipped, p, sizeof p);\n\
             for (long long t = 0; t < {n}; ++t) arbor_scale_body(t, clipped, {n}, {s:e}f);\n\
             float avg[{n}]; memcpy(avg, m, sizeof m);\n\
             for (long long t = 0; t < {n}; ++t) arbor_average_body(t, avg, clipped, {n}, 0.9f);\n\
             float* out[] = {{p, m, v, e, em, ev, clipped, avg}}; int len[] = {{{n}, {n}, {n}, {w}, {w}, {w}, {n}, {n}}};\n\
             for (int k = 0; k < 8; ++k) for (int i = 0; i < len[k]; ++i) {{ unsigned u; memcpy(&u, &out[k][i], 4); printf(\"%u\\n\", u); }}\n\
             double sums[128] = {{0.0}}; float gate[2];\n\
             for (long long t = 0; t < 5; ++t) arbor_sum_squares_body(t, 5, p, {n}, sums, 64);\n\
             for (long long t = 0; t < 5; ++t) arbor_sum_squares_body(t, 5, e, {w}, sums + 64, 64);\n\
             double sum = 0.0; for (int k = 0; k < 64; ++k) sum += sums[k]; printf(\"%.17g\\n\", sum);\n\
             arbor_decide_body(0, sums, 2, 64, {clip:e}f, gate); printf(\"%.9g %g\\n\", gate[0], gate[1]);\n\
             p[3] = 1.0f / 0.0f; memset(sums, 0, sizeof sums);\n\
             for (long long t = 0; t < 5; ++t) arbor_sum_squares_body(t, 5, p, {n}, sums, 64);\n\
             arbor_decide_body(0, sums, 2, 64, {clip:e}f, gate); printf(\"%g\\n\", gate[1]);\n\
             return 0;\n}}\n",
            s = 1.0f32 / norm,
            w = vocab * dim,
            clip = CLIP,
        );
        let exe = compile_on_host(&dir, &format!("optim{case}"), &c);
        let out = Command::new(&exe).output().expect("the optimizer kernels run");
        assert!(out.status.success(), "{rule:?}: {}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
        let got: Vec<u32> = lines[..want.len()].iter().map(|l| l.parse().unwrap()).collect();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g,
                w,
                "{rule:?}, weight decay {wd}: value {i}: kernel {}, CPU {}",
                f32::from_bits(*g),
                f32::from_bits(*w)
            );
        }
        let sum: f64 = lines[want.len()].parse().unwrap();
        assert!((sum - cpu).abs() <= 1e-12 * cpu, "{rule:?}: sum of squares {sum}, CPU {cpu}");
        let gate: Vec<f32> = lines[want.len() + 1].split(' ').map(|x| x.parse().unwrap()).collect();
        assert!((gate[0] - cpu_gate[0]).abs() <= 1e-6 * cpu_gate[0], "{rule:?}: gate {gate:?}, CPU {cpu_gate:?}");
        assert_eq!(gate[1], 1.0, "{rule:?}: a finite step is applied");
        assert_eq!(lines[want.len() + 2], "0", "{rule:?}: an infinity skips the step");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The kernel that gathers rows before a read (`read_rows` of rows far apart, such as a
/// minibatch's roots), compiled for the host, gives what the CPU backend's `read_rows` gives; a
/// row past the data stops it.
#[test]
fn rows_gathered_for_a_read_are_the_rows_read() {
    use arbor::cuda::codegen::PRELUDE;
    use arbor::cuda::helpers::HELPER_BODIES;
    let (block, held) = (3usize, 9usize);
    let mut rng = Rng::new(12);
    let src: Vec<f32> = (0..held * block).map(|_| rng.range(-1.0, 1.0)).collect();
    let rows: Vec<u32> = vec![8, 0, 5, 2];
    let program = |rows: &[u32]| {
        let mut c = format!("#define ARBOR_HOST 1\n{PRELUDE}{HELPER_BODIES}#include <stdio.h>\n");
        c += &c_array("static const unsigned", "src_bits", &src.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        c += &c_array("static const unsigned", "index", rows);
        c += &format!(
            "int main(void) {{\n\
             float src[{len}]; memcpy(src, src_bits, sizeof src); float dst[{n}];\n\
             for (long long t = 0; t < {n}; ++t) arbor_gather_rows_body(t, src, {block}, {k}, {held}, index, dst);\n\
             for (int i = 0; i < {n}; ++i) {{ unsigned u; memcpy(&u, &dst[i], 4); printf(\"%u\\n\", u); }}\n\
             return 0;\n}}\n",
            len = src.len(),
            n = rows.len() * block,
            k = rows.len(),
        );
        c
    };
    let dir = std::env::temp_dir().join(format!("arbor-gather-rows-{}", std::process::id()));
    let out = Command::new(compile_on_host(&dir, "gather", &program(&rows))).output().expect("the kernel runs");
    let past = Command::new(compile_on_host(&dir, "past", &program(&[1, 9]))).output().expect("the kernel runs");
    std::fs::remove_dir_all(&dir).ok();
    let got: Vec<u32> = String::from_utf8_lossy(&out.stdout).lines().map(|l| l.parse().unwrap()).collect();
    let cpu = CpuBackend::new();
    let mut buf = cpu.alloc(src.len()).unwrap();
    cpu.write(&mut buf, 0, &src).unwrap();
    let mut want = vec![0.0; rows.len() * block];
    cpu.read_rows(&buf, 0, block, &rows, &mut want).unwrap();
    assert_eq!(got, want.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    assert!(!past.status.success(), "row 9 of 9 stopped the kernel");
}

/// The attention kernels, compiled for the host, compute what the CPU backend does: outputs,
/// queries' gradients and the children's key and value gradients (added to what is there), for
/// vertices of 0 to 3 children, one child shared by two vertices, both score slopes.
#[test]
fn attention_kernels_compute_what_the_cpu_backend_does() {
    use arbor::attention::Widths;
    use arbor::backend::{Attention, AttentionGrads};
    use arbor::cuda::codegen::PRELUDE;
    use arbor::cuda::helpers::HELPER_BODIES;
    let (n, heads, kw, vw, rows) = (4usize, 2usize, 3usize, 2usize, 5usize);
    let (qb, vb) = (heads * kw, heads * vw);
    let (offsets, set): (Vec<u32>, Vec<u32>) = (vec![0, 2, 2, 5, 6], vec![1, 3, 0, 2, 4, 3]);
    for slope in [1.0f32, 0.2] {
        let mut rng = Rng::new(31);
        let mut values = |len: usize| (0..len).map(|_| rng.range(-2.0, 2.0)).collect::<Vec<f32>>();
        let parts = [
            values(n * qb),
            values(rows * qb),
            values(rows * vb),
            values(n * vb),
            values(rows * qb),
            values(rows * vb),
        ];
        let [q, k, v, g, dk, dv] = &parts;
        let mut c = format!("#define ARBOR_HOST 1\n{PRELUDE}{HELPER_BODIES}#include <stdio.h>\n");
        for (name, x) in [("q", q), ("k", k), ("v", v), ("g", g)] {
            c += &c_array("const float", name, x);
        }
        c += &c_array("float", "dk", dk);
        c += &c_array("float", "dv", dv);
        c += &c_array("float", "out", &vec![0.0f32; n * vb]);
        c += &c_array("float", "dq", &vec![0.0f32; n * qb]);
        c += &c_array("const unsigned", "offsets", &offsets);
        c += &c_array("const unsigned", "set", &set);
        let args = format!("{n}, {heads}, {kw}, {vw}, {slope:?}f, q, k, v, {rows}, offsets, set, {}", set.len());
        c += &format!(
            "int main(void) {{\n\
             for (long long t = 0; t < {nh}; ++t) arbor_attend_body(t, {args}, out);\n\
             for (long long t = 0; t < {nh}; ++t) arbor_attend_grad_body(t, {args}, g, dq, dk, dv);\n\
             float* all[] = {{out, dq, dk, dv}}; int len[] = {{{}, {}, {}, {}}};\n\
             for (int k = 0; k < 4; ++k) for (int i = 0; i < len[k]; ++i) printf(\"%.9g\\n\", all[k][i]);\n\
             return 0;\n}}\n",
            n * vb,
            n * qb,
            rows * qb,
            rows * vb,
            nh = n * heads,
        );
        let got = run_on_host(&format!("attention{}", slope.to_bits()), &c);

        // The CPU backend, one data buffer [q | k | v | g | dk | dv | out | dq].
        let cpu = CpuBackend::new();
        let mut all: Vec<f32> = parts.iter().flatten().copied().collect();
        let at: Vec<usize> = parts.iter().scan(0, |end, p| Some(std::mem::replace(end, *end + p.len()))).collect();
        let (out_at, dq_at) = (all.len(), all.len() + n * vb);
        all.resize(dq_at + n * qb, 0.0);
        let mut buf = cpu.alloc(all.len()).unwrap();
        cpu.write(&mut buf, 0, &all).unwrap();
        let mut ibuf = cpu.alloc_index(offsets.len() + set.len()).unwrap();
        cpu.write_index(&mut ibuf, 0, &[offsets.clone(), set.clone()].concat()).unwrap();
        let (mut bufs, ibufs) = ([buf], [ibuf]);
        let mut mem = Mem { data: &mut bufs, index: &ibufs };
        let loc = |offset: usize| Loc { buf: 0, offset };
        let a = Attention {
            widths: Widths { heads, key: kw, value: vw, slope },
            n,
            query: loc(at[0]),
            keys: loc(at[1]),
            values: loc(at[2]),
            offsets: IndexLoc { buf: 0, offset: 0 },
            index: IndexLoc { buf: 0, offset: offsets.len() },
        };
        cpu.attend(&mut mem, &a, loc(out_at)).unwrap();
        let grads = AttentionGrads { out: loc(at[3]), query: loc(dq_at), keys: loc(at[4]), values: loc(at[5]) };
        cpu.attend_grad(&mut mem, &a, &grads).unwrap();
        cpu.read(&bufs[0], 0, &mut all).unwrap();
        let want: Vec<f32> = [&all[out_at..dq_at], &all[dq_at..], &all[at[4]..at[5]], &all[at[5]..out_at]].concat();
        assert_eq!(got.len(), want.len());
        assert!(
            want[..vb].iter().any(|&x| x != 0.0) && want[vb..2 * vb].iter().all(|&x| x == 0.0),
            "a leaf reads zeros"
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "slope {slope}, element {i}: kernel {g}, CPU {w}");
        }
    }
}

/// The four-way zeroing kernel, compiled for the host, zeroes each region and nothing beside.
#[test]
fn zeroing_four_regions_at_once_touches_only_them() {
    use arbor::cuda::codegen::PRELUDE;
    use arbor::cuda::helpers::HELPER_BODIES;
    let c = format!(
        "#define ARBOR_HOST 1\n{PRELUDE}{HELPER_BODIES}#include <stdio.h>\n\
         float x[12] = {{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}};\n\
         int main(void) {{\n\
         for (long long t = 0; t < 6; ++t) arbor_zero4_body(t, x + 1, 2, x + 4, 3, x + 9, 1, 0, 0);\n\
         for (int i = 0; i < 12; ++i) printf(\"%g\\n\", x[i]);\n\
         return 0;\n}}\n"
    );
    let got = run_on_host("zero4", &c);
    assert_eq!(got, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]);
}
