//! Substructure counts for graph models (GSN, Bouritsas et al. 2022): how many simple cycles of
//! each length pass through each node. A message-passing network cannot count cycles by itself;
//! given as part of a node's label, the counts tell a ring atom from a chain atom and a fused
//! ring from a lone one.

use crate::error::{Error, Result};

/// Path extensions the search may make per graph before it gives up: a dense graph has
/// exponentially many paths, and counting them is then not worth the wait.
pub const MAX_EXTENSIONS: u64 = 50_000_000;

/// For every node of an undirected graph (`neighbours[v]`: the nodes adjacent to `v`), the
/// number of simple cycles of length `3..=max_len` through it: `counts[v][len - 3]`. Each cycle
/// is counted once (not once per direction or starting node). The search keeps its path on a
/// heap stack (no recursion); a graph that would take more than [`MAX_EXTENSIONS`] steps, or
/// whose lists name a node it lacks, is refused.
pub fn cycle_counts(neighbours: &[Vec<u32>], max_len: usize) -> Result<Vec<Vec<u32>>> {
    counts_within(neighbours, max_len, MAX_EXTENSIONS)
}

/// [`cycle_counts`] within a budget of `max_extensions` path extensions.
fn counts_within(neighbours: &[Vec<u32>], max_len: usize, max_extensions: u64) -> Result<Vec<Vec<u32>>> {
    let n = neighbours.len();
    let lengths = max_len.saturating_sub(2);
    let mut counts = vec![vec![0u32; lengths]; n];
    if let Some((v, &u)) =
        neighbours.iter().enumerate().find_map(|(v, ns)| ns.iter().find(|&&u| u as usize >= n).map(|u| (v, u)))
    {
        let reason = format!("node {v} lists neighbour {u}, but the graph has {n} nodes");
        return Err(Error::Graph { graph: "cycle counts".into(), reason });
    }
    let mut on_path = vec![false; n];
    let mut extensions = 0u64;
    for start in 0..n {
        // The path from `start` (its smallest node: every cycle is found from its smallest node
        // only), each entry with the next of its neighbours to try.
        let mut path: Vec<(usize, usize)> = vec![(start, 0)];
        on_path[start] = true;
        while let Some(top) = path.last_mut() {
            let v = top.0;
            let Some(&w) = neighbours[v].get(top.1) else {
                on_path[v] = false;
                path.pop();
                continue;
            };
            top.1 += 1;
            let w = w as usize;
            if w == start && path.len() >= 3 {
                // Once per direction: keep the one whose second node is the smaller end.
                if path[1].0 < v {
                    for &(u, _) in &path {
                        counts[u][path.len() - 3] += 1;
                    }
                }
            } else if w > start && !on_path[w] && path.len() < max_len {
                extensions += 1;
                if extensions > max_extensions {
                    let reason = format!(
                        "more than {max_extensions} paths of up to {max_len} nodes: too dense to count its cycles"
                    );
                    return Err(Error::Graph { graph: "cycle counts".into(), reason });
                }
                on_path[w] = true;
                path.push((w, 0));
            }
        }
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Undirected adjacency lists from an edge list.
    fn graph(n: usize, edges: &[(u32, u32)]) -> Vec<Vec<u32>> {
        let mut g = vec![Vec::new(); n];
        for &(a, b) in edges {
            g[a as usize].push(b);
            g[b as usize].push(a);
        }
        g
    }

    #[test]
    fn a_ring_counts_once_per_node() {
        let ring = graph(6, &[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0)]);
        let c = cycle_counts(&ring, 6).unwrap();
        assert!(c.iter().all(|v| v == &[0, 0, 0, 1]), "{c:?}");
        // Shorter than the ring: nothing to count.
        assert!(cycle_counts(&ring, 5).unwrap().iter().all(|v| v.iter().all(|&x| x == 0)));
    }

    #[test]
    fn fused_rings_share_their_bond() {
        // Naphthalene's skeleton: two 6-rings sharing the bond 0–5 (a 10-ring around both).
        let edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0), (5, 6), (6, 7), (7, 8), (8, 9), (9, 0)];
        let c = cycle_counts(&graph(10, &edges), 10).unwrap();
        // Lengths 3..=10: the shared atoms sit on both 6-rings and the 10-ring.
        assert_eq!(c[0], [0, 0, 0, 2, 0, 0, 0, 1]);
        assert_eq!(c[5], [0, 0, 0, 2, 0, 0, 0, 1]);
        assert_eq!(c[2], [0, 0, 0, 1, 0, 0, 0, 1]);
        assert_eq!(c[7], [0, 0, 0, 1, 0, 0, 0, 1]);
    }

    #[test]
    fn a_complete_graph_counts_every_cycle() {
        // K4: four triangles (three through each node) and three 4-cycles (all through each).
        let k4 = graph(4, &[(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]);
        let c = cycle_counts(&k4, 4).unwrap();
        assert!(c.iter().all(|v| v == &[3, 3]), "{c:?}");
        // A tree and a lone node have none; too short a bound counts nothing.
        let tree = graph(5, &[(0, 1), (1, 2), (1, 3)]);
        assert!(cycle_counts(&tree, 8).unwrap().iter().all(|v| v.iter().all(|&x| x == 0)));
        assert_eq!(cycle_counts(&k4, 2).unwrap(), vec![Vec::<u32>::new(); 4]);
    }

    #[test]
    fn a_bad_neighbour_or_a_dense_graph_is_refused() {
        let e = cycle_counts(&[vec![1], vec![0, 7]], 4).unwrap_err().to_string();
        assert!(e.contains("node 1") && e.contains("neighbour 7"), "{e}");
        // K30's paths of up to 12 nodes number about 30!/18!: beyond any budget (a small one
        // here, to keep the test quick); K5's within it.
        let complete = |n: u32| -> Vec<Vec<u32>> { (0..n).map(|v| (0..n).filter(|&u| u != v).collect()).collect() };
        let e = counts_within(&complete(30), 12, 10_000).unwrap_err().to_string();
        assert!(e.contains("more than 10000 paths of up to 12 nodes"), "{e}");
        // K5: 10 triangles, 15 4-cycles, 12 5-cycles; through each node 6, 12 and 12.
        assert!(counts_within(&complete(5), 5, 10_000).unwrap().iter().all(|c| c == &[6, 12, 12]));
    }
}
