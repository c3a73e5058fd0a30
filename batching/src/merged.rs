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

    /// The labels of the edges to merged vertex `v`'s child slots (empty when its graph's edges
    /// carry none: every label 0).
    pub fn labels(&self, v: usize) -> &'a [u32] {
        let (g, base) = self.locate(v);
        self.graphs[g].edge_labels(v - base)
    }

    /// The feature rows of the edges to merged vertex `v`'s child slots, one after another, and
    /// how many values each holds (empty, 0, when its graph's edges carry none).
    pub fn features(&self, v: usize) -> (&'a [f32], usize) {
        let (g, base) = self.locate(v);
        (self.graphs[g].edge_features(v - base), self.graphs[g].edge_feature_width())
    }

    /// The children of merged vertex `v` (empty slots skipped).
    pub fn children(&self, v: usize) -> impl Iterator<Item = usize> + '_ {
        self.slots(v).filter(|&c| c != NO_CHILD).map(|c| c as usize)
    }

    /// Every vertex, each after all of its children: each graph's order (computed when the
    /// graph was built), graph by graph.
    pub fn children_first<'b>(&self, bump: &'b Bump) -> BumpVec<'b, usize> {
        let mut order = BumpVec::with_capacity_in(self.len(), bump);
        for (g, &base) in self.graphs.iter().zip(self.starts) {
            order.extend(g.children_first().iter().map(|&v| base + v as usize));
        }
        order
    }
}
