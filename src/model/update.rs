//! How a [`Model`]'s step is applied: the dense gradients tested, clipped and applied in the
//! engines, beside the parameters and the optimizer state they keep (on a device, only the
//! gradients' sums of squares come to the host), the word vectors' rows by the optimizer.

use super::{layer_prefix, Model, ModelGrads};
use crate::checkpoint::Named;
use crate::engine::Engine;
use crate::optim::{check_finite, clip_factor, state_tensors, Optimizer};
use crate::trainer::step::names;
use crate::Backend;
use crate::DropoutKey;
use arbor_core::error::Result;
use arbor_core::profile::{self, Activity};

impl<B: Backend> Model<B> {
    /// The tensor names of every part's parameters: each layer's, then the head's.
    fn part_names(&self) -> Vec<Vec<String>> {
        let layers = self.cells.iter().enumerate().map(|(k, e)| names(&layer_prefix(k), e.function()));
        layers.chain([names("head", self.head.function())]).collect()
    }

    /// Clips the joint norm of `grads` to `clip` if given and applies them with `opt` (see
    /// [`Model::step`]); the next step draws new dropout masks. A step that is not finite ends
    /// training with [`Error::Diverged`](crate::Error::Diverged), or under a [loss scale](Model::with_loss_scale) is
    /// skipped: returns whether the step was applied.
    ///
    /// The dense gradients are tested, clipped and applied in the engines, beside the parameters
    /// and the optimizer state (written there first unless [`ModelGrads::kept`]): on a device,
    /// only their sums of squares come to the host.
    pub fn apply(&mut self, grads: &mut ModelGrads, opt: &mut Optimizer, clip: Option<f32>) -> Result<bool> {
        profile::time(Activity::Update, || self.apply_timed(grads, opt, clip))
    }

    fn apply_timed(&mut self, grads: &mut ModelGrads, opt: &mut Optimizer, clip: Option<f32>) -> Result<bool> {
        // Steps counted from 1 since the start of training (the dropout key counts from 0).
        let step = self.cells[0].dropout_key().step + 1;
        for engine in self.cells.iter_mut().chain(std::iter::once(self.head.engine())) {
            let key = engine.dropout_key();
            engine.set_dropout_key(DropoutKey { step: key.step + 1, ..key });
        }
        let names = self.part_names();
        let mut engines: Vec<&mut Engine<B>> = self.cells.iter_mut().chain([self.head.engine()]).collect();
        if !grads.kept {
            for (engine, g) in engines.iter_mut().zip(grads.cells.iter().chain([&grads.head])) {
                engine.set_grads(g)?;
            }
            engines[0].set_table_grad(&grads.words)?;
        }
        // One read per engine: its parameters' sum of squares, and the bottom one's word vectors'.
        let both = engines.iter_mut().map(|e| e.grad_sum_squares()).collect::<Result<Vec<_>>>()?;
        let sums: Vec<f64> = both.iter().map(|s| s.0).collect();
        let words = both[0].1;
        let all_sums = || sums.iter().copied().chain([words]);
        if let Some(scaler) = &mut self.loss_scale {
            if !scaler.update(all_sums().all(f64::is_finite)) {
                return Ok(false);
            }
        } else if !all_sums().all(f64::is_finite) {
            // The first tensor that is not finite, named with its first such value.
            for ((names, sum), engine) in names.iter().zip(&sums).zip(&engines) {
                if !sum.is_finite() {
                    let g = engine.param_grads()?;
                    check_finite(
                        step,
                        "the gradient of",
                        names.iter().map(String::as_str).zip(g.iter().map(Vec::as_slice)),
                    )?;
                }
            }
            let g = engines[0].held_table_grad()?;
            check_finite(step, "the gradient of", [("embedding", g.values.as_slice())])?;
        }
        if let Some(s) = clip.and_then(|max| clip_factor(all_sums().sum::<f64>().sqrt() as f32, max)) {
            engines.iter_mut().try_for_each(|e| e.scale_grads(s))?;
            engines[0].scale_table_grad(s)?;
        }
        opt.begin_step();
        for (engine, names) in engines.iter_mut().zip(&names) {
            engine.optimize(&names.iter().map(|n| opt.update_of(n)).collect::<Vec<_>>())?;
        }
        engines[0].optimize_table(opt.update_of("embedding"))?;
        Ok(true)
    }

    /// The optimizer state the engines keep beside the parameters they have updated and the
    /// word vectors, named as [`Optimizer::tensors`] names it (`opt.cell.W.m`, `opt.cell.W.v`,
    /// …, `opt.embedding.m`), for a checkpoint.
    pub fn optimizer_tensors(&self) -> Result<Vec<Named>> {
        let mut out: Vec<Named> =
            self.cells[0].table_state()?.into_iter().flat_map(|s| state_tensors("embedding", s)).collect();
        let engines = self.cells.iter().chain([self.head.engine_ref()]);
        for (engine, names) in engines.zip(self.part_names()) {
            for (state, name) in engine.optimizer_state()?.into_iter().zip(names) {
                out.extend(state.into_iter().flat_map(|s| state_tensors(&name, s)));
            }
        }
        Ok(out)
    }

    /// Moves the state of the model's parameters and word vectors from `opt` (as restored from
    /// a checkpoint) into the engines, which update them ([`Model::apply`]).
    pub fn adopt_optimizer_state(&mut self, opt: &mut Optimizer) -> Result<()> {
        if let Some(s) = opt.slots.remove("embedding") {
            self.cells[0].set_table_state(Some(&[s.m, s.v]))?;
        }
        let names = self.part_names();
        let engines = self.cells.iter_mut().chain([self.head.engine()]);
        for (engine, names) in engines.zip(names) {
            let state: Vec<_> = names.iter().map(|n| opt.slots.remove(n).map(|s| [s.m, s.v])).collect();
            engine.set_optimizer_state(&state)?;
        }
        Ok(())
    }
}
