//! Optimizers: SGD with momentum, Adagrad, Adam and AdamW, with weight decay and gradient-norm
//! clipping. Dense parameters and embedding tables (sparse rows, state kept per row) share one
//! optimizer; each tensor has its own slot of state.

use crate::layers::SparseGrad;
use arbor_core::error::{Error, Result};
pub use arbor_core::finite::all_finite;
use arbor_core::optim::apply;
pub use arbor_core::optim::{average, Config, Rule, Update};
use arbor_ops::cpu::optim;
use std::collections::{BTreeMap, BTreeSet};

/// Per-tensor state.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Slot {
    /// First moment (momentum, Adam's m) or Adagrad's sum of squares.
    pub m: Vec<f32>,
    /// Adam's second moment.
    pub v: Vec<f32>,
}

/// An optimizer over any number of tensors, each with its own state under the tensor's name (as
/// checkpoints name it: `cell.W`, `classifier.bias`, `embedding`, …).
#[derive(Clone, Debug, PartialEq)]
pub struct Optimizer {
    /// Settings.
    pub config: Config,
    /// Steps taken (for Adam's bias correction).
    pub steps: u64,
    /// State per tensor, by name.
    pub slots: BTreeMap<String, Slot>,
    /// Learning rates in place of `config.lr` for the tensors named (see [`Optimizer::with_lr`]).
    pub lrs: BTreeMap<String, f32>,
    /// A factor on every learning rate (a schedule sets it per epoch; 1 by default).
    pub lr_factor: f32,
    /// Tensors left as they are (see [`Optimizer::freeze`]).
    pub frozen: BTreeSet<String>,
}

impl Optimizer {
    /// An optimizer with no state yet.
    pub fn new(config: Config) -> Optimizer {
        let (slots, lrs, frozen) = (BTreeMap::new(), BTreeMap::new(), BTreeSet::new());
        Optimizer { config, steps: 0, slots, lrs, lr_factor: 1.0, frozen }
    }

    /// Updates the tensor `name` at learning rate `lr` instead of `config.lr` (e.g. a slower
    /// `embedding`, whose rows of rare words otherwise move far on the few steps that see them).
    pub fn with_lr(mut self, name: &str, lr: f32) -> Optimizer {
        self.lrs.insert(name.to_string(), lr);
        self
    }

    /// Leaves the tensor `name` as it is (e.g. pre-trained word vectors, `embedding`): its
    /// gradient is still computed, but never applied, and it keeps no optimizer state.
    pub fn freeze(mut self, name: &str) -> Optimizer {
        self.frozen.insert(name.to_string());
        self
    }

    /// The settings `name` is updated with.
    fn config_of(&self, name: &str) -> Config {
        Config { lr: self.lrs.get(name).copied().unwrap_or(self.config.lr) * self.lr_factor, ..self.config }
    }

    /// The state as named tensors (`opt.<tensor>.m`, `opt.<tensor>.v`), for checkpoints.
    pub fn tensors(&self) -> Vec<crate::checkpoint::Named> {
        self.slots.iter().flat_map(|(name, s)| state_tensors(name, [s.m.clone(), s.v.clone()])).collect()
    }

    /// Restores the state saved by [`Optimizer::tensors`] after `steps` steps.
    pub fn restore(&mut self, ck: &crate::checkpoint::Checkpoint, steps: u64) -> arbor_core::Result<()> {
        self.steps = steps;
        self.slots.clear();
        for (key, _, m) in &ck.tensors {
            let Some(name) = key.strip_prefix("opt.").and_then(|k| k.strip_suffix(".m")) else { continue };
            let v = ck.tensor(&format!("opt.{name}.v"))?;
            self.slots.insert(name.to_string(), Slot { m: m.clone(), v: v.to_vec() });
        }
        Ok(())
    }

    /// Refuses settings no update can follow ([`Config::check`]) for any tensor, at the
    /// learning-rate factor now (a schedule's): checked before each step's updates, so such
    /// settings end training with an error naming them and change nothing.
    pub fn check(&self) -> Result<()> {
        if !(self.lr_factor.is_finite() && self.lr_factor >= 0.0) {
            let what = "the learning-rate factor (a schedule's, this epoch)";
            return Err(Error::input(what, "finite and at least 0", self.lr_factor.to_string()));
        }
        self.config.check(|| "the optimizer".into())?;
        self.lrs.keys().try_for_each(|name| self.config_of(name).check(|| format!("tensor `{name}`")))
    }

    /// Starts a step: call once before the updates of one minibatch.
    pub fn begin_step(&mut self) {
        self.steps += 1;
    }

    /// Takes back the last [`Optimizer::begin_step`]: its updates were skipped (on the backend,
    /// by the step's gate), so the next step has its number.
    pub fn cancel_step(&mut self) {
        self.steps = self.steps.saturating_sub(1);
    }

    fn slot(&mut self, name: &str, len: usize) -> &mut Slot {
        let adam = self.config.rule.uses_v();
        if !self.slots.contains_key(name) {
            self.slots.insert(name.to_string(), Slot::default());
        }
        let s = self.slots.get_mut(name).expect("inserted above");
        if s.m.len() != len || s.v.len() != len {
            // State the rule updates is written out now, so its memory is mapped once here
            // rather than page by page as an embedding's rows are first touched (as DyNet and
            // PyTorch do, at construction); Adam's second moment only where Adam uses it.
            s.m = written_zeros(len);
            s.v = if adam { written_zeros(len) } else { vec![0.0; len] };
        }
        s
    }

    /// The update of tensor `name` at this step (none if it is frozen), for a backend that keeps
    /// the tensor and its state ([`Engine::optimize`](crate::Engine::optimize)).
    pub fn update_of(&self, name: &str) -> Option<Update> {
        (!self.frozen.contains(name)).then(|| Update::new(self.config_of(name), self.steps))
    }

    /// Updates the dense tensor `name` (values `p`) with gradient `g` (nothing if it is frozen).
    pub fn dense(&mut self, name: &str, p: &mut [f32], g: &[f32]) {
        let Some(u) = self.update_of(name) else { return };
        let s = self.slot(name, p.len());
        optim::dense(&u, p, g, &mut s.m, &mut s.v);
    }

    /// Updates the rows that `g` touches of the embedding table `name` (`dim` wide; nothing if it
    /// is frozen), with state kept for every row, so a row's history survives minibatches that
    /// skip it.
    pub fn sparse(&mut self, name: &str, table: &mut [f32], dim: usize, g: &SparseGrad) {
        let Some(u) = self.update_of(name) else { return };
        let s = self.slot(name, table.len());
        let vocab = table.len() / dim.max(1);
        if dim == 0 || !optim::rows_in_order(&g.rows, vocab) {
            // Not the documented form (ascending, each once, in range): row by row, in order.
            for (k, &r) in g.rows.iter().enumerate() {
                let rows = r as usize * dim..(r as usize + 1) * dim;
                let (m, v) = (&mut s.m[rows.clone()], &mut s.v[rows.clone()]);
                apply(&u, &mut table[rows], &g.values[k * dim..(k + 1) * dim], m, v);
            }
            return;
        }
        optim::rows(&u, (table, dim), &g.rows, &g.values, &mut s.m, &mut s.v);
    }
}

/// `len` zeros with every page written (a zeroed allocation may leave its pages unmapped until
/// first touched).
fn written_zeros(len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    // One store per 4 KiB page; `black_box` keeps the compiler from dropping stores of zero.
    for x in v.iter_mut().step_by(1024) {
        *x = std::hint::black_box(0.0);
    }
    v
}

/// The state `[m, v]` of tensor `name` as checkpoint tensors (`opt.<name>.m`, `opt.<name>.v`),
/// wherever it is kept (the optimizer, or the engine beside the tensor).
pub(crate) fn state_tensors(name: &str, [m, v]: [Vec<f32>; 2]) -> [crate::checkpoint::Named; 2] {
    [(format!("opt.{name}.m"), vec![m.len()], m), (format!("opt.{name}.v"), vec![v.len()], v)]
}

/// Scales every gradient so their joint L2 norm is at most `max`; returns the norm before.
pub fn clip_grad_norm(grads: &mut [&mut [f32]], max: f32) -> f32 {
    let norm = sum_squares(grads).sqrt() as f32;
    clip_to(grads, norm, max);
    norm
}

/// The sum of the squares of every gradient value (in f64), for a norm over several workers.
pub fn sum_squares(grads: &[&mut [f32]]) -> f64 {
    grads.iter().map(|g| arbor_core::optim::sum_squares(g)).sum()
}

/// Scales every gradient by `max / norm` if their joint norm `norm` exceeds `max`.
pub fn clip_to(grads: &mut [&mut [f32]], norm: f32, max: f32) {
    if let Some(s) = clip_factor(norm, max) {
        grads.iter_mut().for_each(|g| g.iter_mut().for_each(|x| *x *= s));
    }
}

/// What clipping gradients of joint norm `norm` to `max` multiplies them by (none: they are
/// within it).
pub fn clip_factor(norm: f32, max: f32) -> Option<f32> {
    (norm > max && norm > 0.0).then(|| max / norm)
}

/// The first value of the named `tensors` that is not finite, as an [`Error::Diverged`] of step
/// `step` (`what` says whose values they are: "the gradient of", "the value of").
pub fn check_finite<'a>(
    step: u64,
    what: &'static str,
    tensors: impl IntoIterator<Item = (&'a str, &'a [f32])>,
) -> Result<()> {
    for (name, values) in tensors {
        if !all_finite(values) {
            let value = values.iter().copied().find(|v| !v.is_finite()).unwrap_or(f32::NAN);
            return Err(Error::Diverged { step, what, tensor: name.to_string(), value });
        }
    }
    Ok(())
}
