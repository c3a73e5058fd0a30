//! Same inputs, same thread count, same bits: training steps repeated while other threads compete
//! for the cores (spinning, and running CPU backend calls that hold its thread team, so the
//! steps' calls run on fewer threads at moments no one controls) give bitwise the parameters of
//! the same steps on a quiet machine. CI runs this file with the AVX-512 kernels on and off
//! (`ARBOR_CPU_ISA=avx2`), so both ways a product can run are covered on any machine.

use arbor::backend::{Backend, Gemm, Loc, Mem};
use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, TreeExample};
use arbor::layers::LossOn;
use arbor::model::{AsExample, Example};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::{nn, CpuBackend, HostBuffer};
use std::sync::atomic::{AtomicBool, Ordering};

/// Eight steps of a Tree-LSTM wide enough (32) and minibatches large enough (24 trees) that the
/// backend splits its products and fused kernels between `threads` threads; the parameters after
/// them.
fn train(data: &[TreeExample], threads: usize) -> Vec<Vec<f32>> {
    arbor::with_cpu_threads(threads, || {
        let mut rng = Rng::new(17);
        let (cell, classes) = (nn::tree_lstm(32, 32).unwrap(), synthetic::CLASSES);
        let mut m =
            arbor::zoo::tree_classifier(cell, synthetic::vocab().len(), classes, LossOn::All, &mut rng).unwrap();
        let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
        for batch in data.chunks(24) {
            let labelled = Labelled::all(batch, LossOn::All, classes);
            let batch: Vec<Example<'_>> = labelled.iter().map(Labelled::example).collect();
            m.step(&batch, &mut opt, Some(5.0)).unwrap();
        }
        m.tensors().unwrap().into_iter().map(|(_, _, values)| values).collect()
    })
}

/// Runs CPU backend products large enough to take the thread team until `stop`.
fn hold_the_team(stop: &AtomicBool) {
    let (m, n, k) = (96, 256, 128);
    let cpu = CpuBackend::new();
    let mut data: Vec<HostBuffer> =
        [vec![0.5f32; m * k], vec![0.25f32; k * n], vec![0.0f32; m * n]].into_iter().map(HostBuffer::from).collect();
    let g = Gemm::single(
        (m, n, k),
        (Loc { buf: 0, offset: 0 }, k, false),
        (Loc { buf: 1, offset: 0 }, n, false, false),
        (Loc { buf: 2, offset: 0 }, n),
    );
    arbor::with_cpu_threads(2, || {
        while !stop.load(Ordering::Relaxed) {
            cpu.gemm(&mut Mem { data: &mut data, index: &[] }, &g).unwrap();
        }
    });
}

/// Spins until `stop`, taking a core from everything else.
fn spin(stop: &AtomicBool) {
    let mut x = 0u64;
    while !stop.load(Ordering::Relaxed) {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

/// Bitwise equality, or the count of values of each parameter that differ.
fn assert_same(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    for (p, (got, want)) in got.iter().zip(want).enumerate() {
        let differ = got.iter().zip(want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{what}: {differ} of {} values of parameter {p} differ", want.len());
    }
}

#[test]
fn training_gives_the_same_bits_while_other_threads_compete() {
    let data = synthetic::generate(8 * 24, 12, 4);
    let quiet = train(&data, 2);
    for round in 0..3 {
        let stop = AtomicBool::new(false);
        let busy = std::thread::scope(|s| {
            s.spawn(|| hold_the_team(&stop));
            s.spawn(|| hold_the_team(&stop));
            s.spawn(|| spin(&stop));
            let got = train(&data, 2);
            stop.store(true, Ordering::Relaxed);
            got
        });
        assert_same(&format!("busy round {round}"), &busy, &quiet);
    }
}

/// The backend's calls give the same bits on any number of threads, so a whole run does too.
#[test]
fn training_gives_the_same_bits_on_one_thread_and_on_two() {
    let data = synthetic::generate(4 * 24, 12, 9);
    assert_same("one thread vs two", &train(&data, 1), &train(&data, 2));
}
