//! arbor-batching: turns a minibatch of input graphs into batched tasks and plans its memory.
//!
//! The graphs are merged into one vertex space, graph by graph ([`Merged`]). A [`Policy`] puts
//! every vertex in a task, the [`Scheduler`] orders rows by task and builds the gather index plan
//! ([`Schedule`]), and [`MemoryPlan`] places every value of every task in one arena.

mod memory;
mod merged;
mod policy;
mod schedule;

pub use memory::{Lifetime, MemoryLayout, MemoryPlan, Region};
pub use merged::Merged;
pub use policy::{Agenda, ByDepth, ByHeight, Policy};
pub use schedule::{Schedule, Scheduler, Stats};
