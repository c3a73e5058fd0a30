//! Data-parallel steps: every worker holds a replica of the model, takes a share of the minibatch
//! balanced by vertex count, and the gradients are summed across workers (in rank order, so the
//! replicas stay bitwise identical) and divided by the minibatch's target count, so a step equals
//! one worker's step on the whole minibatch up to the rounding of the sums.
//!
//! Gradients travel in buckets as soon as they are final (wait-free backpropagation): the output
//! layer's (with the loss counts) before the vertex function's backward pass runs, the vertex
//! function's (one per parameter, handed over without a copy and summed out of place) before the
//! embedding's gradient is formed, the embedding's sparse rows last.

use super::collective::{Collective, Values};
use crate::data::TreeExample;
use crate::engine::Planned;
use crate::layers::{LossOn, SparseGrad};
use crate::optim::Optimizer;
use crate::train::{batch, Classifier, StepGrads, StepStats};
use crate::{Backend, InputGraph};
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

/// The targets of a minibatch (the denominator of its mean loss), and its cut into `n`
/// contiguous shares of about equal vertex counts.
pub(crate) fn split(examples: &[&TreeExample], n: usize, loss_on: LossOn) -> Result<(usize, Vec<Range<usize>>)> {
    let mut targets = 0;
    for e in examples {
        targets += loss_on.select(&[&e.graph], &e.labels)?.iter().flatten().count();
    }
    let weights: Vec<usize> = examples.iter().map(|e| e.graph.len()).collect();
    Ok((targets, shard(&weights, n)))
}

/// The graphs of worker `rank`'s share (of `size` workers) of a minibatch: what its engine runs.
pub fn share_graphs<'a>(
    examples: &[&'a TreeExample],
    rank: usize,
    size: usize,
    loss_on: LossOn,
) -> Result<Vec<&'a InputGraph>> {
    let (_, shares) = split(examples, size, loss_on)?;
    let mine = shares.get(rank).cloned().unwrap_or_default();
    Ok(examples[mine].iter().map(|e| &e.graph).collect())
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
    rows: Vec<f32>,
    values: Values,
}

impl Pending {
    /// Starts the sums (collectives started before finish before these).
    pub(crate) fn start(coll: &mut dyn Collective, dense: Vec<Vec<f32>>, sparse: SparseGrad) -> Result<Pending> {
        let dense: Vec<Values> = dense.into_iter().map(Arc::new).collect();
        for g in &dense {
            coll.start_all_gather_shared(Arc::clone(g))?;
        }
        let (rows, values) = (encode(&sparse.rows), Arc::new(sparse.values));
        coll.start_all_gather_values(&rows)?;
        coll.start_all_gather_shared(Arc::clone(&values))?;
        Ok(Pending { dense, rows, values })
    }

    /// The sums over every worker (added in rank order): of each dense gradient, and of the
    /// sparse gradients of a `vocab × dim` table.
    pub(crate) fn finish(
        self,
        coll: &mut dyn Collective,
        vocab: usize,
        dim: usize,
    ) -> Result<(Vec<Vec<f32>>, SparseGrad)> {
        let dense = self.dense.iter().map(|g| coll.finish_sum(g)).collect::<Result<Vec<_>>>()?;
        let me = coll.rank();
        let (peer_rows, peer_values) = (coll.finish_gather_values()?, coll.finish_gather_values()?);
        let parts = (0..coll.size())
            .map(|from| {
                let r = peer_rows[from].as_deref().unwrap_or(&self.rows);
                let v = peer_values[from].as_deref().unwrap_or(&self.values);
                Ok((decode(r, v, vocab, dim, me, from)?, v.as_slice()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((dense, merge_parts(&parts, dim)))
    }
}

/// The output bucket: the output layer's gradients, then loss, correct, count and vertices.
fn head(g: &[Vec<f32>], s: &StepStats) -> Vec<f32> {
    let mut out: Vec<f32> = g.iter().flatten().copied().collect();
    out.extend([s.loss, s.correct as f32, s.count as f32, s.vertices as f32]);
    out
}

/// [`head`] taken apart: the output layer's gradients (shaped like `like`) and the numbers.
fn unhead(bucket: &[f32], like: &[Vec<f32>]) -> (Vec<Vec<f32>>, StepStats) {
    let mut at = 0;
    let grads = like
        .iter()
        .map(|g| {
            at += g.len();
            bucket[at - g.len()..at].to_vec()
        })
        .collect();
    let s = &bucket[at..];
    (grads, StepStats { loss: s[0], correct: s[1] as usize, count: s[2] as usize, vertices: s[3] as usize })
}

/// One data-parallel optimizer step of `model` on the minibatch `examples` (the same on every
/// worker): this worker's share forward and backward, gradients summed across `coll`, then the
/// same update on every replica; `planned`, when given, is this worker's share already scheduled
/// ([`share_graphs`]). Returns the whole minibatch's numbers. The summed gradients
/// are new vectors every step: a program running many steps on threads wants its allocator to
/// keep freed memory mapped (the `arbor` CLI sets glibc's thresholds so).
pub fn step<B: Backend>(
    model: &mut Classifier<B>,
    coll: &mut dyn Collective,
    examples: &[&TreeExample],
    loss_on: LossOn,
    opt: &mut Optimizer,
    clip: Option<f32>,
    planned: Option<Planned<'_>>,
) -> Result<StepStats> {
    let (denom, shares) = split(examples, coll.size(), loss_on)?;
    let share = shares[coll.rank()].clone();
    // Dropout masks are keyed by each tree's place in the whole minibatch, so every split of it
    // draws the same masks.
    let key = model.engine.dropout_key();
    model.engine.set_dropout_key(crate::DropoutKey { first: share.start, ..key });
    // The head's examples are the rows with a target: its masks are keyed by their place.
    let mut before = 0;
    for e in &examples[..share.start] {
        before += loss_on.select(&[&e.graph], &e.labels)?.iter().flatten().count();
    }
    let out = model.out.head().engine();
    out.set_dropout_key(crate::DropoutKey { first: before, ..out.dropout_key() });
    let mine = &examples[share];
    let local = batch(mine);
    let many = coll.size() > 1;

    let pass = if mine.is_empty() {
        None
    } else {
        let targets = loss_on.select(&local.graphs, &local.labels)?;
        let readout = crate::train::Readout::Vertices(&targets);
        Some(model.output_pass_planned(&local.graphs, &local.words, readout, Some(denom), planned)?)
    };
    let (stats, classifier, push_grad) = match pass {
        Some(out) => (out.stats, out.classifier, Some((out.push_grad, out.push_rows))),
        None => {
            let zeros = model.out.function().params().iter().map(|p| vec![0.0; p.shape.numel()]).collect();
            (StepStats::default(), zeros, None)
        }
    };
    // One worker: nothing to sum, so the output layer's gradients stay where they are.
    let mut bucket0 = if many { head(&classifier, &stats) } else { Vec::new() };
    if many {
        coll.start_all_reduce(&bucket0)?;
    }
    let (cell, embedding) = match push_grad {
        Some((push_grad, rows)) => model.input_pass(&push_grad, rows.as_deref())?,
        None => {
            let params = model.engine.function().params();
            (params.iter().map(|p| vec![0.0; p.shape.numel()]).collect(), SparseGrad::default())
        }
    };
    let (cell, embedding) = if many {
        let pending = Pending::start(coll, cell, embedding)?;
        coll.finish_all_reduce(&mut bucket0)?;
        pending.finish(coll, model.embed.vocab(), model.embed.dim())?
    } else {
        (cell, embedding)
    };

    let (classifier, stats) = if many { unhead(&bucket0, &classifier) } else { (classifier, stats) };
    let mut grads = StepGrads { stats, cell, classifier, embedding };
    model.apply(&mut grads, opt, clip)?;
    Ok(grads.stats)
}
