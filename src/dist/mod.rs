//! Distributed training: the [`Collective`] seam (threads in one process, MPI processes),
//! data-parallel steps, and pipeline-parallel schedules and stages.

pub mod collective;
pub mod data_parallel;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod pipeline;
pub mod schedule;

pub use collective::{Collective, Mailbox, ThreadCollective, DEFAULT_TIMEOUT};
