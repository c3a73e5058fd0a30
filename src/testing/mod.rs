//! Testing a cell the way arbor tests its own (feature `testing`): gradients against finite
//! differences over whole graphs ([`check_gradients`]), the batched engine against the reference
//! interpreter run one graph at a time ([`check_batched`]), the gradients of a whole model
//! ([`check_model_gradients`]), the gradient check of one vertex ([`check_vertex`]) and [`proptest`](mod@proptest) strategies for trees, chains, DAGs, forests and unrolled
//! message-passing graphs ([`strategy`]).
//!
//! Every check returns a [`Mismatch`] naming each wrong value (``param `U`[1, 3]``) rather than
//! panicking, so it fits `proptest` (`prop_assert!`) as well as plain tests.
//!
//! ```
//! use arbor::testing::{check_batched, check_gradients, strategy, GradCheck};
//! use arbor::{Builder, Init};
//! use proptest::prelude::*;
//!
//! // A Tree-GRU-like cell over binary trees.
//! let f = Builder::new("my-cell", 2);
//! let x = f.pull("x", 3);
//! let (h0, h1) = (f.gather(0, "h", 4), f.gather(1, "h", 4));
//! let w = f.param("W", [3, 4], Init::Xavier);
//! let u = f.param("U", [4, 4], Init::Xavier);
//! let z = (x.matmul(w) + (h0 + h1).matmul(u)).sigmoid();
//! let h = z * (h0 + h1).scale(0.5) + (1.0 - z) * x.matmul(w).tanh();
//! f.scatter("h", h);
//! f.push("h", h);
//! let cell = f.build().unwrap();
//!
//! let mut rng = arbor::rng::Rng::new(1);
//! let graphs: Vec<_> = (0..3).map(|_| strategy::tree(&mut rng, 7, 2)).collect();
//! let report = check_gradients(&cell, &graphs, &GradCheck::default()).unwrap();
//! assert_eq!(report.params, 3 * 4 + 4 * 4);
//!
//! // Batched equals one graph at a time, on random minibatches of random binary trees.
//! proptest!(ProptestConfig::with_cases(8), |(graphs in strategy::minibatches(strategy::trees(2, 1..=12), 1..=4), seed: u64)| {
//!     check_batched(&cell, &graphs, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
//! });
//! ```

mod batched;
mod gradients;
mod model;
pub mod strategy;

pub use arbor_core::testing::{
    check_vertex, Comparisons, Discrepancy, EntryKind, GradComparisons, GradReport, Mismatch, Tolerance, VertexCase,
};
pub use batched::{check_batched, check_batched_with, Batched};
pub use gradients::{check_gradients, GradCheck};
pub use model::check_model_gradients;

use arbor_core::rng::Rng;

/// `len` values uniform in `[-1, 1)`.
fn uniform_rows(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.range(-1.0, 1.0)).collect()
}

/// The function's parameters from its initialisers, each moved by up to ±0.1 (so zero-initialised
/// biases are not zero and every gradient path is exercised).
fn random_params(f: &arbor_core::ir::VertexFn, rng: &mut Rng) -> Vec<Vec<f32>> {
    let params = f.init_params(rng);
    params.into_iter().map(|p| p.iter().map(|x| x + rng.range(-0.1, 0.1)).collect()).collect()
}
