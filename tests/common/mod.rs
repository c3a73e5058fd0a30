//! Helpers shared by integration tests.
#![allow(dead_code)]

pub mod host_c;
pub mod kernels;
pub mod optim;
pub mod watched;

use arbor::optim::{Config, Rule};
use arbor::zoo::{GraphCell, GraphTraining};

/// The short cross-validation of MUTAG the graph tests run for `cell`: 3 message-passing steps,
/// features 8 and states 16 wide, 40 epochs of Adam at 0.01, 3 folds.
pub fn short_mutag_run(cell: GraphCell) -> GraphTraining {
    GraphTraining {
        steps: 3,
        features: 8,
        hidden: 16,
        epochs: 40,
        folds: 3,
        optimizer: Config::new(Rule::Adam, 0.01),
        ..GraphTraining::new(cell)
    }
}
