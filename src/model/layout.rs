//! A minibatch of a [`Model`](super::Model) laid out for its engines (graphs merged, a word and a
//! parent word per vertex, the vertices read out), and the way between the top layer's rows and
//! the head's inputs, shared by [`Model`](super::Model) and the pipeline's last stage.

use super::{Example, Feed};
use crate::engine::Pull;
use crate::ir::Reduce;
use crate::layers::Embedding;
use crate::readout::{Groups, Pooled, Readout};
use crate::{InputGraph, VertexFn};
use arbor_core::dropout::DropoutKey;
use arbor_core::error::{Error, Result};
use std::borrow::Cow;

/// What a minibatch lays out besides the words, as the feeds ask: each vertex's parent's word
/// (with the padding id for roots), the one-hot rows of its parent edge's label (so wide), its
/// child edges' feature rows reduced (so wide, so reduced), its height's one-hot row (so wide).
#[derive(Clone, Copy, Default)]
pub(crate) struct Fed {
    pub(crate) parents: Option<u32>,
    pub(crate) edges: Option<usize>,
    pub(crate) child_edges: Option<(usize, Reduce)>,
    pub(crate) heights: Option<usize>,
}

impl Fed {
    /// What `feeds` ask of a layout over `embedding`'s words.
    pub(crate) fn of(feeds: &[Feed], embedding: &Embedding) -> Fed {
        let parents = feeds.contains(&Feed::ParentWords).then(|| embedding.padding().unwrap_or(0));
        let edges = feeds.iter().find_map(|f| if let Feed::ParentEdge(n) = f { Some(*n) } else { None });
        let child_edges = feeds.iter().find_map(|f| if let Feed::ChildEdges(n, r) = f { Some((*n, *r)) } else { None });
        let heights = feeds.iter().find_map(|f| if let Feed::Height(n) = f { Some(*n) } else { None });
        Fed { parents, edges, child_edges, heights }
    }
}

/// A minibatch laid out for the cells' engines.
pub(crate) struct Layout<'a> {
    pub(crate) graphs: Vec<&'a InputGraph>,
    /// Per vertex (merged order): its word, and its parent's word (padding at a root).
    pub(crate) words: Vec<u32>,
    pub(crate) parent_words: Vec<u32>,
    /// Per vertex, the one-hot row of its parent edge's label ([`Feed::ParentEdge`]), if fed.
    pub(crate) parent_edges: Vec<f32>,
    /// Per vertex, its child edges' feature rows reduced ([`Feed::ChildEdges`]), if fed.
    pub(crate) child_edges: Vec<f32>,
    /// Per vertex, the one-hot row of its height ([`Feed::Height`]), if fed.
    pub(crate) heights: Vec<f32>,
    /// Per example, per graph: the merged index of the vertex read out.
    pub(crate) roots: Vec<usize>,
    /// Per example, per graph: the merged vertices a pooling readout reads.
    pub(crate) pools: Groups,
}

/// What the head reads of a minibatch: `top` holds the top layer's outputs (its rows of every
/// vertex, or only of the roots when `at_roots` says the engine returned just those; for an
/// attention readout, then its scores); gives the rows read (one per graph, or one per vertex)
/// and, for a pooling readout, the pooling.
pub(crate) fn read_rows(
    mut top: Vec<Vec<f32>>,
    l: &Layout<'_>,
    readout: Readout,
    width: usize,
    at_roots: bool,
) -> Result<(Vec<f32>, Option<Pooled>)> {
    let rows = if top.is_empty() { Vec::new() } else { top.swap_remove(0) };
    Ok(match readout {
        Readout::Vertices => (rows, None),
        Readout::Root if at_roots => (rows, None),
        Readout::Root => (l.roots.iter().flat_map(|&r| &rows[r * width..][..width]).copied().collect(), None),
        Readout::Attention => {
            let Some(scores) = top.first() else {
                return Err(Error::input(
                    "attention readout",
                    "a top vertex function pushing a second output, the scores",
                    "one output",
                ));
            };
            let p = Pooled::attend(rows, width, scores, l.pools.clone())?;
            (p.rows.clone(), Some(p))
        }
        _ => {
            let p = Pooled::forward(&rows, width, l.pools.clone(), readout);
            (p.rows.clone(), Some(p))
        }
    })
}

/// The head's inputs: per graph slot (of `k` per example), the rows `read` of every example in
/// order, then the examples' targets.
pub(crate) fn head_inputs(read: Vec<f32>, k: usize, width: usize, targets: Vec<f32>) -> Vec<Vec<f32>> {
    if k == 1 {
        return vec![read, targets];
    }
    let mut inputs: Vec<Vec<f32>> =
        (0..k).map(|slot| read.chunks(width.max(1)).skip(slot).step_by(k).flatten().copied().collect()).collect();
    inputs.push(targets);
    inputs
}

/// The gradient of the rows read (as [`read_rows`] gave them) from the head's input gradients
/// `slots` (the first `k`).
pub(crate) fn read_grad(slots: &[Vec<f32>], k: usize, width: usize, rows: usize) -> Vec<f32> {
    let mut dh = vec![0.0; rows * width];
    for (slot, g) in slots.iter().take(k).enumerate() {
        for (e, row) in g.chunks(width.max(1)).enumerate() {
            dh[(e * k + slot) * width..][..width].copy_from_slice(row);
        }
    }
    dh
}

/// The gradients of the outputs of the top layer's function `top` at every vertex from the
/// gradient `dh` of the rows read: of its rows, for an attention readout of its scores, and
/// zeros for the outputs not read.
pub(crate) fn unread(
    dh: Vec<f32>,
    l: &Layout<'_>,
    readout: Readout,
    pooled: Option<&Pooled>,
    top: &VertexFn,
) -> Vec<Vec<f32>> {
    let width = super::width_out(top);
    let mut grads = match (readout, pooled) {
        (_, Some(p)) => {
            let (rows, scores) = p.backward(&dh, l.words.len());
            [rows].into_iter().chain(scores).collect()
        }
        (Readout::Root, None) => {
            let mut all = vec![0.0; l.words.len() * width];
            for (&r, row) in l.roots.iter().zip(dh.chunks(width.max(1))) {
                all[r * width..][..width].iter_mut().zip(row).for_each(|(a, d)| *a += d);
            }
            vec![all]
        }
        _ => vec![dh],
    };
    let widths = top.outputs().iter().map(|o| o.shape.numel());
    grads.extend(widths.skip(grads.len()).map(|w| vec![0.0; w * l.words.len()]));
    grads
}

/// Checks `batch` (`k` graphs per example; one with [`Readout::Vertices`]) and lays it out for
/// the cells (`f` the bottom one, for errors), with what the feeds ask besides the words (`fed`).
pub(crate) fn layout<'a>(
    batch: &[Example<'a>],
    k: usize,
    readout: Readout,
    fed: Fed,
    f: &VertexFn,
) -> Result<Layout<'a>> {
    if readout == Readout::Vertices && k != 1 {
        return Err(Error::input(
            format!("model over `{}` reading every vertex", f.name()),
            "a head reading one graph per example",
            format!("a head reading {k}"),
        ));
    }
    let mut l = Layout {
        graphs: Vec::new(),
        words: Vec::new(),
        parent_words: Vec::new(),
        parent_edges: Vec::new(),
        child_edges: Vec::new(),
        heights: Vec::new(),
        roots: Vec::new(),
        pools: Groups::default(),
    };
    for (e, example) in batch.iter().enumerate() {
        if example.trees.len() != k {
            return Err(Error::input(
                format!("example {e} of the minibatch"),
                format!("{k} graphs"),
                example.trees.len().to_string(),
            ));
        }
        // Where each tree's vertices start: a tree sharing another's run reads its vertices.
        let placed = example.placed();
        let mut starts = Vec::with_capacity(k);
        for (t, tree) in example.trees.iter().enumerate() {
            let n = tree.graph.len();
            let place = || format!("graph {t} of example {e} of the minibatch");
            if tree.words.len() != n || tree.root >= n {
                return Err(Error::input(
                    place(),
                    format!("{n} words and a root below {n}"),
                    format!("{} words, root {}", tree.words.len(), tree.root),
                ));
            }
            let start = if placed[t] == t {
                l.graphs.push(tree.graph);
                l.words.len()
            } else {
                starts[placed[t]]
            };
            if placed[t] == t {
                l.words.extend_from_slice(tree.words);
            }
            starts.push(start);
            l.roots.push(start + tree.root);
            if readout.pools() {
                l.pools.push(tree.pool.vertices(tree.graph, &place)?.into_iter().map(|v| start + v));
            }
        }
    }
    if let Some(pad) = fed.parents {
        l.parent_words = parent_words(&l.graphs, &l.words, pad);
    }
    if let Some(labels) = fed.edges {
        l.parent_edges = parent_edges(&l.graphs, labels);
    }
    if let Some((width, reduce)) = fed.child_edges {
        l.child_edges = child_edges(&l.graphs, width, reduce)?;
    }
    if let Some(width) = fed.heights {
        l.heights = heights(&l.graphs, width);
    }
    Ok(l)
}

/// Per vertex of `graphs` (merged order), its height as a one-hot row of `width` columns (the
/// last for every height past it; no columns, no rows).
fn heights(graphs: &[&InputGraph], width: usize) -> Vec<f32> {
    let vertices: usize = graphs.iter().map(|g| g.len()).sum();
    let mut out = vec![0.0; vertices * width];
    let Some(last) = width.checked_sub(1) else { return out };
    let mut start = 0;
    for g in graphs {
        for (v, h) in g.heights().into_iter().enumerate() {
            out[(start + v) * width + (h as usize).min(last)] = 1.0;
        }
        start += g.len();
    }
    out
}

/// Per vertex of `graphs` (merged order), the label of the edge from its parent as a one-hot row
/// of `labels` columns (zeros at a root or for a label past them).
fn parent_edges(graphs: &[&InputGraph], labels: usize) -> Vec<f32> {
    let vertices: usize = graphs.iter().map(|g| g.len()).sum();
    let mut out = vec![0.0; vertices * labels];
    let mut start = 0;
    for g in graphs {
        for v in 0..g.len() {
            for (k, &c) in g.children(v).iter().enumerate().filter(|(_, &c)| c != arbor_core::graph::NO_CHILD) {
                let l = g.edge_label(v, k) as usize;
                if l < labels {
                    out[(start + c as usize) * labels + l] = 1.0;
                }
            }
        }
        start += g.len();
    }
    out
}

/// Per vertex of `graphs` (merged order), the feature rows (`width` wide) of the edges to its
/// children reduced by `reduce` (zeros at a leaf); an error names a graph whose edges carry
/// rows of another width.
fn child_edges(graphs: &[&InputGraph], width: usize, reduce: Reduce) -> Result<Vec<f32>> {
    let vertices: usize = graphs.iter().map(|g| g.len()).sum();
    let mut out = vec![0.0; vertices * width];
    let mut start = 0;
    for (i, g) in graphs.iter().enumerate() {
        if g.edge_feature_width() != width {
            return Err(Error::input(
                format!("graph {i} of the minibatch, fed its child edges' features"),
                format!("edge feature rows of {width} values (InputGraph::with_edge_features)"),
                format!("rows of {}", g.edge_feature_width()),
            ));
        }
        for v in 0..g.len() {
            let o = &mut out[(start + v) * width..][..width];
            let rows = g.edge_features(v).chunks(width.max(1));
            let present = g.children(v).iter().zip(rows).filter(|(&c, _)| c != arbor_core::graph::NO_CHILD);
            let mut count = 0;
            for (_, row) in present {
                match (reduce, count) {
                    (Reduce::Max, 0) => o.copy_from_slice(row),
                    (Reduce::Max, _) => o.iter_mut().zip(row).for_each(|(o, x)| *o = o.max(*x)),
                    _ => o.iter_mut().zip(row).for_each(|(o, x)| *o += x),
                }
                count += 1;
            }
            if reduce == Reduce::Mean && count > 0 {
                o.iter_mut().for_each(|o| *o /= count as f32);
            }
        }
        start += g.len();
    }
    Ok(out)
}

/// Per vertex of `graphs` (merged order), its parent's word in `words` (`pad` at a root).
fn parent_words(graphs: &[&InputGraph], words: &[u32], pad: u32) -> Vec<u32> {
    let mut out = vec![pad; words.len()];
    let mut start = 0;
    for g in graphs {
        for v in 0..g.len() {
            for &c in g.children(v).iter().filter(|&&c| c != arbor_core::graph::NO_CHILD) {
                out[start + c as usize] = words[start + v];
            }
        }
        start += g.len();
    }
    out
}

/// `l` as a training pass at `key` sees it when `embedding` drops words (its words, and the
/// parent words naming them, replaced where dropped); `None` when it drops none.
pub(crate) fn with_words_dropped<'a>(embedding: &Embedding, key: DropoutKey, l: &Layout<'a>) -> Option<Layout<'a>> {
    let Cow::Owned(words) = embedding.training_ids(key, &l.graphs, &l.words) else { return None };
    let parent_words = if l.parent_words.is_empty() {
        Vec::new()
    } else {
        parent_words(&l.graphs, &words, embedding.padding().unwrap_or(0))
    };
    Some(Layout {
        graphs: l.graphs.clone(),
        words,
        parent_words,
        parent_edges: l.parent_edges.clone(),
        child_edges: l.child_edges.clone(),
        heights: l.heights.clone(),
        roots: l.roots.clone(),
        pools: l.pools.clone(),
    })
}

/// The cells' inputs over `l`, as `feeds` say: from the table the bottom engine holds if
/// `held` (a [`Model`](super::Model)'s), else looked up in `embedding`'s (a pipeline stage's).
pub(crate) fn pulls<'a>(embedding: &'a Embedding, feeds: &[Feed], l: &'a Layout<'_>, held: bool) -> Vec<Pull<'a>> {
    let pull = |ids: &'a [u32]| if held { embedding.held_pull(ids) } else { embedding.pull(ids) };
    feeds
        .iter()
        .map(|feed| match feed {
            Feed::Words => pull(&l.words),
            Feed::ParentWords => pull(&l.parent_words),
            Feed::ParentEdge(_) => Pull::Rows(&l.parent_edges),
            Feed::ChildEdges(..) => Pull::Rows(&l.child_edges),
            Feed::Height(_) => Pull::Rows(&l.heights),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A height's one-hot row per vertex, graph after graph; heights past the last column count
    /// as the last, and no columns give no rows.
    #[test]
    fn heights_are_one_hot_rows_clamped_to_the_last_column() {
        let chain = InputGraph::chain(4);
        let leaf = InputGraph::isolated(1);
        let rows = heights(&[&chain, &leaf], 3);
        let expected = [[1., 0., 0.], [0., 1., 0.], [0., 0., 1.], [0., 0., 1.], [1., 0., 0.]];
        assert_eq!(rows, expected.concat());
        assert!(heights(&[&chain], 0).is_empty());
    }
}
