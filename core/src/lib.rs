//! arbor-core: shapes, the vertex-function IR and its builder, symbolic autodiff, fusion
//! planning, input graphs, the [`Backend`](backend::Backend) trait and the error type.

pub mod attention;
pub mod backend;
pub mod dropout;
pub mod error;
pub mod finite;
pub mod fusion;
pub mod gate;
pub mod graph;
pub mod ir;
pub mod memory;
pub mod optim;
pub mod profile;
pub mod ptb;
pub mod rng;
pub mod tensor;

pub use error::{Error, Result};
pub use tensor::Shape;
#[cfg(feature = "testing")]
pub mod testing;
