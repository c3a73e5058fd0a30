//! Distributed training's parts: the [`Collective`] seam (threads in one process, MPI
//! processes), what data-parallel steps share and sum, pipeline schedules (the stages that
//! run them are in `pipeline`), and the planner that chooses stages × replicas.

pub mod collective;
pub mod data_parallel;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod planner;
pub mod schedule;

pub use collective::{Collective, Mailbox, Replicas, ThreadCollective, DEFAULT_TIMEOUT};
