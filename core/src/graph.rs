//! Input graphs: one per example, a DAG whose vertices have ordered child slots.

use crate::error::{Error, Result};
use crate::ir::VertexFn;
use petgraph::graph::{DiGraph, NodeIndex};
use smallvec::SmallVec;

/// Marks an empty child slot.
pub const NO_CHILD: u32 = u32::MAX;

/// A validated DAG: for every vertex, its children in slot order (`NO_CHILD` for an empty slot).
/// Children come before parents in the vertex function's data flow; roots have no parents.
///
/// Vertices are numbered `0..len()`, and every per-vertex array a run takes or returns (pulled
/// rows, pushed rows) follows that numbering. A vertex's child in slot `k` is what the vertex
/// function reads with `gather(k, …)`; a vertex may have no more slots than the function's
/// arity ([`InputGraph::check_for`]), unless the function uses `gather_sum`.
///
/// # Example
///
/// The parse tree `(a (b c))`, given by child lists and by parents; a sentence as a chain; and
/// a cycle, which is refused:
///
/// ```
/// # use arbor_core as arbor; // as the `arbor` crate re-exports it
/// use arbor::graph::InputGraph;
///
/// // Leaves a, b, c are vertices 0, 1, 2; (b c) is 3; the root is 4.
/// let tree = InputGraph::from_children(vec![vec![], vec![], vec![], vec![Some(1), Some(2)], vec![Some(0), Some(3)]])?;
/// assert_eq!(tree.roots(), [4]);
/// assert_eq!(tree.children(4), [0, 3]); // slot 0 holds a, slot 1 holds (b c)
/// let same = InputGraph::from_parents(&[Some(4), Some(3), Some(3), Some(4), None])?;
/// assert_eq!(same, tree);
///
/// let sentence = InputGraph::chain(3); // vertex i has vertex i − 1 as its only child
/// assert_eq!((sentence.children(2), sentence.roots()), (&[1][..], vec![2]));
///
/// let cycle = InputGraph::from_children(vec![vec![Some(1)], vec![Some(0)]]);
/// assert!(cycle.unwrap_err().to_string().contains("cycle"));
/// # Ok::<(), arbor_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputGraph {
    children: Vec<SmallVec<[u32; 2]>>,
    /// Per vertex, the label of the edge to each child slot; empty when edges carry no labels.
    labels: Vec<SmallVec<[u32; 2]>>,
    /// Feature rows of the edges ([`InputGraph::with_edge_features`]); none by default.
    features: EdgeFeatures,
    /// Every vertex after all of its children, computed once at construction.
    order: Vec<u32>,
}

/// A feature row per edge: vertex `v`'s slot `k` row at `values[(at[v] + k) · width..]`.
#[derive(Clone, Debug, Default, PartialEq)]
struct EdgeFeatures {
    width: usize,
    at: Vec<usize>,
    values: Vec<f32>,
}

// Feature values are finite (checked on construction), so equality is an equivalence.
impl Eq for EdgeFeatures {}

/// Vertices of a DAG given by its child lists, each after all of its children (an iterative
/// post-order walk, so deep graphs are fine).
fn children_first(children: &[SmallVec<[u32; 2]>]) -> Vec<u32> {
    let n = children.len();
    let mut done = vec![false; n];
    let mut order = Vec::with_capacity(n);
    let mut stack = Vec::new();
    for root in 0..n {
        stack.push((root, false));
        while let Some((v, expanded)) = stack.pop() {
            if done[v] {
                continue;
            }
            if expanded {
                done[v] = true;
                order.push(v as u32);
            } else {
                stack.push((v, true));
                stack.extend(
                    children[v].iter().filter(|&&c| c != NO_CHILD && !done[c as usize]).map(|&c| (c as usize, false)),
                );
            }
        }
    }
    order
}

impl InputGraph {
    /// A graph from each vertex's child slots (`None` for an empty slot). Errors name the vertex:
    /// a child index out of range, a vertex that is its own descendant (a cycle).
    pub fn from_children(children: Vec<Vec<Option<usize>>>) -> Result<InputGraph> {
        let n = children.len();
        let mut out = Vec::with_capacity(n);
        for (v, slots) in children.into_iter().enumerate() {
            let mut list = SmallVec::with_capacity(slots.len());
            for c in slots {
                match c {
                    Some(c) if c >= n => {
                        return Err(graph_error(format!("vertex {v} has child {c}, but the graph has {n} vertices")))
                    }
                    Some(c) => list.push(c as u32),
                    None => list.push(NO_CHILD),
                }
            }
            out.push(list);
        }
        let mut g =
            InputGraph { children: out, labels: Vec::new(), features: EdgeFeatures::default(), order: Vec::new() };
        g.check_acyclic()?;
        g.order = children_first(&g.children);
        Ok(g)
    }

    /// `n` vertices without edges, each its own root: the examples a head runs over, one vertex
    /// each.
    pub fn isolated(n: usize) -> InputGraph {
        InputGraph {
            children: vec![SmallVec::new(); n],
            labels: Vec::new(),
            features: EdgeFeatures::default(),
            order: (0..n as u32).collect(),
        }
    }

    /// A chain (a sequence): vertex `i` has vertex `i − 1` as its only child; the last is the root.
    pub fn chain(len: usize) -> InputGraph {
        let children = (0..len).map(|i| if i == 0 { SmallVec::new() } else { SmallVec::from_slice(&[i as u32 - 1]) });
        InputGraph {
            children: children.collect(),
            labels: Vec::new(),
            features: EdgeFeatures::default(),
            order: (0..len as u32).collect(),
        }
    }

    /// A balanced binary tree over `leaves` leaves (the leaves first, pairs merged level by
    /// level; an odd vertex out gets a one-child parent). The root is the last vertex.
    pub fn balanced_binary(leaves: usize) -> InputGraph {
        let mut children: Vec<Vec<Option<usize>>> = vec![vec![]; leaves];
        let mut level: Vec<usize> = (0..leaves).collect();
        while level.len() > 1 {
            let mut next = Vec::with_capacity(level.len().div_ceil(2));
            for pair in level.chunks(2) {
                children.push(pair.iter().map(|&c| Some(c)).collect());
                next.push(children.len() - 1);
            }
            level = next;
        }
        InputGraph::from_children(children).expect("merging disjoint subtrees gives a tree")
    }

    /// A random graph of `n` vertices for tests and benchmarks: each vertex fills each of its
    /// `arity` slots (a random 0–3 when `arity` is 0) with an earlier vertex with probability
    /// 0.7; unless `dag`, a vertex becomes a child at most once (a forest).
    pub fn random(rng: &mut crate::rng::Rng, n: usize, arity: usize, dag: bool) -> InputGraph {
        let mut has_parent = vec![false; n];
        let children = (0..n)
            .map(|v| {
                let slots = if arity == 0 { rng.below(4) } else { arity };
                (0..slots)
                    .map(|_| {
                        let c = (v > 0 && rng.uniform() < 0.7).then(|| rng.below(v))?;
                        if !dag && has_parent[c] {
                            return None;
                        }
                        has_parent[c] = true;
                        Some(c)
                    })
                    .collect()
            })
            .collect();
        InputGraph::from_children(children).expect("children are earlier vertices")
    }

    /// Every vertex, each after all of its children.
    pub fn children_first(&self) -> &[u32] {
        &self.order
    }

    /// Each vertex's height: 0 at a leaf, one above its highest child (in a graph unrolled for
    /// message passing, the step; in a parse tree, the level a height schedule runs it at).
    pub fn heights(&self) -> Vec<u32> {
        let mut height = vec![0u32; self.len()];
        for &v in &self.order {
            let v = v as usize;
            height[v] =
                self.children[v].iter().filter(|&&c| c != NO_CHILD).map(|&c| height[c as usize] + 1).max().unwrap_or(0);
        }
        height
    }

    /// A graph of `n` vertices from `(parent, child)` edges; each parent's children take slots in
    /// edge order. With `root`, every vertex must be reachable from it.
    pub fn from_edges(n: usize, edges: &[(usize, usize)], root: Option<usize>) -> Result<InputGraph> {
        let mut children = vec![Vec::new(); n];
        for &(p, c) in edges {
            let slots = children.get_mut(p).ok_or_else(|| {
                graph_error(format!("edge ({p}, {c}) names parent {p}, but the graph has {n} vertices"))
            })?;
            slots.push(Some(c));
        }
        let g = InputGraph::from_children(children)?;
        if let Some(root) = root {
            g.check_rooted(root)?;
        }
        Ok(g)
    }

    /// A tree from each vertex's parent (`None` for the root); children keep vertex order. There
    /// must be exactly one root.
    pub fn from_parents(parents: &[Option<usize>]) -> Result<InputGraph> {
        let mut children = vec![Vec::new(); parents.len()];
        for (v, p) in parents.iter().enumerate() {
            if let Some(p) = *p {
                let slots = children.get_mut(p).ok_or_else(|| {
                    graph_error(format!("vertex {v} has parent {p}, but the graph has {} vertices", parents.len()))
                })?;
                slots.push(Some(v));
            }
        }
        let g = InputGraph::from_children(children)?;
        let root = parents.iter().position(Option::is_none).ok_or_else(|| graph_error("no vertex is a root".into()))?;
        g.check_rooted(root)?;
        Ok(g)
    }

    /// Checks that every vertex is reachable from `root` by following children.
    pub fn check_rooted(&self, root: usize) -> Result<()> {
        if root >= self.len() {
            return Err(graph_error(format!("root {root} is not a vertex of a graph of {} vertices", self.len())));
        }
        let mut seen = vec![false; self.len()];
        let mut stack = vec![root];
        seen[root] = true;
        while let Some(v) = stack.pop() {
            for &c in self.children(v).iter().filter(|&&c| c != NO_CHILD) {
                if !std::mem::replace(&mut seen[c as usize], true) {
                    stack.push(c as usize);
                }
            }
        }
        match seen.iter().position(|s| !s) {
            Some(v) => Err(graph_error(format!("vertex {v} is not reachable from the root {root}"))),
            None => Ok(()),
        }
    }

    /// The vertices no vertex has as a child.
    pub fn roots(&self) -> Vec<usize> {
        let mut is_child = vec![false; self.len()];
        for cs in &self.children {
            for &c in cs.iter().filter(|&&c| c != NO_CHILD) {
                is_child[c as usize] = true;
            }
        }
        (0..self.len()).filter(|&v| !is_child[v]).collect()
    }

    fn check_acyclic(&self) -> Result<()> {
        let mut g = DiGraph::<(), ()>::with_capacity(self.len(), self.len());
        for _ in 0..self.len() {
            g.add_node(());
        }
        for (v, cs) in self.children.iter().enumerate() {
            for &c in cs.iter().filter(|&&c| c != NO_CHILD) {
                g.add_edge(NodeIndex::new(c as usize), NodeIndex::new(v), ());
            }
        }
        petgraph::algo::toposort(&g, None)
            .map(|_| ())
            .map_err(|cycle| graph_error(format!("vertex {} lies on a cycle", cycle.node_id().index())))
    }

    /// Checks that every vertex fits `f`: no more children than its arity (unless it uses
    /// `gather_sum`), and edge feature rows as wide as `gather_weighted` reads.
    pub fn check_for(&self, f: &VertexFn) -> Result<()> {
        let width = f.edge_feature_width();
        let has_edges = self.children.iter().any(|cs| cs.iter().any(|&c| c != NO_CHILD));
        if width > self.features.width && has_edges {
            return Err(graph_error(format!(
                "`{}` weighs children by edge feature {} (gather_weighted), but the edges carry {} \
                 feature values each (InputGraph::with_edge_features)",
                f.name(),
                width - 1,
                self.features.width
            )));
        }
        if let Some(max) = f.max_children() {
            if let Some((v, cs)) = self.children.iter().enumerate().find(|(_, cs)| cs.len() > max) {
                return Err(graph_error(format!(
                    "vertex {v} has {} child slots, but `{}` gathers at most {max}",
                    cs.len(),
                    f.name()
                )));
            }
        }
        Ok(())
    }

    /// Number of vertices.
    pub fn len(&self) -> usize {
        self.children.len()
    }

    /// Whether the graph has no vertex.
    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }

    /// The child slots of vertex `v` (`NO_CHILD` where empty).
    pub fn children(&self, v: usize) -> &[u32] {
        &self.children[v]
    }

    /// This graph with a label on every edge (a bond type, a dependency relation):
    /// `labels[v][k]` for the child in slot `k` of vertex `v` (an empty slot's is ignored). A
    /// vertex function reads the children of one label with
    /// [`Builder::gather_labelled`](crate::ir::Builder::gather_labelled). An error names the
    /// vertex whose labels do not match its slots.
    pub fn with_edge_labels(mut self, labels: Vec<Vec<u32>>) -> Result<InputGraph> {
        if labels.len() != self.len() {
            return Err(graph_error(format!("{} edge label lists for {} vertices", labels.len(), self.len())));
        }
        if let Some(v) = (0..self.len()).find(|&v| labels[v].len() != self.children[v].len()) {
            let (got, slots) = (labels[v].len(), self.children[v].len());
            return Err(graph_error(format!("vertex {v} has {slots} child slots but {got} edge labels")));
        }
        self.labels = labels.into_iter().map(SmallVec::from_vec).collect();
        Ok(self)
    }

    /// The label of the edge to the child in slot `k` of vertex `v` (0 when edges carry none).
    pub fn edge_label(&self, v: usize, k: usize) -> u32 {
        self.edge_labels(v).get(k).copied().unwrap_or(0)
    }

    /// The labels of the edges to vertex `v`'s child slots, in slot order (empty when edges carry
    /// none: every label 0).
    pub fn edge_labels(&self, v: usize) -> &[u32] {
        self.labels.get(v).map_or(&[], |l| l.as_slice())
    }

    /// This graph with a feature row of `width` values on every edge (a bond's length, a
    /// distance): `features[v]` holds the rows of vertex `v`'s child slots one after another (an
    /// empty slot's is ignored). A model feeds a vertex the sum, mean or maximum of its children's
    /// rows (`Feed::ChildEdges` in `arbor`). An error names the vertex whose rows do not match
    /// its slots, or a value that is not finite.
    pub fn with_edge_features(mut self, width: usize, features: Vec<Vec<f32>>) -> Result<InputGraph> {
        if features.len() != self.len() {
            return Err(graph_error(format!("{} edge feature lists for {} vertices", features.len(), self.len())));
        }
        let mut at = Vec::with_capacity(self.len());
        let mut values = Vec::with_capacity(features.iter().map(Vec::len).sum());
        for (v, rows) in features.into_iter().enumerate() {
            let slots = self.children[v].len();
            if rows.len() != slots * width {
                let got = rows.len();
                return Err(graph_error(format!("vertex {v} has {slots} child slots but {got} edge feature values")));
            }
            if let Some(k) = rows.iter().position(|x| !x.is_finite()) {
                return Err(graph_error(format!(
                    "vertex {v}, child slot {}: edge feature {}",
                    k / width.max(1),
                    rows[k]
                )));
            }
            at.push(values.len() / width.max(1));
            values.extend(rows);
        }
        self.features = EdgeFeatures { width, at, values };
        Ok(self)
    }

    /// How many values each edge's feature row holds (0 when edges carry none).
    pub fn edge_feature_width(&self) -> usize {
        self.features.width
    }

    /// The feature rows of the edges to vertex `v`'s child slots, one after another (empty when
    /// edges carry none).
    pub fn edge_features(&self, v: usize) -> &[f32] {
        let f = &self.features;
        match f.at.get(v) {
            Some(&at) => &f.values[at * f.width..(at + self.children[v].len()) * f.width],
            None => &[],
        }
    }
}

fn graph_error(reason: String) -> Error {
    Error::Graph { graph: "input".into(), reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heights_count_up_from_the_leaves() {
        // (a (b c)) with an empty slot at the root, vertices listed parents first.
        let g = InputGraph::from_children(vec![
            vec![Some(1), None, Some(4)],
            vec![Some(2), Some(3)],
            vec![],
            vec![],
            vec![],
        ])
        .expect("a tree");
        assert_eq!(g.heights(), [2, 1, 0, 0, 0]);
        assert_eq!(InputGraph::chain(4).heights(), [0, 1, 2, 3]);
    }

    #[test]
    fn edge_features_follow_the_child_slots() {
        let g = InputGraph::from_children(vec![vec![], vec![], vec![Some(0), None, Some(1)]]).expect("a tree");
        assert_eq!((g.edge_feature_width(), g.edge_features(2)), (0, &[][..]));
        let rows = vec![vec![], vec![], vec![1.0, 2.0, 0.0, 0.0, 5.0, 6.0]];
        let g = g.with_edge_features(2, rows).expect("a row per slot");
        assert_eq!(g.edge_feature_width(), 2);
        assert_eq!(g.edge_features(0), &[][..]);
        assert_eq!(g.edge_features(2), [1.0, 2.0, 0.0, 0.0, 5.0, 6.0]);
        let short = g.clone().with_edge_features(2, vec![vec![], vec![], vec![1.0]]).expect_err("short");
        assert!(short.to_string().contains("vertex 2 has 3 child slots but 1 edge feature values"), "{short}");
        let nan = g.clone().with_edge_features(1, vec![vec![], vec![], vec![1.0, 2.0, f32::NAN]]).expect_err("NaN");
        assert!(nan.to_string().contains("vertex 2, child slot 2"), "{nan}");
        let few = g.with_edge_features(1, vec![vec![]]).expect_err("one list");
        assert!(few.to_string().contains("1 edge feature lists for 3 vertices"), "{few}");
    }
}
