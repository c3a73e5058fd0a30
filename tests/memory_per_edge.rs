//! Memory linear in vertices + edges: a training step over a star (one root, n leaf children)
//! measured by a counting allocator. The children of a vertex are one segment of the child list,
//! never a slot row per child up to the widest vertex (which made this n² bytes). This file holds
//! one test, so no other test's allocations are counted.

use arbor::rng::Rng;
use arbor::{nn, CpuBackend, Engine, InputGraph, Pass, Pull};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The system allocator, counting the bytes held now and the most held since the last reset.
struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            PEAK.fetch_max(NOW.fetch_add(layout.size(), Relaxed) + layout.size(), Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(p, layout) };
        NOW.fetch_sub(layout.size(), Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const EMBED: usize = 8;
const HIDDEN: usize = 8;

/// The most bytes held while a star of `children` leaves is built, run forward and backward by
/// a child-sum Tree-LSTM (`gather_sum`) and its parameters updated, above what was held before.
fn peak_of_a_step(e: &mut Engine<CpuBackend>, children: usize) -> usize {
    let base = NOW.load(Relaxed);
    PEAK.store(base, Relaxed);
    let mut kids: Vec<Vec<Option<usize>>> = vec![Vec::new(); children];
    kids.push((0..children).map(Some).collect());
    let star = InputGraph::from_children(kids).unwrap();
    let n = star.len();
    let x: Vec<f32> = (0..n * EMBED).map(|i| (i % 7) as f32 * 0.1).collect();
    // Every leaf's parent input is the root's; the root has none (zeros).
    let mut x_parent = x[(n - 1) * EMBED..].repeat(n);
    x_parent[(n - 1) * EMBED..].fill(0.0);
    let h = e.run(Pass::train(&[&star], &[Pull::Rows(&x), Pull::Rows(&x_parent)])).unwrap();
    assert!(h[0].iter().all(|v| v.is_finite()));
    let mut dh = vec![0.0; n * HIDDEN];
    dh[(n - 1) * HIDDEN..].fill(1.0);
    let grads = e.backward(&[&dh]).unwrap();
    assert!(grads.params.iter().flatten().any(|&g| g != 0.0));
    e.update_params(|params| {
        for (p, g) in params.into_iter().zip(&grads.params) {
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= 0.01 * g);
        }
    })
    .unwrap();
    PEAK.load(Relaxed) - base
}

#[test]
fn a_star_of_100k_children_trains_a_step_in_memory_linear_in_its_edges() {
    let f = nn::child_sum_tree_lstm_nary(EMBED, HIDDEN).unwrap();
    let params = f.init_params(&mut Rng::new(1));
    let mut e = Engine::new(CpuBackend::new(), f, &params).unwrap();
    // A first step sizes what the engine keeps across minibatches (kernel caches, scratch).
    peak_of_a_step(&mut e, 1_000);
    let small = peak_of_a_step(&mut e, 10_000);
    let large = peak_of_a_step(&mut e, 100_000);
    let per_edge = (large - small) as f64 / 90_000.0;
    println!("peak bytes: 10k children {small}, 100k children {large}; {per_edge:.0} bytes per edge (vertex + edge)");
    assert!(large < 1 << 30, "a star of 100,000 children held {large} bytes in a step (at most 1 GiB)");
    // Each added leaf is a vertex and an edge: its inputs, states, kept values and gradients at
    // hidden and embed 8 (about 50 floats each), the child list, rows and schedule entries.
    assert!(per_edge < 1_600.0, "{per_edge:.0} bytes per edge");
    // Linear: ten times the edges costs about ten times the memory, not a hundred.
    assert!((large as f64) < 11.0 * small as f64, "10k children: {small} bytes, 100k: {large}");
}
