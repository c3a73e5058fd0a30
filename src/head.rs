//! Heads and losses: what turns the rows vertex functions pushed into a loss per example,
//! declared in the same IR as a cell and differentiated the same way.
//!
//! A head is a function of arity 0 (no children, no states) built with [`Builder`]:
//! its pulls are the rows read out of the cells (a root's `h`, one per graph of an example: two
//! for a sentence pair) and the targets; it pushes a one-value output named `loss`, and may push
//! more (a prediction). [`Head`] runs it once per example of a minibatch, batched over the
//! examples, on any backend, with its fused kernels generated like a cell's. The loss functions
//! below build the usual losses from head ops; a loss of one's own is head ops ending in one value.
//!
//! ```
//! use arbor::head::{kl_divergence, Head};
//! use arbor::{Builder, CpuBackend, Init};
//! use arbor::rng::Rng;
//!
//! // Tai et al.'s relatedness head: pair features of two roots, 50 sigmoid units, a softmax over
//! // the scores 1..5 and the KL divergence to the target distribution.
//! let f = Builder::new("relatedness", 0);
//! let (ha, hb, p) = (f.pull("ha", 8), f.pull("hb", 8), f.pull("target", 5));
//! let features = (ha - hb).abs().concat(ha * hb);
//! let w = f.param("W", [16, 50], Init::Xavier);
//! let b = f.param("b", [1, 50], Init::Zeros);
//! let v = f.param("V", [50, 5], Init::Xavier);
//! let log_q = (features.matmul(w) + b).sigmoid().matmul(v).log_softmax();
//! f.push("loss", kl_divergence(log_q, p));
//! let f = f.build()?;
//! let params = f.init_params(&mut Rng::new(0));
//! let mut head = Head::new(CpuBackend::new(), f, &params)?;
//! // Two examples.
//! let (ha, hb) = (vec![0.1; 2 * 8], vec![0.2; 2 * 8]);
//! let target = [0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0];
//! let losses = head.forward(&[&ha, &hb, &target])?.swap_remove(0);
//! let grads = head.backward(0.5)?; // the mean over the two examples
//! assert_eq!((losses.len(), grads.pulls[0].len()), (2, 2 * 8));
//! # Ok::<(), arbor::Error>(())
//! ```

use crate::engine::{Engine, Gradients, LinkedRows, Pass, Pull};
use crate::{Backend, Builder, Init, InputGraph, Var, VertexFn};
use arbor_core::error::{Error, Result};

/// A tiny value added under logarithms of targets, so that `0 · log 0` reads as 0.
const TINY: f32 = 1e-12;

/// A head function and its parameters on a backend, run over the examples of a minibatch.
pub struct Head<B: Backend> {
    engine: Engine<B>,
    /// Which pushed output is the loss.
    loss: usize,
    /// One example: a graph of one vertex (a minibatch of examples is as many of them, so
    /// dropout masks are keyed by the example).
    one: InputGraph,
    /// The examples of the last [`Head::forward`].
    examples: usize,
}

impl<B: Backend> Head<B> {
    /// A head running `f` on `backend` with `params` (in `f.params()` order). `f` must take no
    /// children and push a one-value output named `loss`.
    pub fn new(backend: B, f: VertexFn, params: &[Vec<f32>]) -> Result<Head<B>> {
        let wrong = |got: String| {
            Error::input(format!("head `{}`", f.name()), "a function of arity 0 pushing a one-value `loss`", got)
        };
        if f.arity() != 0 || !f.states().is_empty() {
            return Err(wrong(format!("arity {} and {} states", f.arity(), f.states().len())));
        }
        let loss =
            f.outputs().iter().position(|o| o.name == "loss").ok_or_else(|| wrong("no output named `loss`".into()))?;
        if f.outputs()[loss].shape.numel() != 1 {
            return Err(wrong(format!("a `loss` of shape {}", f.outputs()[loss].shape)));
        }
        let engine = Engine::new(backend, f, params)?;
        Ok(Head { engine, loss, one: InputGraph::isolated(1), examples: 0 })
    }

    /// Runs the head over a minibatch, keeping what [`Head::backward`] needs: input `i` of the
    /// function gets `inputs[i]`, one block per example. Returns every pushed output (the loss
    /// among them), one block per example.
    pub fn forward(&mut self, inputs: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
        self.examples = self.count(&inputs.iter().map(|i| i.len()).collect::<Vec<_>>())?;
        let pulls: Vec<Pull<'_>> = inputs.iter().map(|&rows| Pull::Rows(rows)).collect();
        self.engine.run(Pass::train(&vec![&self.one; self.examples], &pulls))
    }

    /// [`Head::forward`] for inference: keeps nothing for a backward pass.
    pub fn infer(&mut self, inputs: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
        let examples = self.count(&inputs.iter().map(|i| i.len()).collect::<Vec<_>>())?;
        let pulls: Vec<Pull<'_>> = inputs.iter().map(|&rows| Pull::Rows(rows)).collect();
        self.engine.run(Pass::infer(&vec![&self.one; examples], &pulls))
    }

    /// [`Head::forward`] (or, without `train`, [`Head::infer`]) whose first inputs are the rows
    /// `linked` of `from`'s arena, one block per example (another engine on the same backend:
    /// [`Engine::output_rows`]), and the others `rest` from the host: what it reads never
    /// crosses to the host. Returns the outputs of inference; a training pass's stay on the
    /// backend until [`Head::kept_outputs`] reads them (after the backward passes are launched,
    /// say), and after a [`Head::backward`], [`Engine::input_grad_rows`] of [`Head::engine_ref`]
    /// gives the linked inputs' gradients back the same way.
    pub fn forward_linked(
        &mut self,
        from: &mut Engine<B>,
        linked: &[LinkedRows],
        rest: &[&[f32]],
        train: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let ports = self.engine.function().inputs();
        let sizes: Vec<usize> = linked
            .iter()
            .zip(ports)
            .map(|(l, p)| l.rows.len() * p.shape.numel())
            .chain(rest.iter().map(|r| r.len()))
            .collect();
        let examples = self.count(&sizes)?;
        let pulls: Vec<Pull<'_>> = linked.iter().map(Pull::Linked).chain(rest.iter().map(|&r| Pull::Rows(r))).collect();
        let graphs = vec![&self.one; examples];
        if !train {
            return self.engine.run_linked(Pass::infer(&graphs, &pulls), from);
        }
        self.engine.run_linked(Pass::train(&graphs, &pulls).kept(), from)?;
        self.examples = examples;
        self.engine.keep_outputs()?;
        Ok(Vec::new())
    }

    /// The outputs of the last training [`Head::forward_linked`], one block per example, in one
    /// read.
    pub fn kept_outputs(&mut self) -> Result<Vec<Vec<f32>>> {
        self.engine.read_kept_outputs()
    }

    /// The gradients of `scale · Σ loss` over the examples of the last [`Head::forward`]
    /// (`scale = 1 / examples` for the mean loss): per input, its rows' gradients; per
    /// parameter, its gradient.
    pub fn backward(&mut self, scale: f32) -> Result<Gradients> {
        let mut grads = self.backward_kept(scale)?;
        grads.params = self.engine.param_grads()?;
        Ok(grads)
    }

    /// [`Head::backward`], leaving the parameters' gradients in the head's engine (`params`
    /// comes back empty; see [`Engine::backward_kept`]).
    pub fn backward_kept(&mut self, scale: f32) -> Result<Gradients> {
        let n = self.examples;
        let grads: Vec<Vec<f32>> = self
            .engine
            .function()
            .outputs()
            .iter()
            .enumerate()
            .map(|(k, o)| if k == self.loss { vec![scale; n] } else { vec![0.0; n * o.shape.numel()] })
            .collect();
        let refs: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        self.engine.backward_kept(&refs)
    }

    /// Which pushed output is the loss.
    pub fn loss_output(&self) -> usize {
        self.loss
    }

    /// Every parameter's current values, in the function's order.
    pub fn params(&self) -> Result<Vec<Vec<f32>>> {
        self.engine.params()
    }

    /// The engine that runs the head (its parameters).
    pub fn engine(&mut self) -> &mut Engine<B> {
        &mut self.engine
    }

    /// [`Head::engine`], to read.
    pub fn engine_ref(&self) -> &Engine<B> {
        &self.engine
    }

    /// The head function.
    pub fn function(&self) -> &VertexFn {
        self.engine.function()
    }

    /// What the head's training passes draw their dropout masks from.
    pub fn dropout_key(&self) -> crate::DropoutKey {
        self.engine.dropout_key()
    }

    /// A copy with the same function and learned values (and dropout key and optimizer state) on
    /// `backend`.
    pub fn replica_on(&self, backend: B) -> Result<Head<B>> {
        let mut head = Head::new(backend, self.function().clone(), &self.engine.params()?)?;
        head.engine.set_dropout_key(self.engine.dropout_key());
        head.engine.set_optimizer_state(&self.engine.optimizer_state()?)?;
        Ok(head)
    }

    /// The number of examples inputs of `sizes` values each hold: the same for every input,
    /// else an error.
    fn count(&self, sizes: &[usize]) -> Result<usize> {
        let f = self.engine.function();
        let ports = f.inputs();
        if sizes.len() != ports.len() {
            return Err(Error::input(
                format!("inputs of head `{}`", f.name()),
                ports.len().to_string(),
                sizes.len().to_string(),
            ));
        }
        let per_input: Vec<usize> = sizes.iter().zip(ports).map(|(len, p)| len / p.shape.numel().max(1)).collect();
        let n = per_input.first().copied().unwrap_or(0);
        for ((&len, p), &count) in sizes.iter().zip(ports).zip(&per_input) {
            if count != n || len != n * p.shape.numel() {
                return Err(Error::input(
                    format!("input `{}` of head `{}`", p.name, f.name()),
                    format!("{n} blocks of {} values (one per example)", p.shape.numel()),
                    format!("{len} values"),
                ));
            }
        }
        Ok(n)
    }
}

/// `−Σ_j target_j · log_softmax(logits)_j`: softmax cross-entropy to a target distribution (a
/// one-hot row for a class label). One value per example.
pub fn softmax_cross_entropy<'b>(logits: Var<'b>, target: Var<'b>) -> Var<'b> {
    -(target * logits.log_softmax()).sum_cols()
}

/// `Σ_j p_j · (log p_j − log_q_j)`: the KL divergence from the distribution `q` (given as its
/// logarithm, e.g. a `log_softmax`) to the target distribution `p`, `0 · log 0` read as 0. One
/// value per example.
pub fn kl_divergence<'b>(log_q: Var<'b>, p: Var<'b>) -> Var<'b> {
    (p * ((p + TINY).log() - log_q)).sum_cols()
}

/// `Σ_j (prediction_j − target_j)² / width`: the mean squared error over a row. One value per
/// example.
pub fn mean_squared_error<'b>(prediction: Var<'b>, target: Var<'b>) -> Var<'b> {
    let d = prediction - target;
    (d * d).sum_cols().scale(1.0 / prediction.shape().cols() as f32)
}

/// `Σ_j max(z_j, 0) − z_j·t_j + log(1 + e^{−|z_j|})`: binary cross-entropy of sigmoid
/// probabilities given by their logits `z`, against targets `t` in `[0, 1]` (computed without
/// overflow for large `|z|`). One value per example.
pub fn binary_cross_entropy<'b>(logits: Var<'b>, target: Var<'b>) -> Var<'b> {
    (logits.relu() - logits * target + ((-logits.abs()).exp() + 1.0).log()).sum_cols()
}

/// The softmax classifier as a head function: `logits = h·weight + bias` over an `input`-wide
/// row `h`, softmax cross-entropy to the one-hot row `target`; pushes `loss` and `logits`.
pub fn softmax_classifier(input: usize, classes: usize) -> Result<VertexFn> {
    pooled_classifier(input, 1, classes, 0.0)
}

/// [`softmax_classifier`] over `rows` rows of `input` values each, concatenated (every step of
/// an unrolled graph pooled apart, say: pulled as `h0`, `h1`, …; one row is pulled as `h`), with
/// dropout at `dropout` on them when above 0.
pub fn pooled_classifier(input: usize, rows: usize, classes: usize, dropout: f32) -> Result<VertexFn> {
    let f = Builder::new("softmax-classifier", 0);
    let pulled: Vec<Var<'_>> = match rows {
        1 => vec![f.pull("h", input)],
        _ => (0..rows).map(|k| f.pull(&format!("h{k}"), input)).collect(),
    };
    let target = f.pull("target", classes);
    let h = if rows == 1 { pulled[0] } else { f.concat(&pulled) };
    let h = if dropout > 0.0 { h.dropout(dropout) } else { h };
    let weight = f.param("weight", [input * rows, classes], Init::Xavier);
    let logits = h.matmul(weight) + f.param("bias", [1, classes], Init::Zeros);
    f.push("loss", softmax_cross_entropy(logits, target));
    f.push("logits", logits);
    f.build()
}

/// The index of the largest value (the first on a tie): the class a row of logits predicts.
pub fn argmax(xs: &[f32]) -> usize {
    xs.iter().enumerate().fold(0, |best, (i, &x)| if x > xs[best] { i } else { best })
}

/// The softmax of a row of logits: the probability of each class (computed after subtracting
/// the largest logit, so large logits do not overflow).
pub fn probabilities(logits: &[f32]) -> Vec<f32> {
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&x| (x - top).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.iter().map(|e| e / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_sum_to_one_without_overflow_and_argmax_takes_the_first_top() {
        let p = probabilities(&[10.0, 10.0 + 2f32.ln(), -1e30]);
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-6 && (p[1] - 2.0 / 3.0).abs() < 1e-6 && p[2] == 0.0, "{p:?}");
        assert_eq!(probabilities(&[1e30, 1e30]), [0.5, 0.5]);
        assert_eq!(argmax(&[0.5, 2.0, 2.0]), 1);
        assert_eq!(argmax(&p), 1);
    }
}
