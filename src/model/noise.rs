//! A step that also measures the gradient noise (for `--batch auto`,
//! [`crate::trainer::BatchSize`]): the minibatch runs as two micro-batches, and their gradients'
//! squared norms beside their sum's give one [`Noise`] measurement.

use super::{Example, Model, ModelGrads};
use crate::dist::data_parallel::merge;
use crate::optim::{sum_squares, Optimizer};
use crate::trainer::step::{add_all, all_values};
use crate::trainer::{Noise, StepStats};
use crate::{Backend, InputGraph};
use arbor_core::error::{Error, Result};

/// Adds every gradient of `g` to `into` (the first taken as it is).
fn add(into: &mut Option<ModelGrads>, g: ModelGrads, dim: usize) {
    let Some(sum) = into else {
        *into = Some(g);
        return;
    };
    sum.cells.iter_mut().zip(g.cells).for_each(|(a, b)| add_all(a, b));
    add_all(&mut sum.head, g.head);
    sum.words = merge(&[std::mem::take(&mut sum.words), g.words], dim);
}

/// The squared norm of every gradient in `g`.
fn squares(g: &mut ModelGrads) -> f64 {
    sum_squares(&all_values(&mut g.cells, &mut g.head, &mut g.words))
}

impl<B: Backend> Model<B> {
    /// One step on `batch` (`terms[i]` loss terms in example `i`; the summed loss divided by
    /// all of them) as step `step`, run as two micro-batches balanced by vertex count whose
    /// gradients are summed before the update (the same update as one pass, to the order of
    /// the sums; the same dropout masks), measuring the gradient noise from the micro-batches'
    /// gradients and their sum. A minibatch of one example runs whole, unmeasured.
    pub fn step_measured(
        &mut self,
        batch: &[Example<'_>],
        terms: &[usize],
        opt: &mut Optimizer,
        clip: Option<f32>,
        step: u64,
    ) -> Result<StepStats> {
        if terms.len() != batch.len() {
            let got = format!("{} for {} examples", terms.len(), batch.len());
            return Err(Error::input("a measured step's loss terms", "one count per example", got));
        }
        if batch.is_empty() {
            return Ok(StepStats::default());
        }
        let denom: usize = terms.iter().sum();
        let loss_at = self.head.loss_output();
        let dim = self.embedding.dim();
        let (mut sum, mut loss, mut small, mut inv_small) = (None, 0.0f32, 0.0f64, 0.0f64);
        let halves = if batch.len() > 1 { 2 } else { 1 };
        for half in 0..halves {
            let share = Model::<B>::share(batch, half, halves);
            self.key_share(batch, share.start, step);
            let mut g = self.gradients(&batch[share.clone()], denom, None)?;
            loss += g.outputs.get(loss_at).map_or(0.0, |l| l.iter().sum::<f32>()) / denom.max(1) as f32;
            // The micro-batch's own mean gradient: its sum over the minibatch's terms rescaled.
            let mine = terms[share].iter().sum::<usize>().max(1) as f64;
            small += squares(&mut g) * (denom as f64 / mine).powi(2) / halves as f64;
            inv_small += 1.0 / mine / halves as f64;
            add(&mut sum, g, dim);
        }
        let Some(mut grads) = sum else { return Ok(StepStats::default()) };
        let big = squares(&mut grads);
        grads.outputs.clear();
        self.apply(&mut grads, opt, clip)?;
        let vertices = batch.iter().flat_map(Example::graphs).map(InputGraph::len).sum();
        let noise =
            (halves == 2).then_some(Noise { small, inv_small, big, terms: denom as f64, examples: batch.len() as f64 });
        Ok(StepStats { loss, count: batch.len(), vertices, correct: 0, noise })
    }
}
