//! Readouts: how the rows a vertex function pushed over one graph become the single row a head
//! reads for that graph: the root's row, or the sum, mean or maximum over every vertex.
//!
//! A pooling readout is linear (sum, mean) or routes each column to one vertex (max), so its
//! gradient is exact and fixed: [`Pooled::backward`] spreads the head's gradient back over the
//! vertices. Nothing here is model-specific; a model picks a readout and trains through it.

use std::ops::Range;

/// How a graph's pushed rows are read out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Readout {
    /// The row of the graph's chosen vertex (its root).
    #[default]
    Root,
    /// The sum of every vertex's row.
    Sum,
    /// The mean of every vertex's row.
    Mean,
    /// The column-wise maximum over every vertex's row (the gradient goes to the vertex that
    /// holds it, the first one on a tie).
    Max,
    /// Every vertex's row, each read by the head as an example of its own (a target per vertex).
    /// Not a pooling: [`Pooled`] reads a group's first vertex for it, as for [`Readout::Root`].
    Vertices,
}

/// Rows pooled over groups of vertices, with what their backward pass needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Pooled {
    /// One row per group.
    pub rows: Vec<f32>,
    width: usize,
    readout: Readout,
    groups: Vec<Range<usize>>,
    /// For [`Readout::Max`]: per group and column, the vertex holding the maximum.
    argmax: Vec<usize>,
}

impl Pooled {
    /// Pools `rows` (`width` values per vertex) over each group of vertices with `readout`
    /// ([`Readout::Sum`], [`Readout::Mean`] or [`Readout::Max`]; [`Readout::Root`] takes each
    /// group's first vertex). An empty group pools to zeros.
    pub fn forward(rows: &[f32], width: usize, groups: Vec<Range<usize>>, readout: Readout) -> Pooled {
        let mut out = vec![0.0; groups.len() * width];
        let mut argmax = Vec::new();
        for (g, o) in groups.iter().zip(out.chunks_exact_mut(width.max(1))) {
            let row = |v: usize| &rows[v * width..(v + 1) * width];
            match readout {
                Readout::Root | Readout::Vertices => {
                    if !g.is_empty() {
                        o.copy_from_slice(row(g.start));
                    }
                }
                Readout::Sum | Readout::Mean => {
                    for v in g.clone() {
                        o.iter_mut().zip(row(v)).for_each(|(o, x)| *o += x);
                    }
                    if readout == Readout::Mean && !g.is_empty() {
                        let n = g.len() as f32;
                        o.iter_mut().for_each(|o| *o /= n);
                    }
                }
                Readout::Max => {
                    let start = argmax.len();
                    argmax.resize(start + width, g.start);
                    if !g.is_empty() {
                        o.copy_from_slice(row(g.start));
                    }
                    for v in g.clone().skip(1) {
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
        Pooled { rows: out, width, readout, groups, argmax }
    }

    /// The gradient of every vertex's row (`vertices` of them) from the gradient of each pooled
    /// row.
    pub fn backward(&self, grad: &[f32], vertices: usize) -> Vec<f32> {
        let w = self.width;
        let mut out = vec![0.0; vertices * w];
        for (k, (g, dy)) in self.groups.iter().zip(grad.chunks_exact(w.max(1))).enumerate() {
            match self.readout {
                Readout::Root | Readout::Vertices => {
                    if !g.is_empty() {
                        out[g.start * w..(g.start + 1) * w].copy_from_slice(dy);
                    }
                }
                Readout::Sum | Readout::Mean => {
                    let share = if self.readout == Readout::Mean { 1.0 / g.len().max(1) as f32 } else { 1.0 };
                    for v in g.clone() {
                        out[v * w..(v + 1) * w].iter_mut().zip(dy).for_each(|(o, d)| *o = d * share);
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
        out
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
        let groups = vec![0..3, 3..4, 4..4];
        let dy = [0.5, -1.0, 2.0, 3.0, 9.0, 9.0];
        let want = [
            (Readout::Root, [1.0, -2.0, 7.0, 8.0, 0.0, 0.0]),
            (Readout::Sum, [3.0, 2.5, 7.0, 8.0, 0.0, 0.0]),
            (Readout::Mean, [1.0, 2.5 / 3.0, 7.0, 8.0, 0.0, 0.0]),
            (Readout::Max, [3.0, 4.0, 7.0, 8.0, 0.0, 0.0]),
        ];
        for (readout, pooled) in want {
            let p = Pooled::forward(&rows, 2, groups.clone(), readout);
            assert_eq!(p.rows, pooled, "{readout:?}");
            let dx = p.backward(&dy, 4);
            let lhs: f32 = dy.iter().zip(&p.rows).map(|(a, b)| a * b).sum();
            let rhs: f32 = dx.iter().zip(&rows).map(|(a, b)| a * b).sum();
            assert!((lhs - rhs).abs() < 1e-5, "{readout:?}: {lhs} vs {rhs}");
        }
        let p = Pooled::forward(&rows, 2, groups, Readout::Max);
        assert_eq!(p.backward(&dy, 4), [0.0, 0.0, 0.5, 0.0, 0.0, -1.0, 2.0, 3.0]);
    }
}
