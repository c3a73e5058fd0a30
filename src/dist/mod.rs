//! Distributed training: the [`Collective`] seam (threads in one process, MPI processes),
//! data-parallel steps, and pipeline-parallel schedules and stages.

pub mod collective;
pub mod data_parallel;
#[cfg(feature = "mpi")]
pub mod mpi;

pub use collective::{Collective, ThreadCollective, DEFAULT_TIMEOUT};
