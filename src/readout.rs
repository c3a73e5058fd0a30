//! Readouts: how the rows a vertex function pushed over one graph become the single row a head
//! reads for that graph: the root's row, or the sum, mean, maximum or attention-weighted sum
//! over the vertices a [`Pool`] chooses (every vertex, a range such as an unrolled graph's last
//! step, the roots, or a mask).
//!
//! A pooling readout is linear (sum, mean), routes each column to one vertex (max) or is a
//! softmax-weighted sum whose scores the vertex function computes and pushes (attention), so its
//! gradient is exact and fixed: [`Pooled::backward`] spreads the head's gradient back over the
//! vertices (and their scores). Nothing here is model-specific; a model picks a readout and
//! trains through it.

use arbor_core::error::{Error, Result};
use arbor_core::graph::InputGraph;
use std::ops::Range;

/// How a graph's pushed rows are read out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Readout {
    /// The row of the graph's chosen vertex (its root).
    #[default]
    Root,
    /// The sum of the pooled vertices' rows.
    Sum,
    /// The mean of the pooled vertices' rows.
    Mean,
    /// The column-wise maximum over the pooled vertices' rows (the gradient goes to the vertex
    /// that holds it, the first one on a tie).
    Max,
    /// Attention pooling (global attention, Li et al. 2016): the top vertex function pushes a
    /// second output, a score per vertex (one column, or one per head, the row split into as
    /// many equal parts); the pooled row is the sum of the rows weighted by the softmax of the
    /// scores over the pooled vertices (per head). The scores are learned through the vertex
    /// function, which gets their gradient.
    Attention,
    /// Every vertex's row, each read by the head as an example of its own (a target per vertex).
    /// Not a pooling: [`Pooled`] reads a group's first vertex for it, as for [`Readout::Root`].
    Vertices,
}

impl Readout {
    /// Every readout.
    pub const ALL: [Readout; 6] =
        [Readout::Root, Readout::Sum, Readout::Mean, Readout::Max, Readout::Attention, Readout::Vertices];

    /// Its name (`root`, `sum`, `mean`, `max`, `attention`, `vertices`), as model specs call it.
    pub fn name(self) -> &'static str {
        match self {
            Readout::Root => "root",
            Readout::Sum => "sum",
            Readout::Mean => "mean",
            Readout::Max => "max",
            Readout::Attention => "attention",
            Readout::Vertices => "vertices",
        }
    }

    /// The readout named `name`, if any.
    pub fn from_name(name: &str) -> Option<Readout> {
        Readout::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Whether it pools a graph's vertices into one row ([`Pool`] chooses which).
    pub fn pools(self) -> bool {
        matches!(self, Readout::Sum | Readout::Mean | Readout::Max | Readout::Attention)
    }

    /// Attention scores a cell pushes per vertex for this readout (one for attention pooling).
    pub fn scores(self) -> usize {
        usize::from(self == Readout::Attention)
    }
}

/// The vertices of a graph a pooling readout reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Pool<'a> {
    /// Every vertex.
    #[default]
    All,
    /// The vertices in a range: an unrolled graph's last step, say.
    Range(Range<usize>),
    /// The vertices no vertex has as a child: a forest's roots, an unrolled graph's last step.
    Roots,
    /// The vertices whose entry is `true` (one entry per vertex).
    Mask(&'a [bool]),
}

impl Pool<'_> {
    /// The chosen vertices of `graph`, ascending; an error names `place` where the pool does
    /// not fit the graph. A pool may choose none (a mask nothing matches in this graph): it then
    /// reads as zeros under every readout, as a reduction over no children does.
    pub fn vertices(&self, graph: &InputGraph, place: &dyn Fn() -> String) -> Result<Vec<usize>> {
        let n = graph.len();
        match self {
            Pool::All => Ok((0..n).collect()),
            Pool::Range(r) if r.start <= r.end && r.end <= n => Ok(r.clone().collect()),
            Pool::Range(r) => Err(Error::input(place(), format!("pooled vertices within 0..{n}"), format!("{r:?}"))),
            Pool::Roots => Ok(graph.roots()),
            Pool::Mask(m) if m.len() == n => Ok((0..n).filter(|&v| m[v]).collect()),
            Pool::Mask(m) => Err(Error::input(place(), format!("a pooling mask of {n} entries"), m.len().to_string())),
        }
    }
}

/// Groups of vertices, each pooled into one row: group `g` is
/// `members[bounds[g]..bounds[g + 1]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Groups {
    members: Vec<usize>,
    bounds: Vec<usize>,
}

impl Default for Groups {
    fn default() -> Groups {
        Groups { members: Vec::new(), bounds: vec![0] }
    }
}

impl Groups {
    /// Appends a group of `vertices`.
    pub fn push(&mut self, vertices: impl IntoIterator<Item = usize>) {
        self.members.extend(vertices);
        self.bounds.push(self.members.len());
    }

    /// Groups of consecutive vertices, one per range.
    pub fn ranges(ranges: impl IntoIterator<Item = Range<usize>>) -> Groups {
        let mut g = Groups::default();
        ranges.into_iter().for_each(|r| g.push(r));
        g
    }

    /// How many groups.
    pub fn len(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Group `g`'s vertices.
    pub fn group(&self, g: usize) -> &[usize] {
        &self.members[self.bounds[g]..self.bounds[g + 1]]
    }

    fn iter(&self) -> impl Iterator<Item = &[usize]> + '_ {
        (0..self.len()).map(|g| self.group(g))
    }
}

/// What attention pooling's backward pass reads.
#[derive(Clone, Debug, PartialEq)]
struct Attended {
    /// The vertices' rows.
    inputs: Vec<f32>,
    heads: usize,
    /// Per member of each group and head, its weight.
    weights: Vec<f32>,
}

/// Rows pooled over groups of vertices, with what their backward pass needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Pooled {
    /// One row per group (attention pooling's backward pass reads them: keep them).
    pub rows: Vec<f32>,
    width: usize,
    readout: Readout,
    groups: Groups,
    /// For [`Readout::Max`]: per group and column, the vertex holding the maximum.
    argmax: Vec<usize>,
    /// For [`Readout::Attention`]: what its backward pass reads.
    attended: Option<Attended>,
}

impl Pooled {
    /// Pools `rows` (`width` values per vertex) over each of `groups` with `readout`
    /// ([`Readout::Sum`], [`Readout::Mean`], [`Readout::Max`]; [`Readout::Root`] takes each
    /// group's first vertex). An empty group pools to zeros.
    pub fn forward(rows: &[f32], width: usize, groups: Groups, readout: Readout) -> Pooled {
        let mut out = vec![0.0; groups.len() * width];
        let mut argmax = Vec::new();
        for (g, o) in groups.iter().zip(out.chunks_exact_mut(width.max(1))) {
            let row = |v: usize| &rows[v * width..(v + 1) * width];
            match readout {
                Readout::Root | Readout::Vertices | Readout::Attention => {
                    if let Some(&first) = g.first() {
                        o.copy_from_slice(row(first));
                    }
                }
                Readout::Sum | Readout::Mean => {
                    for &v in g {
                        o.iter_mut().zip(row(v)).for_each(|(o, x)| *o += x);
                    }
                    if readout == Readout::Mean && !g.is_empty() {
                        let n = g.len() as f32;
                        o.iter_mut().for_each(|o| *o /= n);
                    }
                }
                Readout::Max => {
                    let start = argmax.len();
                    argmax.resize(start + width, g.first().copied().unwrap_or(0));
                    if let Some(&first) = g.first() {
                        o.copy_from_slice(row(first));
                    }
                    for &v in g.iter().skip(1) {
                        for (j, &x) in row(v).iter().enumerate() {
                            if x > o[j] {
                                o[j] = x;
                                argmax[start + j] = v;
                            }
                        }
                    }
                }
            }
        }
        Pooled { rows: out, width, readout, groups, argmax, attended: None }
    }

    /// Attention pooling ([`Readout::Attention`]) of `rows` (`width` values per vertex) over
    /// each of `groups`, weighted per head by the softmax of `scores` (`heads` per vertex, each
    /// weighing `width / heads` columns) over the group, shifted by its largest score. An
    /// empty group pools to zeros; an error if `heads` does not divide `width` or the scores
    /// are not one row per vertex.
    pub fn attend(rows: Vec<f32>, width: usize, scores: &[f32], groups: Groups) -> Result<Pooled> {
        let vertices = rows.len() / width.max(1);
        let heads = scores.len() / vertices.max(1);
        if heads == 0 || !width.is_multiple_of(heads) || scores.len() != vertices * heads {
            return Err(Error::input(
                "attention readout: the top vertex function's second output (the scores)",
                format!("one row per vertex ({vertices}) of a width dividing the pushed row's {width}"),
                format!("{} values", scores.len()),
            ));
        }
        let part = width / heads;
        let mut out = vec![0.0; groups.len() * width];
        let mut weights = vec![0.0; groups.members.len() * heads];
        for (g, o) in out.chunks_exact_mut(width.max(1)).enumerate() {
            let (members, at) = (groups.group(g), groups.bounds[g]);
            for j in 0..heads {
                let s = |v: usize| scores[v * heads + j];
                let top = members.iter().map(|&v| s(v)).fold(f32::NEG_INFINITY, f32::max);
                let total: f32 = members.iter().map(|&v| (s(v) - top).exp()).sum();
                for (i, &v) in members.iter().enumerate() {
                    let a = (s(v) - top).exp() / total;
                    weights[(at + i) * heads + j] = a;
                    let x = &rows[v * width + j * part..][..part];
                    o[j * part..][..part].iter_mut().zip(x).for_each(|(o, x)| *o += a * x);
                }
            }
        }
        let attended = Attended { inputs: rows, heads, weights };
        let argmax = Vec::new();
        Ok(Pooled { rows: out, width, readout: Readout::Attention, groups, argmax, attended: Some(attended) })
    }

    /// The gradient of every vertex's row (`vertices` of them) from the gradient of each pooled
    /// row, and for attention pooling that of every vertex's scores.
    pub fn backward(&self, grad: &[f32], vertices: usize) -> (Vec<f32>, Option<Vec<f32>>) {
        let w = self.width;
        let mut out = vec![0.0; vertices * w];
        if let Some(Attended { inputs: rows, heads, weights }) = &self.attended {
            let (heads, part) = (*heads, w / heads);
            let mut scores = vec![0.0; vertices * heads];
            for (g, (dy, y)) in grad.chunks_exact(w.max(1)).zip(self.rows.chunks_exact(w.max(1))).enumerate() {
                let at = self.groups.bounds[g];
                for (i, &v) in self.groups.group(g).iter().enumerate() {
                    for j in 0..heads {
                        let a = weights[(at + i) * heads + j];
                        let cols = j * part..(j + 1) * part;
                        let x = &rows[v * w..][cols.clone()];
                        let dot: f32 = dy[cols.clone()]
                            .iter()
                            .zip(x.iter().zip(&y[cols.clone()]))
                            .map(|(d, (x, y))| d * (x - y))
                            .sum();
                        scores[v * heads + j] += a * dot;
                        out[v * w..][cols.clone()].iter_mut().zip(&dy[cols]).for_each(|(o, d)| *o += a * d);
                    }
                }
            }
            return (out, Some(scores));
        }
        for (k, (g, dy)) in self.groups.iter().zip(grad.chunks_exact(w.max(1))).enumerate() {
            match self.readout {
                Readout::Root | Readout::Vertices | Readout::Attention => {
                    if let Some(&first) = g.first() {
                        out[first * w..(first + 1) * w].copy_from_slice(dy);
                    }
                }
                Readout::Sum | Readout::Mean => {
                    let share = if self.readout == Readout::Mean { 1.0 / g.len().max(1) as f32 } else { 1.0 };
                    for &v in g {
                        out[v * w..(v + 1) * w].iter_mut().zip(dy).for_each(|(o, d)| *o += d * share);
                    }
                }
                Readout::Max => {
                    if !g.is_empty() {
                        for (j, &d) in dy.iter().enumerate() {
                            out[self.argmax[k * w + j] * w + j] += d;
                        }
                    }
                }
            }
        }
        (out, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each pooling against its formula, and its backward pass as the transpose of its
    /// (piecewise) linear map: `⟨dy, pool(x)⟩ = ⟨backward(dy), x⟩`.
    #[test]
    fn pooling_and_its_gradient() {
        // Three vertices of width 2 in one group, then one vertex alone, then an empty group.
        let rows = [1.0, -2.0, 3.0, 0.5, -1.0, 4.0, 7.0, 8.0];
        let groups = || Groups::ranges([0..3, 3..4, 4..4]);
        let dy = [0.5, -1.0, 2.0, 3.0, 9.0, 9.0];
        let want = [
            (Readout::Root, [1.0, -2.0, 7.0, 8.0, 0.0, 0.0]),
            (Readout::Sum, [3.0, 2.5, 7.0, 8.0, 0.0, 0.0]),
            (Readout::Mean, [1.0, 2.5 / 3.0, 7.0, 8.0, 0.0, 0.0]),
            (Readout::Max, [3.0, 4.0, 7.0, 8.0, 0.0, 0.0]),
        ];
        for (readout, pooled) in want {
            let p = Pooled::forward(&rows, 2, groups(), readout);
            assert_eq!(p.rows, pooled, "{readout:?}");
            let (dx, scores) = p.backward(&dy, 4);
            assert!(scores.is_none());
            let lhs: f32 = dy.iter().zip(&p.rows).map(|(a, b)| a * b).sum();
            let rhs: f32 = dx.iter().zip(&rows).map(|(a, b)| a * b).sum();
            assert!((lhs - rhs).abs() < 1e-5, "{readout:?}: {lhs} vs {rhs}");
        }
        let p = Pooled::forward(&rows, 2, groups(), Readout::Max);
        assert_eq!(p.backward(&dy, 4).0, [0.0, 0.0, 0.5, 0.0, 0.0, -1.0, 2.0, 3.0]);
    }

    /// A vertex in two groups (a graph read twice) gets both groups' gradients.
    #[test]
    fn overlapping_groups_add_their_gradients() {
        let rows = [1.0, 2.0, 3.0];
        let mut groups = Groups::default();
        groups.push(0..2);
        groups.push([1, 2]);
        let p = Pooled::forward(&rows, 1, groups, Readout::Sum);
        assert_eq!(p.rows, [3.0, 5.0]);
        assert_eq!(p.backward(&[1.0, 10.0], 3).0, [1.0, 11.0, 10.0]);
    }

    /// Attention pooling: its rows against the formula, its gradients (rows and scores)
    /// against central differences, per head.
    #[test]
    fn attention_pooling_and_its_gradient() {
        let (width, heads) = (4, 2);
        let rows: Vec<f32> = (0..5 * width).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect();
        let scores: Vec<f32> = (0..5 * heads).map(|i| ((i * 5 % 7) as f32 - 3.0) / 2.0).collect();
        let groups = || {
            let mut g = Groups::ranges([0..3, 3..3]);
            g.push([4, 1]);
            g
        };
        let p = Pooled::attend(rows.clone(), width, &scores, groups()).expect("scores fit");
        // Group 0, head 1 (columns 2, 3) by hand.
        let e: Vec<f32> = (0..3).map(|v| scores[v * heads + 1].exp()).collect();
        let z: f32 = e.iter().sum();
        let want: f32 = (0..3).map(|v| e[v] / z * rows[v * width + 3]).sum();
        assert!((p.rows[3] - want).abs() < 1e-6, "{} vs {want}", p.rows[3]);
        assert_eq!(&p.rows[width..2 * width], [0.0; 4], "an empty group pools to zeros");
        let dy: Vec<f32> = (0..3 * width).map(|i| ((i * 3 % 5) as f32 - 2.0) / 3.0).collect();
        let (dx, ds) = p.backward(&dy, 5);
        let ds = ds.expect("attention has score gradients");
        let loss = |rows: &[f32], scores: &[f32]| -> f64 {
            let p = Pooled::attend(rows.to_vec(), width, scores, groups()).expect("scores fit");
            p.rows.iter().zip(&dy).map(|(y, d)| f64::from(y * d)).sum()
        };
        let h = 1e-2;
        for i in 0..rows.len() {
            let (mut up, mut down) = (rows.clone(), rows.clone());
            (up[i], down[i]) = (up[i] + h, down[i] - h);
            let fd = (loss(&up, &scores) - loss(&down, &scores)) / (2.0 * f64::from(h));
            assert!((fd - f64::from(dx[i])).abs() < 1e-3, "row value {i}: {} vs {fd}", dx[i]);
        }
        for i in 0..scores.len() {
            let (mut up, mut down) = (scores.clone(), scores.clone());
            (up[i], down[i]) = (up[i] + h, down[i] - h);
            let fd = (loss(&rows, &up) - loss(&rows, &down)) / (2.0 * f64::from(h));
            assert!((fd - f64::from(ds[i])).abs() < 1e-3, "score {i}: {} vs {fd}", ds[i]);
        }
        assert!(Pooled::attend(rows.clone(), width, &scores[..7], groups()).is_err());
        assert!(Pooled::attend(rows, width, &[0.0; 15], groups()).is_err(), "3 heads do not divide 4 columns");
    }

    #[test]
    fn pools_choose_vertices() {
        // 0 and 1 under 2; 3 alone.
        let g = InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)], vec![]]).expect("a forest");
        let place = || "here".to_string();
        assert_eq!(Pool::All.vertices(&g, &place).ok(), Some(vec![0, 1, 2, 3]));
        assert_eq!(Pool::Range(1..3).vertices(&g, &place).ok(), Some(vec![1, 2]));
        assert_eq!(Pool::Roots.vertices(&g, &place).ok(), Some(vec![2, 3]));
        assert_eq!(Pool::Mask(&[true, false, false, true]).vertices(&g, &place).ok(), Some(vec![0, 3]));
        let bad = [Pool::Range(2..5), Pool::Mask(&[true])];
        for pool in bad {
            let e = pool.vertices(&g, &place).expect_err("does not fit");
            assert!(e.to_string().contains("here"), "{e}");
        }
        for r in Readout::ALL {
            assert_eq!(Readout::from_name(r.name()), Some(r));
        }
    }
}
