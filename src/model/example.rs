//! What a model reads: the feeds of the bottom vertex function's inputs, and examples of one or
//! more graphs ([`Tree`]s) with a target, with which of their trees share a run of the cells.

use crate::ir::Reduce;
use crate::readout::Pool;
use crate::InputGraph;

/// What feeds an input of the vertex function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feed {
    /// Each vertex's own word vector.
    Words,
    /// The word vector of the vertex's parent, the padding row at a root: for a gate computed at
    /// the child on the parent's behalf (see
    /// [`child_sum_tree_lstm_nary`](crate::nn::child_sum_tree_lstm_nary)).
    ParentWords,
    /// The label of the edge from the vertex's parent as a one-hot row of this many columns
    /// (zeros at a root, or where the label does not fit): in a dependency tree, the vertex's
    /// relation to its head, for a cell to embed with a product (`rel · W`).
    ParentEdge(usize),
    /// The feature rows of the edges to the vertex's children
    /// ([`InputGraph::with_edge_features`], this many values each) reduced over the children as
    /// the [`Reduce`] says (zeros at a leaf): what bonds or relations a vertex has, for a cell to
    /// map with a product (`e · W`). A cell that weighs each child's state by its own edge's
    /// values reads them itself ([`Builder::gather_weighted`](crate::Builder::gather_weighted)).
    ChildEdges(usize, Reduce),
    /// The vertex's height ([`InputGraph::heights`]: 0 at a leaf, one above its highest child) as
    /// a one-hot row of this many columns (a height past the last column counts as the last): in
    /// a graph unrolled for message passing, the step, for a cell to weigh each step apart (as
    /// GIN's layers do not share weights, see [`gin_per_step`](crate::nn::gin_per_step)).
    Height(usize),
}

/// One graph of an example: its structure, a word per vertex, and the vertex the head reads.
#[derive(Clone, Debug)]
pub struct Tree<'a> {
    /// The structure.
    pub graph: &'a InputGraph,
    /// A word id per vertex.
    pub words: &'a [u32],
    /// The vertex read out (a root).
    pub root: usize,
    /// The vertices a pooling readout ([`Readout::pools`](crate::readout::Readout::pools)) reads: every vertex by default; an
    /// unrolled graph pools its last step ([`Pool::Range`] or [`Pool::Roots`]).
    pub pool: Pool<'a>,
}

impl<'a> Tree<'a> {
    /// `graph` over `words`, read out at `root`, pooled (if the readout pools) over every vertex.
    pub fn new(graph: &'a InputGraph, words: &'a [u32], root: usize) -> Tree<'a> {
        Tree { graph, words, root, pool: Pool::All }
    }

    /// The same graph and words pooled over `pool`.
    pub fn pooled(self, pool: Pool<'a>) -> Tree<'a> {
        Tree { pool, ..self }
    }
}

/// One example: its graphs (as many as the head reads) and its target row.
///
/// Trees of one example over the same graph and words (the same references) that differ in
/// root or pool — an unrolled graph pooled over each of its steps, say, or two roots of one
/// forest — run once and are read as often as named ([`Example::placed`]).
#[derive(Clone, Debug)]
pub struct Example<'a> {
    /// The graphs, in the order of the head's inputs.
    pub trees: Vec<Tree<'a>>,
    /// The target the head's last input pulls: one row, or with [`Readout::Vertices`](crate::readout::Readout::Vertices) one row
    /// per vertex, in vertex order.
    pub target: Vec<f32>,
}

impl<'a> Example<'a> {
    /// For each tree, the tree whose run of the cells it reads: the first earlier one over the
    /// same graph and words (the same references) that runs and whose readers all differ from
    /// it in root or pool, or itself.
    pub fn placed(&self) -> Vec<usize> {
        let mut placed: Vec<usize> = Vec::with_capacity(self.trees.len());
        for (t, tree) in self.trees.iter().enumerate() {
            let shares = |&r: &usize| {
                let run = &self.trees[r];
                std::ptr::eq(run.graph, tree.graph)
                    && std::ptr::eq(run.words, tree.words)
                    && !(0..t)
                        .any(|u| placed[u] == r && self.trees[u].root == tree.root && self.trees[u].pool == tree.pool)
            };
            let runs = (0..t).filter(|&u| placed[u] == u);
            placed.push(runs.into_iter().find(shares).unwrap_or(t));
        }
        placed
    }

    /// The graphs the cells run over for this example, each run once ([`Example::placed`]).
    pub fn graphs(&self) -> impl Iterator<Item = &'a InputGraph> + '_ {
        let placed = self.placed();
        self.trees.iter().enumerate().filter(move |&(t, _)| placed[t] == t).map(|(_, tree)| tree.graph)
    }
}
