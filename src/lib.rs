#![doc = include_str!("guide.md")]

pub mod average;
pub mod checkpoint;
pub mod data;
pub mod dist;
pub mod ensemble;
pub mod head;
pub mod layers;
pub mod loss_scale;
pub mod metrics;
pub mod model;
pub mod nn;
pub mod optim;
pub mod pipeline;
pub mod plot;
pub mod readout;
pub mod run_folder;
#[cfg(feature = "testing")]
pub mod testing;
pub mod trainer;
pub mod zoo;

pub use arbor_batching as batching;
pub use arbor_core::backend::Backend;
pub use arbor_core::dropout::DropoutKey;
pub use arbor_core::graph::InputGraph;
pub use arbor_core::ir::{Builder, Init, Reduce, Var, VertexFn};
pub use arbor_core::{
    attention, backend, dropout, error, finite, fusion, gate, graph, ir, memory, profile, ptb, rng, tensor,
};
pub use arbor_core::{Error, Result, Shape};
#[cfg(feature = "cuda")]
pub use arbor_cuda as cuda;
pub use arbor_engine as engine;
pub use arbor_ops::cpu::{budget as cpu_thread_budget, isa, with_threads as with_cpu_threads, HostBuffer};
pub use arbor_ops::CpuBackend;
pub use engine::{Engine, Gradients, Pass, Planned, Planner, Pull, SparseGrad};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
struct ReadmeDoctests;
