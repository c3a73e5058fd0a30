//! arbor-batching: turns a minibatch of input graphs into batched tasks.
//!
//! The graphs are merged into one vertex space (graph by graph). Every vertex gets a *row*: rows
//! are ordered by task, so every task is a contiguous row range and every per-vertex value of a
//! task is a contiguous block of memory. The schedule also holds the gather index plan: for each
//! child slot, the row of each vertex's child.

use arbor_core::backend::NO_ROW;
use arbor_core::graph::{InputGraph, NO_CHILD};
use std::ops::Range;

/// The batched schedule of one minibatch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Row ranges of the forward tasks, in execution order (backward runs them in reverse).
    pub tasks: Vec<Range<usize>>,
    /// The merged vertex at each row.
    pub vertex_of_row: Vec<u32>,
    /// The row of each merged vertex.
    pub row_of_vertex: Vec<u32>,
    /// First merged vertex of each graph (and the total at the end).
    pub graph_starts: Vec<usize>,
    /// `child_rows[k][row]`: the row of that vertex's child in slot `k`, or `NO_ROW`.
    pub child_rows: Vec<Vec<u32>>,
    /// For each row, its children's rows (all slots): `child_list[child_offsets[r]..child_offsets[r + 1]]`.
    pub child_offsets: Vec<u32>,
    /// See `child_offsets`.
    pub child_list: Vec<u32>,
}

impl Schedule {
    /// Schedules by height: leaves of all graphs first, then every vertex whose highest child is
    /// one below it, and so on. For trees this gives the fewest tasks.
    pub fn by_height(graphs: &[&InputGraph]) -> Schedule {
        let mut graph_starts = vec![0];
        for g in graphs {
            graph_starts.push(graph_starts.last().copied().unwrap_or(0) + g.len());
        }
        let total = *graph_starts.last().unwrap_or(&0);
        let arity = graphs
            .iter()
            .flat_map(|g| (0..g.len()).map(|v| g.children(v).len()))
            .max()
            .unwrap_or(0);
        // Heights by an iterative post-order walk (graphs may be deep).
        let mut height = vec![u32::MAX; total];
        for (gi, g) in graphs.iter().enumerate() {
            let base = graph_starts[gi];
            let mut stack: Vec<(u32, bool)> = Vec::new();
            for root in 0..g.len() {
                if height[base + root] != u32::MAX {
                    continue;
                }
                stack.push((root as u32, false));
                while let Some((v, expanded)) = stack.pop() {
                    let kids = g.children(v as usize).iter().filter(|&&c| c != NO_CHILD);
                    if expanded {
                        let h = kids
                            .map(|&c| height[base + c as usize] + 1)
                            .max()
                            .unwrap_or(0);
                        height[base + v as usize] = h;
                    } else if height[base + v as usize] == u32::MAX {
                        stack.push((v, true));
                        for &c in kids {
                            if height[base + c as usize] == u32::MAX {
                                stack.push((c, false));
                            }
                        }
                    }
                }
            }
        }
        let levels = height.iter().copied().max().map_or(0, |h| h as usize + 1);
        let mut counts = vec![0usize; levels + 1];
        for &h in &height {
            counts[h as usize + 1] += 1;
        }
        for l in 0..levels {
            counts[l + 1] += counts[l];
        }
        let tasks: Vec<Range<usize>> = (0..levels).map(|l| counts[l]..counts[l + 1]).collect();
        let mut next = counts;
        let mut row_of_vertex = vec![0u32; total];
        let mut vertex_of_row = vec![0u32; total];
        for (v, &h) in height.iter().enumerate() {
            let r = next[h as usize];
            next[h as usize] += 1;
            row_of_vertex[v] = r as u32;
            vertex_of_row[r] = v as u32;
        }
        let mut child_rows = vec![vec![NO_ROW; total]; arity];
        let mut child_offsets = Vec::with_capacity(total + 1);
        let mut child_list = Vec::new();
        child_offsets.push(0);
        for &v in &vertex_of_row {
            let v = v as usize;
            let gi = graph_starts.partition_point(|&s| s <= v) - 1;
            let base = graph_starts[gi];
            let r = row_of_vertex[v] as usize;
            for (k, &c) in graphs[gi].children(v - base).iter().enumerate() {
                if c != NO_CHILD {
                    let cr = row_of_vertex[base + c as usize];
                    child_rows[k][r] = cr;
                    child_list.push(cr);
                }
            }
            child_offsets.push(child_list.len() as u32);
        }
        Schedule {
            tasks,
            vertex_of_row,
            row_of_vertex,
            graph_starts,
            child_rows,
            child_offsets,
            child_list,
        }
    }

    /// Total vertices.
    pub fn len(&self) -> usize {
        self.vertex_of_row.len()
    }

    /// Whether the minibatch has no vertex.
    pub fn is_empty(&self) -> bool {
        self.vertex_of_row.is_empty()
    }
}
