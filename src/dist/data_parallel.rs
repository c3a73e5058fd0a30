//! What data-parallel steps are made of (a model's `step_shared` takes them):
//! every worker holds a replica of the model and takes a share of the minibatch balanced by
//! vertex count ([`shard`]), and the gradients are summed across workers (in rank order, so the
//! replicas stay bitwise identical), so a step equals one worker's step on the whole minibatch
//! up to the rounding of the sums.
//!
//! Gradients travel in buckets, each dense tensor handed over without a copy and summed out of
//! place, the word vectors' sparse rows last; sparse gradients are summed by row
//! ([`merge`]).

use super::collective::{Collective, Values};
use crate::layers::SparseGrad;
use arbor_core::error::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// Splits items of the given weights (e.g. vertices per tree) into `n` contiguous shards whose
/// total weights are as even as a contiguous cut allows; some shards may be empty.
pub fn shard(weights: &[usize], n: usize) -> Vec<Range<usize>> {
    let n = n.max(1);
    let total: usize = weights.iter().sum();
    let mut cuts = vec![0; n + 1];
    let (mut acc, mut i) = (0usize, 0usize);
    for (k, cut) in cuts.iter_mut().enumerate().skip(1) {
        // Cut where the running total is closest to k/n of the whole.
        let goal = total * k / n;
        while i < weights.len() && (acc + weights[i]).abs_diff(goal) <= acc.abs_diff(goal) {
            acc += weights[i];
            i += 1;
        }
        *cut = if k == n { weights.len() } else { i };
    }
    cuts.windows(2).map(|w| w[0]..w[1]).collect()
}

/// The rows of a sparse gradient as f32 values (their bits), to travel beside its values.
fn encode(rows: &[u32]) -> Vec<f32> {
    rows.iter().map(|&r| f32::from_bits(r)).collect()
}

/// The rows of a sparse gradient of a `vocab × dim` table, with `values`, that worker `me`
/// received from worker `from`.
fn decode(rows: &[f32], values: &[f32], vocab: usize, dim: usize, me: usize, from: usize) -> Result<Vec<u32>> {
    let rows: Vec<u32> = rows.iter().map(|v| v.to_bits()).collect();
    if values.len() != rows.len() * dim || rows.iter().any(|&r| r as usize >= vocab) {
        let msg = format!(
            "worker {from} sent a malformed sparse gradient ({} rows, {} values, {vocab} × {dim} table)",
            rows.len(),
            values.len()
        );
        return Err(Error::Worker { rank: me, msg });
    }
    Ok(rows)
}

/// The sum of sparse gradients, added in the order given; rows ascending.
pub fn merge(parts: &[SparseGrad], dim: usize) -> SparseGrad {
    let views: Vec<(&[u32], &[f32])> = parts.iter().map(|g| (g.rows.as_slice(), g.values.as_slice())).collect();
    merge_parts(&views, dim)
}

/// [`merge`] over parts given as rows and their values back to back.
fn merge_parts<R: AsRef<[u32]>>(parts: &[(R, &[f32])], dim: usize) -> SparseGrad {
    // Every row of every part as (row, part, position), sorted: a row's copies stay in order.
    let mut order: Vec<(u32, usize, usize)> = parts
        .iter()
        .enumerate()
        .flat_map(|(p, (rows, _))| rows.as_ref().iter().enumerate().map(move |(k, &r)| (r, p, k)))
        .collect();
    order.sort_unstable();
    let mut out = SparseGrad { rows: Vec::with_capacity(order.len()), values: Vec::with_capacity(order.len() * dim) };
    for (r, p, k) in order {
        let v = &parts[p].1[k * dim..(k + 1) * dim];
        if out.rows.last() == Some(&r) {
            let at = out.values.len() - dim;
            out.values[at..].iter_mut().zip(v).for_each(|(a, x)| *a += x);
        } else {
            out.rows.push(r);
            out.values.extend_from_slice(v);
        }
    }
    out
}

/// Dense gradients and one sparse gradient of a table on their way to being summed across the
/// workers of a [`Collective`]: each handed to the peers as it is (one bucket per tensor, then
/// the table's rows and their values) and summed out of place, with no copies to share them.
pub(crate) struct Pending {
    dense: Vec<Values>,
    /// Tensors per layer, to hand the sums back as they came.
    counts: Vec<usize>,
    rows: Vec<f32>,
    values: Values,
}

impl Pending {
    /// Starts the sums of `layers` (each a layer's dense tensors) and of `sparse` (collectives
    /// started before finish before these).
    pub(crate) fn start(coll: &mut dyn Collective, layers: Vec<Vec<Vec<f32>>>, sparse: SparseGrad) -> Result<Pending> {
        let counts = layers.iter().map(Vec::len).collect();
        let dense: Vec<Values> = layers.into_iter().flatten().map(Arc::new).collect();
        for g in &dense {
            coll.start_all_gather_shared(Arc::clone(g))?;
        }
        let (rows, values) = (encode(&sparse.rows), Arc::new(sparse.values));
        coll.start_all_gather_values(&rows)?;
        coll.start_all_gather_shared(Arc::clone(&values))?;
        Ok(Pending { dense, counts, rows, values })
    }

    /// The sums over every worker (added in rank order): of each layer's dense gradients, by
    /// layer as they were started, and of the sparse gradients of a `vocab × dim` table.
    pub(crate) fn finish(
        self,
        coll: &mut dyn Collective,
        vocab: usize,
        dim: usize,
    ) -> Result<(Vec<Vec<Vec<f32>>>, SparseGrad)> {
        let mut dense = self.dense.iter().map(|g| coll.finish_sum(g)).collect::<Result<Vec<_>>>()?.into_iter();
        let layers = self.counts.iter().map(|&n| dense.by_ref().take(n).collect()).collect();
        let me = coll.rank();
        let (peer_rows, peer_values) = (coll.finish_gather_values()?, coll.finish_gather_values()?);
        let parts = (0..coll.size())
            .map(|from| {
                let r = peer_rows[from].as_deref().unwrap_or(&self.rows);
                let v = peer_values[from].as_deref().unwrap_or(&self.values);
                Ok((decode(r, v, vocab, dim, me, from)?, v.as_slice()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((layers, merge_parts(&parts, dim)))
    }
}
