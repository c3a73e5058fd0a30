//! [`proptest`](mod@proptest) strategies for input graphs, sized by their arguments, and the seeded generators
//! behind them. Each strategy draws a vertex count and a seed, so a failing case shrinks to fewer
//! vertices.
//!
//! ```
//! # use arbor_core as arbor; // as the `arbor` crate re-exports it
//! use arbor::testing::strategy;
//! use proptest::prelude::*;
//!
//! proptest!(ProptestConfig::with_cases(16), |(g in strategy::trees(2, 1..=40))| {
//!     prop_assert_eq!(g.roots().len(), 1);
//!     prop_assert!((0..g.len()).all(|v| g.children(v).len() <= 2));
//! });
//! ```

use crate::graph::InputGraph;
use crate::ir::VertexFn;
use crate::rng::Rng;
use proptest::collection::SizeRange;
use proptest::prelude::*;
use std::ops::RangeInclusive;

/// Random rooted trees of `vertices` vertices (at least one), each with up to `arity` children
/// in its ordered slots, some slots left empty (a vertex with only a right child, say): the
/// input of a vertex function of that arity, e.g. `trees(2, 1..=30)` for a binary Tree-LSTM.
pub fn trees(arity: usize, vertices: RangeInclusive<usize>) -> impl Strategy<Value = InputGraph> {
    sized(vertices, move |rng, n| tree(rng, n, arity))
}

/// Random rooted trees whose vertices have any number of children up to `max_children`, in
/// order and without empty slots: the input of a child-sum cell ([`gather_sum`]).
///
/// [`gather_sum`]: crate::ir::Builder::gather_sum
pub fn nary_trees(max_children: usize, vertices: RangeInclusive<usize>) -> impl Strategy<Value = InputGraph> {
    sized(vertices, move |rng, n| nary_tree(rng, n, max_children))
}

/// Chains of `lengths` vertices (sequences: vertex `i` has vertex `i − 1` as its child).
pub fn chains(lengths: RangeInclusive<usize>) -> impl Strategy<Value = InputGraph> {
    lengths.prop_map(|n| InputGraph::chain(n.max(1)))
}

/// Random DAGs: each vertex fills each of its `arity` slots (0–3 children when `arity` is 0)
/// with an earlier vertex with probability 0.7, so a vertex may have several parents.
pub fn dags(arity: usize, vertices: RangeInclusive<usize>) -> impl Strategy<Value = InputGraph> {
    sized(vertices, move |rng, n| InputGraph::random(rng, n, arity, true))
}

/// Random forests: as [`dags`], but a vertex is a child at most once (several roots).
pub fn forests(arity: usize, vertices: RangeInclusive<usize>) -> impl Strategy<Value = InputGraph> {
    sized(vertices, move |rng, n| InputGraph::random(rng, n, arity, false))
}

/// Random trees that suit `f`: [`nary_trees`] (up to 4 children) when it takes any number of
/// children, [`trees`] of its arity otherwise (chains for arity 1, isolated vertices for 0);
/// their edges carry feature rows as wide as `f` reads ([`with_edge_features`]).
pub fn trees_for(f: &VertexFn, vertices: RangeInclusive<usize>) -> BoxedStrategy<InputGraph> {
    let graphs = match (f.max_children(), f.arity()) {
        (None, a) => nary_trees(a.max(4), vertices).boxed(),
        (Some(0), _) => vertices.prop_map(|n| InputGraph::isolated(n.max(1))).boxed(),
        (Some(1), _) => chains(vertices).boxed(),
        (Some(a), _) => trees(a, vertices).boxed(),
    };
    match f.edge_feature_width() {
        0 => graphs,
        width => {
            (graphs, any::<u64>()).prop_map(move |(g, seed)| with_edge_features(g, width, &mut Rng::new(seed))).boxed()
        }
    }
}

/// `g` with a feature row of `width` values in `[-1, 1)` on every edge, drawn from `rng`: what a
/// function weighing its children by edge features (`gather_weighted`) reads.
pub fn with_edge_features(g: InputGraph, width: usize, rng: &mut Rng) -> InputGraph {
    let rows = (0..g.len()).map(|v| (0..g.children(v).len() * width).map(|_| rng.range(-1.0, 1.0)).collect()).collect();
    // The rows match the slots and are finite, so the graph takes them.
    g.clone().with_edge_features(width, rows).unwrap_or(g)
}

/// Minibatches: `count` graphs drawn from `graph`, e.g. `minibatches(trees(2, 1..=20), 1..=8)`.
pub fn minibatches<S: Strategy<Value = InputGraph>>(
    graph: S,
    count: impl Into<SizeRange>,
) -> impl Strategy<Value = Vec<InputGraph>> {
    proptest::collection::vec(graph, count)
}

/// A random rooted tree of `n` vertices (at least one) with up to `arity` (at least one)
/// children in ordered slots, as [`trees`] draws it: the root is the last vertex and every child
/// comes before its parent.
pub fn tree(rng: &mut Rng, n: usize, arity: usize) -> InputGraph {
    let (n, arity) = (n.max(1), arity.max(1));
    // Vertex k (from the root, k = 0) becomes id n − 1 − k and takes a random open slot of an
    // earlier (higher) vertex.
    let mut children: Vec<Vec<Option<usize>>> = vec![vec![None; arity]; n];
    let mut open: Vec<(usize, usize)> = (0..arity).map(|s| (n - 1, s)).collect();
    for id in (0..n - 1).rev() {
        let (parent, slot) = open.swap_remove(rng.below(open.len()));
        children[parent][slot] = Some(id);
        open.extend((0..arity).map(|s| (id, s)));
    }
    // A vertex's trailing empty slots say nothing: a leaf has no slots at all.
    for slots in &mut children {
        while slots.last() == Some(&None) {
            slots.pop();
        }
    }
    InputGraph::from_children(children).expect("every child is a lower id than its parent")
}

/// A random rooted tree of `n` vertices (at least one) whose vertices have up to
/// `max_children` (at least one) children without empty slots, as [`nary_trees`] draws it.
pub fn nary_tree(rng: &mut Rng, n: usize, max_children: usize) -> InputGraph {
    let (n, max_children) = (n.max(1), max_children.max(1));
    let mut children: Vec<Vec<Option<usize>>> = vec![Vec::new(); n];
    let mut open: Vec<usize> = vec![n - 1];
    for id in (0..n - 1).rev() {
        let at = rng.below(open.len());
        let parent = open[at];
        children[parent].push(Some(id));
        if children[parent].len() == max_children {
            open.swap_remove(at);
        }
        open.push(id);
    }
    InputGraph::from_children(children).expect("every child is a lower id than its parent")
}

/// A strategy over graphs made by `make` from a vertex count in `vertices` and a seeded [`Rng`].
fn sized(
    vertices: RangeInclusive<usize>,
    make: impl Fn(&mut Rng, usize) -> InputGraph + Clone,
) -> impl Strategy<Value = InputGraph> {
    (vertices, any::<u64>()).prop_map(move |(n, seed)| make(&mut Rng::new(seed), n.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Builder;
    use proptest::test_runner::TestRunner;

    /// A function weighing its children by edge feature 2 gets trees whose every edge carries
    /// three values; one reading no edges gets trees whose edges carry none.
    #[test]
    fn trees_for_carry_the_edge_features_a_function_reads() {
        let function = |weighted: bool| {
            let f = Builder::new("f", 0);
            let x = f.pull("x", 2);
            let children = if weighted { f.gather_weighted(2, "h", 2) } else { f.gather_sum("h", 2) };
            f.scatter("h", x + children);
            f.build().expect("a function")
        };
        let mut runner = TestRunner::deterministic();
        for (weighted, width) in [(true, 3), (false, 0)] {
            let f = function(weighted);
            let strategy = trees_for(&f, 1..=20);
            for _ in 0..16 {
                let g = strategy.new_tree(&mut runner).expect("a tree").current();
                assert_eq!(g.edge_feature_width(), width);
                assert!(g.check_for(&f).is_ok());
                for v in 0..g.len() {
                    assert_eq!(g.edge_features(v).len(), g.children(v).len() * width, "vertex {v}");
                }
            }
        }
    }
}
