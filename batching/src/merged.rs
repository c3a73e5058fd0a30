//! The graphs of a minibatch seen as one graph: vertex ids are numbered graph by graph.

use arbor_core::graph::{InputGraph, NO_CHILD};
use bumpalo::collections::Vec as BumpVec;
use bumpalo::Bump;

/// A minibatch of graphs in one vertex index space.
pub struct Merged<'a> {
    graphs: &'a [&'a InputGraph],
    starts: &'a [usize],
}

impl<'a> Merged<'a> {
    /// Merges `graphs`; `starts` holds each graph's first merged vertex and the total at the end.
    pub fn new(graphs: &'a [&'a InputGraph], starts: &'a [usize]) -> Merged<'a> {
        Merged { graphs, starts }
    }

    /// Number of vertices.
    pub fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// Whether there is no vertex.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The graph holding merged vertex `v`, and the first merged vertex of that graph.
    pub fn locate(&self, v: usize) -> (usize, usize) {
        let g = self.starts.partition_point(|&s| s <= v) - 1;
        (g, self.starts[g])
    }

    /// The child slots of merged vertex `v`, as merged ids (`NO_CHILD` kept for empty slots).
    pub fn slots(&self, v: usize) -> impl Iterator<Item = u32> + '_ {
        let (g, base) = self.locate(v);
        self.graphs[g].children(v - base).iter().map(move |&c| if c == NO_CHILD { NO_CHILD } else { c + base as u32 })
    }

    /// The children of merged vertex `v` (empty slots skipped).
    pub fn children(&self, v: usize) -> impl Iterator<Item = usize> + '_ {
        self.slots(v).filter(|&c| c != NO_CHILD).map(|c| c as usize)
    }

    /// Every vertex, each after all of its children (an iterative post-order walk).
    pub fn children_first<'b>(&self, bump: &'b Bump) -> BumpVec<'b, usize> {
        let n = self.len();
        let mut done = BumpVec::from_iter_in(std::iter::repeat_n(false, n), bump);
        let mut order = BumpVec::with_capacity_in(n, bump);
        let mut stack = BumpVec::new_in(bump);
        for root in 0..n {
            stack.push((root, false));
            while let Some((v, expanded)) = stack.pop() {
                if done[v] {
                    continue;
                }
                if expanded {
                    done[v] = true;
                    order.push(v);
                } else {
                    stack.push((v, true));
                    stack.extend(self.children(v).filter(|&c| !done[c]).map(|c| (c, false)));
                }
            }
        }
        order
    }
}
