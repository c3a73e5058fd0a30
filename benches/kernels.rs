//! Micro-benchmarks (divan): the machine's GEMM peak, the GEMM shapes of a Tree-LSTM step, the
//! fused element-wise kernels, and scheduling + memory planning per vertex.
//!
//! `cargo bench --bench kernels` (all), or e.g. `cargo bench --bench kernels -- gemm`.

use arbor::backend::{Backend, Gemm, Loc, Mem, Rows};
use arbor::batching::{MemoryPlan, Schedule, Scheduler};
use arbor::fusion::{Phase, Step};
use arbor::rng::Rng;
use arbor::{nn, CpuBackend, InputGraph};
use divan::{black_box, Bencher};

fn main() {
    divan::main();
}

fn gemm(b: Bencher<'_, '_>, m: usize, k: usize, n: usize) {
    gemm_with(b, (m, k, n), false, false);
}

/// A buffer of `len` values drawn uniformly from [-1, 1]: written, so that no operand reads the
/// zero page every fresh allocation maps (one 4 KiB page from L1, however large the matrix).
fn random(cpu: &CpuBackend, rng: &mut Rng, len: usize) -> <CpuBackend as Backend>::Buffer {
    let mut buf = cpu.alloc(len).unwrap();
    cpu.write(&mut buf, 0, &(0..len).map(|_| rng.range(-1.0, 1.0)).collect::<Vec<_>>()).unwrap();
    buf
}

/// `C = op(A)·op(B)`: A stored as `m × k` (`k × m` when `ta`), B as `k × n` (`n × k` when `tb`).
fn gemm_with(b: Bencher<'_, '_>, (m, k, n): (usize, usize, usize), ta: bool, tb: bool) {
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(1);
    let mut data: Vec<_> = [m * k, k * n, m * n].into_iter().map(|len| random(&cpu, &mut rng, len)).collect();
    let (lda, ldb) = (if ta { m } else { k }, if tb { k } else { n });
    let g = Gemm::single(
        (m, n, k),
        (Loc { buf: 0, offset: 0 }, lda, ta),
        (Loc { buf: 1, offset: 0 }, ldb, tb, true),
        (Loc { buf: 2, offset: 0 }, n),
    );
    b.counter(divan::counter::ItemsCount::new(2 * m * k * n))
        .bench_local(|| cpu.gemm(&mut Mem { data: &mut data, index: &[] }, black_box(&g)).unwrap());
}

/// The machine's GEMM peak: large square products (items = floating-point operations).
#[divan::bench(args = [512, 1024, 2048])]
fn gemm_peak(b: Bencher<'_, '_>, size: usize) {
    gemm(b, size, size, size);
}

/// The core's arithmetic peak: 16 independent chains of 512-bit multiply-adds (256-bit without
/// AVX-512) in registers, on one thread (items = floating-point operations); the GEMM peaks above
/// reach part of it.
#[cfg(target_arch = "x86_64")]
#[divan::bench]
fn fma_peak(b: Bencher<'_, '_>) {
    const STEPS: usize = 4096;
    let wide = std::is_x86_feature_detected!("avx512f");
    if !wide && !std::is_x86_feature_detected!("fma") {
        return;
    }
    let lanes = if wide { 16 } else { 8 };
    b.counter(divan::counter::ItemsCount::new(2 * 16 * lanes * STEPS)).bench_local(|| {
        if wide {
            // SAFETY: the CPU has AVX-512F (detected above).
            unsafe { fma::chains_512(black_box(STEPS)) }
        } else {
            // SAFETY: the CPU has FMA (detected above), and with it AVX.
            unsafe { fma::chains_256(black_box(STEPS)) }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    /// 16 chains of `steps` 512-bit multiply-adds; their sum.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn chains_512(steps: usize) -> f32 {
        let (x, y) = (_mm512_set1_ps(0.999), _mm512_set1_ps(0.5));
        let mut acc = [_mm512_setzero_ps(); 16];
        for _ in 0..steps {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, x, y);
            }
        }
        acc.iter().fold(0.0, |s, &a| s + _mm512_reduce_add_ps(a))
    }

    /// 16 chains of `steps` 256-bit multiply-adds; their first lanes' sum.
    ///
    /// # Safety
    /// The CPU has AVX and FMA.
    #[target_feature(enable = "avx,fma")]
    pub unsafe fn chains_256(steps: usize) -> f32 {
        let (x, y) = (_mm256_set1_ps(0.999), _mm256_set1_ps(0.5));
        let mut acc = [_mm256_setzero_ps(); 16];
        for _ in 0..steps {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, x, y);
            }
        }
        acc.iter().fold(0.0, |s, &a| s + _mm256_cvtss_f32(a))
    }
}

/// Tree-LSTM shapes at hidden 150, embed 300, batch 64 (about 2,500 vertices, tasks of about 60):
/// per-task `h·U` (60×150·150×750), hoisted `x·W` (1,300 leaves ×300·300×750) and the lazy
/// `dU = hᵀ·dG` (150×1,200·1,200×750).
#[divan::bench(args = [(1, 150, 750), (4, 150, 750), (8, 150, 750), (16, 150, 750), (32, 150, 750), (20, 300, 750), (60, 150, 750), (1300, 300, 750), (150, 1200, 750)])]
fn gemm_tree_lstm(b: Bencher<'_, '_>, (m, k, n): (usize, usize, usize)) {
    gemm(b, m, k, n);
}

/// The backward per-task products of the Tree-LSTM, `dG·Uᵀ` (m × 750 times the transposed
/// 150 × 750 weights), from batch 1 (a few rows) to batch 64 (about 60).
#[divan::bench(args = [(1, 750, 150), (4, 750, 150), (16, 750, 150), (32, 750, 150), (60, 750, 150)])]
fn gemm_tree_lstm_backward(b: Bencher<'_, '_>, (m, k, n): (usize, usize, usize)) {
    gemm_with(b, (m, k, n), false, true);
}

/// The Tree-LSTM's parameter gradients over a batch-64 minibatch: `dU = hᵀ·dG` over about 1,240
/// internal vertices (150 × 750) and `dW = xᵀ·dG` over about 700 distinct words (300 × 450).
#[divan::bench(args = [(150, 1240, 750), (300, 700, 450)])]
fn gemm_tree_lstm_param_grad(b: Bencher<'_, '_>, (m, k, n): (usize, usize, usize)) {
    gemm_with(b, (m, k, n), true, false);
}

/// The Tree-LSTM's fused kernels over one task of 64 vertices (items = vertices).
#[divan::bench(args = ["forward", "backward"])]
fn fused_tree_lstm(b: Bencher<'_, '_>, pass: &str) {
    let cell = nn::tree_lstm(300, 150).unwrap();
    let plan = if pass == "forward" { cell.forward_plan() } else { cell.backward_plan() };
    let kernel = plan.phases[Phase::Recurrent as usize]
        .iter()
        .filter_map(|s| if let Step::Fused(k) = s { Some(k) } else { None })
        .max_by_key(|k| k.nodes.len())
        .expect("a recurrent fused kernel")
        .clone();
    let n = 64;
    let cpu = CpuBackend::new();
    // Every load reads (and every store writes) its own random region.
    let mut rng = Rng::new(1);
    let mut data = Vec::new();
    let mut loads = Vec::new();
    for l in kernel.loads() {
        let node = &kernel.nodes[l];
        let len = if node.is_param { node.shape.numel() } else { n * node.shape.numel() };
        let at = Loc { buf: data.len(), offset: 0 };
        data.push(random(&cpu, &mut rng, len));
        loads.push(if node.is_param { Rows::Broadcast(at) } else { Rows::Contiguous(at) });
    }
    let out_len: usize = kernel.stores.iter().map(|&s| n * kernel.nodes[s].shape.numel()).sum();
    let out = data.len();
    data.push(cpu.alloc(out_len).unwrap());
    let mut at = 0;
    let stores: Vec<Loc> = kernel
        .stores
        .iter()
        .map(|&s| {
            let loc = Loc { buf: out, offset: at };
            at += n * kernel.nodes[s].shape.numel();
            loc
        })
        .collect();
    // The gather loads read from a contiguous copy here: this measures the arithmetic.
    assert!(data.len() <= 16, "{} buffers", data.len());
    b.counter(divan::counter::ItemsCount::new(n)).bench_local(|| {
        cpu.fused(&mut Mem { data: &mut data, index: &[] }, black_box(&kernel), n, &loads, &stores).unwrap()
    });
}

/// Scheduling and memory planning of a minibatch of 64 random binary trees (items = vertices).
#[divan::bench(args = [64, 256])]
fn schedule_and_plan(b: Bencher<'_, '_>, trees: usize) {
    let cell = nn::tree_lstm(300, 150).unwrap();
    let mut rng = Rng::new(2);
    let graphs: Vec<InputGraph> = (0..trees).map(|_| InputGraph::random(&mut rng, 40, 2, false)).collect();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let vertices: usize = graphs.iter().map(InputGraph::len).sum();
    let mut scheduler = Scheduler::default();
    let mut schedule = Schedule::default();
    b.counter(divan::counter::ItemsCount::new(vertices)).bench_local(|| {
        scheduler.schedule(black_box(&refs), cell.arity(), &mut schedule);
        black_box(MemoryPlan::new(&cell, schedule.len(), schedule.max_task(), true));
    });
}

/// One step of the optimizer over the Tree-LSTM's dense parameters at hidden 150, embed 300
/// (about 361,000 values): the sum of squares that gates it, and the update (items = values).
#[divan::bench(args = ["sum_squares", "sgd", "adagrad", "adam"])]
fn optimizer_step(b: Bencher<'_, '_>, what: &str) {
    use arbor_core::optim::{Config, Rule, Update};
    let n = 361_255;
    let g: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let (mut p, mut m, mut v) = (vec![0.5f32; n], vec![0.1f32; n], vec![0.2f32; n]);
    let rule = match what {
        "sgd" => Rule::Sgd { momentum: 0.0 },
        "adam" => Rule::Adam,
        _ => Rule::Adagrad,
    };
    let u = Update::new(Config::new(rule, 1e-4), 1);
    let b = b.counter(divan::counter::ItemsCount::new(n));
    if what == "sum_squares" {
        b.bench_local(|| arbor_ops::cpu::optim::sum_squares(black_box(&g)));
    } else {
        b.bench_local(|| arbor_ops::cpu::optim::dense(&u, &mut p, black_box(&g), &mut m, &mut v));
    }
}
