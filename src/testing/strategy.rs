//! [`proptest`](mod@proptest) strategies for input graphs: those of [`arbor_core::testing::strategy`] and
//! [`message_passing`], graphs with cycles unrolled into the DAGs a graph network runs over.

pub use arbor_core::testing::strategy::*;

use crate::data::tu::GraphExample;
use crate::graph::InputGraph;
use crate::rng::Rng;
use proptest::prelude::*;
use std::ops::RangeInclusive;

/// Random undirected graphs of `nodes` nodes (each pair joined with probability 0.3), unrolled
/// for `steps` rounds of message passing ([`GraphExample::unroll`]): the input of
/// [`nn::ggnn`](crate::nn::ggnn) and other cells that gather their neighbours' states.
pub fn message_passing(
    nodes: RangeInclusive<usize>,
    steps: RangeInclusive<usize>,
) -> impl Strategy<Value = InputGraph> {
    (nodes, steps, any::<u64>()).prop_map(|(n, steps, seed)| {
        // `graph` makes one neighbour list and one label list per node, neighbours in range.
        graph(&mut Rng::new(seed), n.max(1)).unroll(steps, 0).expect("a generated graph unrolls")
    })
}

/// A random undirected graph of `n` nodes, each pair joined with probability 0.3, as
/// [`message_passing`] draws it (node and edge labels 0, class 0).
pub fn graph(rng: &mut Rng, n: usize) -> GraphExample {
    let mut neighbours = vec![Vec::new(); n];
    for a in 0..n {
        for b in a + 1..n {
            if rng.uniform() < 0.3 {
                neighbours[a].push(b as u32);
                neighbours[b].push(a as u32);
            }
        }
    }
    let edge_labels = neighbours.iter().map(|n| vec![0; n.len()]).collect();
    GraphExample { node_labels: vec![0; n], neighbours, edge_labels, edge_features: Vec::new(), label: 0 }
}
