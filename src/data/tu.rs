//! Graph classification data in the TU Dortmund format (`NAME_A.txt`, `NAME_graph_indicator.txt`,
//! `NAME_graph_labels.txt`, `NAME_node_labels.txt`, and `NAME_edge_labels.txt` where there is one),
//! e.g. MUTAG.

use crate::error::{Error, Result};
use crate::graph::InputGraph;
use crate::head::argmax;
use crate::model::{AsExample, Example, Outputs, Tree};
use crate::readout::Pool;
use crate::trainer::Scores;
use std::path::Path;
use std::sync::Arc;

/// One graph: its nodes' labels, undirected edges, and class.
#[derive(Clone, Debug, PartialEq)]
pub struct GraphExample {
    /// Label of every node (0-based node ids within the graph).
    pub node_labels: Vec<u32>,
    /// Neighbours of every node, ascending.
    pub neighbours: Vec<Vec<u32>>,
    /// The label of the edge to each neighbour (as `neighbours`), renumbered like node labels;
    /// all 0 without an edge label file.
    pub edge_labels: Vec<Vec<u32>>,
    /// The feature row of the edge to each neighbour (as `neighbours`, each
    /// [`TuDataset::edge_feature_width`] values, one after another); empty without an edge
    /// attribute file (`NAME_edge_attributes.txt`).
    pub edge_features: Vec<Vec<f32>>,
    /// Class (graph labels renumbered 0, 1, … in ascending order of the file's values).
    pub label: u32,
}

/// A TU data set.
#[derive(Clone, Debug, PartialEq)]
pub struct TuDataset {
    /// The graphs.
    pub graphs: Vec<GraphExample>,
    /// Number of distinct node labels (the file's labels are renumbered 0, 1, … in ascending
    /// order, so a sparse or large label costs nothing).
    pub node_label_count: usize,
    /// Number of classes.
    pub classes: usize,
    /// Number of distinct edge labels (0 without an edge label file).
    pub edge_label_count: usize,
    /// Values in each edge's feature row (0 without an edge attribute file).
    pub edge_feature_width: usize,
}

fn read_lines(path: &Path) -> Result<Vec<(usize, String)>> {
    let mut lines = super::lines::read_all(path)?;
    lines.retain(|(_, l)| !l.trim().is_empty());
    Ok(lines.into_iter().map(|(i, l)| (i, l.trim().to_string())).collect())
}

fn number(path: &Path, line: usize, text: &str) -> Result<i64> {
    text.trim().parse().map_err(|_| Error::Parse {
        file: path.display().to_string(),
        line,
        msg: format!("`{}` is not an integer", text.trim()),
    })
}

/// Reads data set `name` from `dir`. Errors name the file and line.
pub fn read(dir: &Path, name: &str) -> Result<TuDataset> {
    let file = |suffix: &str| dir.join(format!("{name}_{suffix}.txt"));
    let (ind_path, lab_path, node_path, a_path) =
        (file("graph_indicator"), file("graph_labels"), file("node_labels"), file("A"));
    let indicator: Vec<(usize, i64)> =
        read_lines(&ind_path)?.iter().map(|(l, t)| number(&ind_path, *l, t).map(|g| (*l, g))).collect::<Result<_>>()?;
    let label_lines = read_lines(&lab_path)?;
    let graph_labels: Vec<i64> = label_lines.iter().map(|(l, t)| number(&lab_path, *l, t)).collect::<Result<_>>()?;
    if graph_labels.is_empty() {
        return Err(Error::Parse { file: lab_path.display().to_string(), line: 0, msg: "no graphs".into() });
    }
    let node_labels: Vec<i64> =
        read_lines(&node_path)?.iter().map(|(l, t)| number(&node_path, *l, t)).collect::<Result<_>>()?;
    if node_labels.len() != indicator.len() {
        return Err(Error::Parse {
            file: node_path.display().to_string(),
            line: node_labels.len(),
            msg: format!("{} node labels for {} nodes", node_labels.len(), indicator.len()),
        });
    }
    let (classes, class_count) = renumber(&graph_labels);
    let mut graphs: Vec<GraphExample> = classes
        .into_iter()
        .map(|label| GraphExample {
            node_labels: Vec::new(),
            neighbours: Vec::new(),
            edge_labels: Vec::new(),
            edge_features: Vec::new(),
            label,
        })
        .collect();
    let (node_labels, node_label_count) = renumber(&node_labels);
    let mut local = Vec::with_capacity(indicator.len());
    for (&(line, g), &nl) in indicator.iter().zip(&node_labels) {
        let g =
            g.checked_sub(1).and_then(|g| usize::try_from(g).ok()).filter(|&g| g < graphs.len()).ok_or_else(|| {
                Error::Parse {
                    file: ind_path.display().to_string(),
                    line,
                    msg: format!("graph {g} is not among the {} graphs", graphs.len()),
                }
            })?;
        local.push((g, graphs[g].node_labels.len() as u32));
        graphs[g].node_labels.push(nl);
        graphs[g].neighbours.push(Vec::new());
        graphs[g].edge_labels.push(Vec::new());
        graphs[g].edge_features.push(Vec::new());
    }
    let edges = read_lines(&a_path)?;
    let (edge_labels, edge_label_count) = read_edge_labels(&file("edge_labels"), edges.len())?;
    let (features, width) = read_edge_features(&file("edge_attributes"), edges.len())?;
    let rows = features.chunks(width.max(1)).map(Some).chain(std::iter::repeat(None));
    for (((line, text), label), row) in edges.into_iter().zip(edge_labels).zip(rows) {
        let bad = |msg: String| Error::Parse { file: a_path.display().to_string(), line, msg };
        let (a, b) = text.split_once(',').ok_or_else(|| bad(format!("`{text}` is not `row, col`")))?;
        let (a, b) = (number(&a_path, line, a)?, number(&a_path, line, b)?);
        let node = |x: i64| x.checked_sub(1).and_then(|i| usize::try_from(i).ok()).and_then(|i| local.get(i).copied());
        let ((ga, la), (gb, lb)) = match (node(a), node(b)) {
            (Some(x), Some(y)) => (x, y),
            _ => return Err(bad(format!("edge ({a}, {b}) names a node outside 1..={}", local.len()))),
        };
        if ga != gb {
            return Err(bad(format!("edge ({a}, {b}) joins graphs {} and {}", ga + 1, gb + 1)));
        }
        for (x, y) in [(la, lb), (lb, la)] {
            let g = &mut graphs[ga];
            if let Err(at) = g.neighbours[x as usize].binary_search(&y) {
                g.neighbours[x as usize].insert(at, y);
                g.edge_labels[x as usize].insert(at, label);
                if let Some(row) = row.filter(|_| width > 0) {
                    let f = &mut g.edge_features[x as usize];
                    f.splice(at * width..at * width, row.iter().copied());
                }
            }
        }
    }
    if let Some(g) = graphs.iter().position(|g| g.node_labels.is_empty()) {
        return Err(Error::Parse {
            file: lab_path.display().to_string(),
            line: label_lines[g].0,
            msg: format!("graph {} has no nodes in {}", g + 1, ind_path.display()),
        });
    }
    if width == 0 {
        graphs.iter_mut().for_each(|g| g.edge_features.clear());
    }
    Ok(TuDataset { graphs, node_label_count, classes: class_count, edge_label_count, edge_feature_width: width })
}

impl TuDataset {
    /// Relabels every node by its label and the number of simple cycles of each length
    /// `3..=max_len` through it ([`cycle_counts`](super::cycles::cycle_counts), the substructure
    /// counts of GSN), renumbered 0, 1, … in ascending order of (label, counts) over the whole set,
    /// so that a ring atom and a chain atom, or a fused ring and a lone one, read different rows
    /// of the input table. The same data relabels the same way (so `arbor eval` can repeat it).
    /// An error names a graph too dense to count, or whose node labels and neighbour lists differ
    /// in number (the fields are public).
    pub fn label_cycles(&mut self, max_len: usize) -> Result<()> {
        let mut keys: Vec<Vec<u32>> = Vec::with_capacity(self.graphs.iter().map(|g| g.node_labels.len()).sum());
        for (k, g) in self.graphs.iter().enumerate() {
            let graph = || format!("graph {} of the data set", k + 1);
            if g.neighbours.len() != g.node_labels.len() {
                let reason = format!("{} node labels but {} neighbour lists", g.node_labels.len(), g.neighbours.len());
                return Err(Error::Graph { graph: graph(), reason });
            }
            let counts = super::cycles::cycle_counts(&g.neighbours, max_len).map_err(|e| match e {
                Error::Graph { reason, .. } => Error::Graph { graph: graph(), reason },
                e => e,
            })?;
            keys.extend(g.node_labels.iter().zip(counts).map(|(&l, c)| std::iter::once(l).chain(c).collect()));
        }
        let (relabelled, count) = renumber(&keys);
        for (label, new) in self.graphs.iter_mut().flat_map(|g| g.node_labels.iter_mut()).zip(relabelled) {
            *label = new;
        }
        self.node_label_count = count;
        Ok(())
    }
}

/// `values` renumbered 0, 1, … in ascending order of the distinct values, and how many there
/// are (so a sparse or large label costs nothing).
fn renumber<T: Ord + Clone>(values: &[T]) -> (Vec<u32>, usize) {
    let mut distinct = values.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    (values.iter().map(|v| distinct.partition_point(|d| d < v) as u32).collect(), distinct.len())
}

/// The label of each of `edges` edges from `path` (one per line of `NAME_A.txt`), renumbered 0, 1,
/// … in ascending order of the file's values, and how many there are; all 0 (and none) when the
/// file does not exist. Errors name the file and line.
fn read_edge_labels(path: &Path, edges: usize) -> Result<(Vec<u32>, usize)> {
    if !path.exists() {
        return Ok((vec![0; edges], 0));
    }
    let raw: Vec<i64> = read_lines(path)?.iter().map(|(l, t)| number(path, *l, t)).collect::<Result<_>>()?;
    if raw.len() != edges {
        let msg = format!("{} edge labels for {edges} edges", raw.len());
        return Err(Error::Parse { file: path.display().to_string(), line: raw.len(), msg });
    }
    Ok(renumber(&raw))
}

/// The feature row of each of `edges` edges from `path` (one line of comma-separated numbers per
/// line of `NAME_A.txt`, every line as long), flat, and its width; none (width 0) when the file
/// does not exist. Errors name the file and line.
fn read_edge_features(path: &Path, edges: usize) -> Result<(Vec<f32>, usize)> {
    if !path.exists() {
        return Ok((Vec::new(), 0));
    }
    let lines = read_lines(path)?;
    if lines.len() != edges {
        let msg = format!("{} edge attribute rows for {edges} edges", lines.len());
        return Err(Error::Parse { file: path.display().to_string(), line: lines.len(), msg });
    }
    let (mut values, mut width) = (Vec::new(), None);
    for (line, text) in &lines {
        let bad = |msg: String| Error::Parse { file: path.display().to_string(), line: *line, msg };
        let row: Vec<f32> = text
            .split(',')
            .map(|x| {
                x.trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .ok_or_else(|| bad(format!("`{}` is not a finite number", x.trim())))
            })
            .collect::<Result<_>>()?;
        match width {
            Some(w) if w != row.len() => {
                return Err(bad(format!("{} values where the rows above have {w}", row.len())))
            }
            _ => width = Some(row.len()),
        }
        values.extend(row);
    }
    Ok((values, width.unwrap_or(0)))
}

impl GraphExample {
    /// Message passing unrolled for `steps` steps as a DAG: vertex `t·n + v` is node `v` at step
    /// `t`; it has `(v, t−1)` in slot 0 and its neighbours at `t−1` after, each edge labelled as
    /// the data set labels it, and the edge to the own previous state `self_label` (the data
    /// set's edge label count, a label of its own). The last `n` vertices are the final states.
    /// An error names the node whose neighbours, edge labels or edge feature rows do not fit
    /// (this example's fields are public, so they may not be as the reader made them).
    pub fn unroll(&self, steps: usize, self_label: u32) -> Result<InputGraph> {
        let n = self.node_labels.len();
        let width = self.edge_feature_width();
        if self.neighbours.len() != n || self.edge_labels.len() != n || (width > 0 && self.edge_features.len() != n) {
            return Err(Error::Graph {
                graph: "unrolled".into(),
                reason: format!(
                    "{n} nodes but {} neighbour lists, {} edge label lists and {} edge feature lists",
                    self.neighbours.len(),
                    self.edge_labels.len(),
                    self.edge_features.len()
                ),
            });
        }
        let mut children = Vec::with_capacity(n * (steps + 1));
        let (mut labels, mut features) = (Vec::with_capacity(n * (steps + 1)), Vec::new());
        for t in 0..=steps {
            for v in 0..n {
                if t == 0 {
                    children.push(Vec::new());
                    labels.push(Vec::new());
                    features.push(Vec::new());
                } else {
                    let prev = (t - 1) * n;
                    let mut slots = vec![Some(prev + v)];
                    slots.extend(self.neighbours[v].iter().map(|&u| Some(prev + u as usize)));
                    children.push(slots);
                    labels.push([self_label].into_iter().chain(self.edge_labels[v].iter().copied()).collect());
                    if width > 0 {
                        // The edge to the own previous state carries zeros.
                        features.push(
                            std::iter::repeat_n(0.0, width).chain(self.edge_features[v].iter().copied()).collect(),
                        );
                    }
                }
            }
        }
        let g = InputGraph::from_children(children)?.with_edge_labels(labels)?;
        if width > 0 {
            g.with_edge_features(width, features)
        } else {
            Ok(g)
        }
    }

    /// Values in each edge's feature row (0 without edge features).
    pub fn edge_feature_width(&self) -> usize {
        let edges: usize = self.neighbours.iter().map(Vec::len).sum();
        self.edge_features.iter().map(Vec::len).sum::<usize>() / edges.max(1)
    }
}

/// A graph unrolled for message passing as an example of a [`Model`](crate::model::Model):
/// each vertex pulls its node's label vector, the head reads the final step pooled (a
/// [`Readout::Mean`](crate::readout::Readout::Mean) or another pooling over the last `n`
/// vertices) — or every step, each pooled apart, one row per step — and the target is the
/// one-hot row of the graph's class. Cheap to clone (the unrolled graph is shared), so folds of
/// a cross-validation copy no graph.
#[derive(Clone, Debug)]
pub struct Unrolled {
    graph: Arc<InputGraph>,
    /// A node label per vertex of the unrolled graph.
    words: Arc<[u32]>,
    nodes: usize,
    label: u32,
    classes: usize,
    every_step: bool,
}

impl Unrolled {
    /// Every graph of `data` unrolled for `steps` steps, read at the last step or at
    /// `every_step`; an error names a graph that does not unroll.
    pub fn all(data: &TuDataset, steps: usize, every_step: bool) -> Result<Vec<Unrolled>> {
        data.graphs
            .iter()
            .enumerate()
            .map(|(k, g)| {
                let graph = g.unroll(steps, data.edge_label_count as u32).map_err(|e| Error::Graph {
                    graph: format!("graph {} of the data set", k + 1),
                    reason: e.to_string(),
                })?;
                Ok(Unrolled {
                    graph: Arc::new(graph),
                    words: g.node_labels.iter().copied().cycle().take(g.node_labels.len() * (steps + 1)).collect(),
                    nodes: g.node_labels.len(),
                    label: g.label,
                    classes: data.classes,
                    every_step,
                })
            })
            .collect()
    }
}

impl Unrolled {
    /// The graph's class.
    pub fn class(&self) -> u32 {
        self.label
    }
}

impl AsExample for Unrolled {
    fn example(&self) -> Example<'_> {
        let n = self.graph.len();
        let mut target = vec![0.0; self.classes];
        if let Some(t) = target.get_mut(self.label as usize) {
            *t = 1.0;
        }
        let step = |end: usize| Tree::new(&self.graph, &self.words, end - 1).pooled(Pool::Range(end - self.nodes..end));
        let trees = match self.every_step {
            // One tree per step over the one graph: it runs once (`Example::placed`).
            true => (1..=n / self.nodes.max(1)).map(|t| step(t * self.nodes)).collect(),
            false => vec![step(n)],
        };
        Example { trees, target }
    }

    /// The accuracy of the head's `logits` (one row per graph).
    fn score(outputs: &Outputs, data: &[Self]) -> Result<Scores> {
        let logits = outputs.get("logits")?;
        let c = data.first().map_or(1, |d| d.classes.max(1));
        if logits.len() != data.len() * c {
            let got = format!("{} values", logits.len());
            return Err(Error::input("head outputs `logits`", format!("a row of {c} per graph"), got));
        }
        let right = logits.chunks(c).zip(data).filter(|(l, d)| argmax(l) == d.label as usize).count();
        // No data, no accuracy (NaN, `null` in JSON).
        let acc = if data.is_empty() { f64::NAN } else { right as f64 / data.len() as f64 };
        Ok(vec![("accuracy".into(), acc)])
    }
}
