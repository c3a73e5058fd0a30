//! From a minibatch of graphs to batched tasks, rows and gather index plans.

use crate::merged::Merged;
use crate::policy::{ByHeight, Policy};
use arbor_core::backend::NO_ROW;
use arbor_core::graph::{InputGraph, NO_CHILD};
use bumpalo::collections::Vec as BumpVec;
use bumpalo::Bump;
use std::fmt;
use std::ops::Range;

/// The batched schedule of one minibatch.
///
/// Every vertex gets a *row*: rows are ordered by task, so every task is a contiguous row range
/// and every per-vertex value of a task is one contiguous block of memory.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Schedule {
    /// Row ranges of the forward tasks, in execution order (backward runs them in reverse).
    pub tasks: Vec<Range<usize>>,
    /// The merged vertex at each row.
    pub vertex_of_row: Vec<u32>,
    /// The row of each merged vertex.
    pub row_of_vertex: Vec<u32>,
    /// First merged vertex of each graph, and the total at the end.
    pub graph_starts: Vec<usize>,
    /// `child_rows[k][row]`: the row of that vertex's child in slot `k`, or `NO_ROW`, for the
    /// slots the scheduler was asked to lay out (a vertex function's arity); every child of every
    /// slot is in `child_list`, so memory grows with the edges, not with the widest vertex.
    pub child_rows: Vec<Vec<u32>>,
    /// Children's rows of each row (all slots): `child_list[child_offsets[r]..child_offsets[r + 1]]`.
    pub child_offsets: Vec<u32>,
    /// See `child_offsets`.
    pub child_list: Vec<u32>,
    /// The label of the edge to each child of `child_list` (0 when edges carry none).
    pub child_labels: Vec<u32>,
    /// The first [`Scheduler::set_edge_features`] values of the feature row of the edge to each
    /// child of `child_list`, one row after another (empty unless asked for).
    pub child_features: Vec<f32>,
}

/// Summary numbers of a schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Number of tasks.
    pub tasks: usize,
    /// Number of vertices.
    pub vertices: usize,
    /// Mean vertices per task.
    pub mean_task: f64,
    /// Largest task.
    pub max_task: usize,
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} vertices in {} tasks (mean {:.1}, max {})",
            self.vertices, self.tasks, self.mean_task, self.max_task
        )
    }
}

impl Schedule {
    /// Total vertices.
    pub fn len(&self) -> usize {
        self.vertex_of_row.len()
    }

    /// Whether the minibatch has no vertex.
    pub fn is_empty(&self) -> bool {
        self.vertex_of_row.is_empty()
    }

    /// The largest task, in vertices.
    pub fn max_task(&self) -> usize {
        self.tasks.iter().map(Range::len).max().unwrap_or(0)
    }

    /// Summary numbers.
    pub fn stats(&self) -> Stats {
        let tasks = self.tasks.len();
        Stats {
            tasks,
            vertices: self.len(),
            mean_task: if tasks == 0 { 0.0 } else { self.len() as f64 / tasks as f64 },
            max_task: self.max_task(),
        }
    }
}

/// Builds schedules with a policy, keeping its scratch in a bump arena reset per minibatch.
pub struct Scheduler {
    policy: Box<dyn Policy>,
    bump: Bump,
    /// Values of each edge's feature row laid out beside the child list.
    edge_features: usize,
}

impl Default for Scheduler {
    fn default() -> Scheduler {
        Scheduler::new(Box::new(ByHeight))
    }
}

impl Scheduler {
    /// A scheduler using `policy`.
    pub fn new(policy: Box<dyn Policy>) -> Scheduler {
        Scheduler { policy, bump: Bump::new(), edge_features: 0 }
    }

    /// Lays out the first `width` values of the feature row of the edge to every child beside
    /// the child list ([`Schedule::child_features`]; the graphs' rows must hold them, or zeros
    /// are laid out instead).
    pub fn set_edge_features(&mut self, width: usize) {
        self.edge_features = width;
    }

    /// The policy's name.
    pub fn policy(&self) -> &'static str {
        self.policy.name()
    }

    /// Schedules `graphs` into `out`, reusing its memory, with `child_rows` for the first `slots`
    /// child slots (the fixed slots a vertex function reads with `gather(k, …)`).
    pub fn schedule(&mut self, graphs: &[&InputGraph], slots: usize, out: &mut Schedule) {
        self.bump.reset();
        let bump = &self.bump;
        out.graph_starts.clear();
        out.graph_starts.push(0);
        for g in graphs {
            let last = out.graph_starts[out.graph_starts.len() - 1];
            out.graph_starts.push(last + g.len());
        }
        let merged = Merged::new(graphs, &out.graph_starts);
        let n = merged.len();
        let mut task_of = BumpVec::from_iter_in(std::iter::repeat_n(0u32, n), bump);
        let tasks = self.policy.assign(&merged, bump, &mut task_of);

        // Rows by counting sort on the task, stable in vertex order.
        let mut starts = BumpVec::from_iter_in(std::iter::repeat_n(0usize, tasks + 1), bump);
        for &t in task_of.iter() {
            starts[t as usize + 1] += 1;
        }
        for t in 0..tasks {
            starts[t + 1] += starts[t];
        }
        out.tasks.clear();
        out.tasks.extend((0..tasks).map(|t| starts[t]..starts[t + 1]));
        out.row_of_vertex.clear();
        out.row_of_vertex.resize(n, 0);
        out.vertex_of_row.clear();
        out.vertex_of_row.resize(n, 0);
        for (v, &t) in task_of.iter().enumerate() {
            let r = starts[t as usize];
            starts[t as usize] += 1;
            out.row_of_vertex[v] = r as u32;
            out.vertex_of_row[r] = v as u32;
        }

        let arity = (0..n).map(|v| merged.slots(v).count()).max().unwrap_or(0).min(slots);
        out.child_rows.truncate(arity);
        out.child_rows.resize_with(arity, Vec::new);
        for rows in &mut out.child_rows {
            rows.clear();
            rows.resize(n, NO_ROW);
        }
        out.child_offsets.clear();
        out.child_offsets.push(0);
        out.child_list.clear();
        out.child_labels.clear();
        out.child_features.clear();
        let width = self.edge_features;
        for r in 0..n {
            let v = out.vertex_of_row[r] as usize;
            let labels = merged.labels(v);
            let (features, has) = merged.features(v);
            for (k, c) in merged.slots(v).enumerate() {
                if c != NO_CHILD {
                    let cr = out.row_of_vertex[c as usize];
                    if k < arity {
                        out.child_rows[k][r] = cr;
                    }
                    out.child_list.push(cr);
                    out.child_labels.push(labels.get(k).copied().unwrap_or(0));
                    if width > 0 {
                        let row = features.get(k * has..k * has + width.min(has)).unwrap_or_default();
                        out.child_features.extend(row.iter().copied().chain(std::iter::repeat(0.0)).take(width));
                    }
                }
            }
            out.child_offsets.push(out.child_list.len() as u32);
        }
    }
}
