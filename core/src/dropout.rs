//! Dropout masks from a counter-based generator: each element's draw is a hash of where it is
//! (seed, step, dropout site, graph, vertex, column), never of how the minibatch was batched. So
//! a batched pass draws what one example at a time draws, every backend and every data-parallel
//! worker draw the same masks, and a resumed run draws what the uninterrupted one did.
//!
//! A vertex function declares dropout with [`Var::dropout`](crate::ir::Var::dropout): each call
//! is a *site*, an extra pulled input holding the mask (`0` or `1 / (1 − p)` per element) that
//! the engine fills from the pass's [`DropoutKey`] in training and with ones in inference.

use crate::graph::InputGraph;
use crate::ir::VertexFn;

/// What a pass's masks are drawn from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropoutKey {
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step (a new mask every step).
    pub step: u64,
    /// The index of the pass's first graph in the whole minibatch (a data-parallel worker's
    /// share starts there), so graph `g` of the pass draws as graph `first + g`.
    pub first: usize,
}

/// SplitMix64's finaliser: a bijection of 64 bits that mixes every input bit into every output bit.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Mixes `v` into the running hash `h`.
fn absorb(h: u64, v: u64) -> u64 {
    mix(h ^ v.wrapping_add(0x9e37_79b9_7f4a_7c15))
}

/// The hash every draw of `graph`'s vertex `vertex` at site `site` starts from.
fn place(key: DropoutKey, site: usize, graph: usize, vertex: usize) -> u64 {
    [key.step, site as u64, graph as u64, vertex as u64].into_iter().fold(mix(key.seed), absorb)
}

/// Whether draw `j` from `base` drops at rate `p`: a 24-bit uniform falls below p·2^24.
fn drops(base: u64, j: u64, p: f32) -> bool {
    let threshold = (f64::from(p) * f64::from(1u32 << 24)) as u64;
    absorb(base, j) >> 40 < threshold
}

/// Writes the mask row of `graph`'s vertex `vertex` at site `site` into `row`: each element is
/// dropped (`0`) with probability `p`, else kept and scaled to `1 / (1 − p)`.
pub fn mask_row(key: DropoutKey, site: usize, graph: usize, vertex: usize, p: f32, row: &mut [f32]) {
    let base = place(key, site, graph, vertex);
    let keep = 1.0 / (1.0 - p);
    for (j, m) in row.iter_mut().enumerate() {
        *m = if drops(base, j as u64, p) { 0.0 } else { keep };
    }
}

/// Whether `graph`'s vertex `vertex` is dropped as a whole at site `site` with probability `p`
/// (word dropout: one draw per vertex rather than per element).
pub fn vertex_dropped(key: DropoutKey, site: usize, graph: usize, vertex: usize, p: f32) -> bool {
    drops(place(key, site, graph, vertex), 0, p)
}

/// The masks of every dropout site of `f` over one pass's graphs, given their vertex counts
/// `sizes`: site by site, each in merged-vertex order (graph by graph, vertex by vertex), drawn
/// from `key` when `train`, all ones otherwise (dropout is the identity in inference). Reuses
/// `out`'s vectors.
pub fn fill_masks(f: &VertexFn, key: DropoutKey, sizes: &[usize], train: bool, out: &mut Vec<Vec<f32>>) {
    let sites = f.dropout_rates();
    let ports = &f.all_inputs()[f.inputs().len()..];
    let vertices: usize = sizes.iter().sum();
    out.resize_with(sites.len(), Vec::new);
    for (site, ((&p, port), mask)) in sites.iter().zip(ports).zip(out.iter_mut()).enumerate() {
        let block = port.shape.numel();
        mask.clear();
        mask.resize(vertices * block, 1.0);
        if !train {
            continue;
        }
        let mut rows = mask.chunks_exact_mut(block.max(1));
        for (g, &size) in sizes.iter().enumerate() {
            for v in 0..size {
                if let Some(row) = rows.next() {
                    mask_row(key, site, key.first + g, v, p, row);
                }
            }
        }
    }
}

/// [`fill_masks`] into new vectors: what a reference run (one graph at a time, with `first`
/// set to the graph's index in the minibatch) appends to its pulls.
pub fn masks(f: &VertexFn, key: DropoutKey, graphs: &[&InputGraph], train: bool) -> Vec<Vec<f32>> {
    let sizes: Vec<usize> = graphs.iter().map(|g| g.len()).collect();
    let mut out = Vec::new();
    fill_masks(f, key, &sizes, train, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// About a fraction `p` of a long row is dropped, the rest scaled so the mean stays 1; a
    /// different step, site, graph or vertex draws a different row.
    #[test]
    fn masks_drop_a_fraction_p_and_keep_the_mean() {
        let key = DropoutKey { seed: 3, step: 7, first: 0 };
        for p in [0.1f32, 0.5, 0.8] {
            let mut row = vec![0.0; 20_000];
            mask_row(key, 0, 0, 0, p, &mut row);
            let dropped = row.iter().filter(|&&m| m == 0.0).count() as f32 / row.len() as f32;
            let mean = row.iter().sum::<f32>() / row.len() as f32;
            assert!((dropped - p).abs() < 0.015, "p {p}: dropped {dropped}");
            assert!((mean - 1.0).abs() < 0.05, "p {p}: mean {mean}");
        }
        let draw = |key: DropoutKey, site, graph, vertex| {
            let mut row = vec![0.0; 64];
            mask_row(key, site, graph, vertex, 0.5, &mut row);
            row
        };
        let first = draw(key, 0, 0, 0);
        assert_eq!(first, draw(key, 0, 0, 0));
        for other in [
            draw(DropoutKey { step: 8, ..key }, 0, 0, 0),
            draw(DropoutKey { seed: 4, ..key }, 0, 0, 0),
            draw(key, 1, 0, 0),
            draw(key, 0, 1, 0),
            draw(key, 0, 0, 1),
        ] {
            assert_ne!(first, other);
        }
    }

    /// A whole vertex is dropped at about rate `p`, and its draw is the first element's.
    #[test]
    fn a_vertex_is_dropped_at_rate_p_as_its_first_element_is() {
        let key = DropoutKey { seed: 5, step: 2, first: 0 };
        for p in [0.05f32, 0.2, 0.5] {
            let n = 20_000;
            let dropped = (0..n).filter(|&v| vertex_dropped(key, 9, 1, v, p)).count() as f32 / n as f32;
            assert!((dropped - p).abs() < 0.015, "p {p}: dropped {dropped}");
            for v in 0..100 {
                let mut row = [0.0];
                mask_row(key, 9, 1, v, p, &mut row);
                assert_eq!(vertex_dropped(key, 9, 1, v, p), row[0] == 0.0);
            }
        }
        assert!((0..1000).all(|v| !vertex_dropped(key, 0, 0, v, 0.0)));
    }
}
