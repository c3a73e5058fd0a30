//! How a [`Model`]'s step is applied: the dense gradients tested, clipped and applied in the
//! engines, beside the parameters and the optimizer state they keep, the word vectors' rows
//! beside the table; the test and the clipping decided on the backend (on a device, one small
//! read a step: the gate, with the head's outputs).

use super::{layer_prefix, Model, ModelGrads};
use crate::checkpoint::Named;
use crate::engine::Engine;
use crate::optim::{check_finite, state_tensors, Optimizer};
use crate::trainer::step::names;
use crate::Backend;
use crate::DropoutKey;
use arbor_core::error::{Error, Result};
use arbor_core::gate::{self, GATE_LEN, SUM_WORDS};
use arbor_core::profile::{self, Activity};

/// Runs `f` on `engine` with the step's `block` lent to it ([`Engine::swap_block`]), taken back
/// after, whatever `f` returns.
fn lent<B: Backend>(
    engine: &mut Engine<B>,
    block: &mut B::Buffer,
    f: impl FnOnce(&mut Engine<B>) -> Result<()>,
) -> Result<()> {
    engine.swap_block(block);
    let done = f(engine);
    engine.swap_block(block);
    done
}

impl<B: Backend> Model<B> {
    /// The tensor names of every part's parameters: each layer's, then the head's.
    fn part_names(&self) -> Vec<Vec<String>> {
        let layers = self.cells.iter().enumerate().map(|(k, e)| names(&layer_prefix(k), e.function()));
        layers.chain([names("head", self.head.function())]).collect()
    }

    /// Clips the joint norm of `grads` to `clip` if given and applies them with `opt` (see
    /// [`Model::step`]); the next step draws new dropout masks. A step that is not finite ends
    /// training with [`Error::Diverged`], or under a [loss scale](Model::with_loss_scale) is
    /// skipped: returns whether the step was applied.
    ///
    /// The dense gradients are tested, clipped and applied in the engines, beside the parameters
    /// and the optimizer state (written there first unless [`ModelGrads::kept`]): the test and
    /// the clipping factor are decided on the backend ([`arbor_core::gate`]) and the updates
    /// read them there, so a step reads the backend once, at the end: the gate and, where
    /// [`ModelGrads::outputs_kept`], the head's outputs (then in `grads.outputs`).
    pub fn apply(&mut self, grads: &mut ModelGrads, opt: &mut Optimizer, clip: Option<f32>) -> Result<bool> {
        profile::time(Activity::Update, || self.apply_timed(grads, opt, clip))
    }

    fn apply_timed(&mut self, grads: &mut ModelGrads, opt: &mut Optimizer, clip: Option<f32>) -> Result<bool> {
        opt.check()?;
        // Steps counted from 1 since the start of training (the dropout key counts from 0).
        let step = self.cells[0].dropout_key().step + 1;
        for engine in self.cells.iter_mut().chain(std::iter::once(self.head.engine())) {
            let key = engine.dropout_key();
            engine.set_dropout_key(DropoutKey { step: key.step + 1, ..key });
        }
        let names = self.part_names();
        let outputs = if grads.outputs_kept { self.head.engine().kept_len() } else { 0 };
        let kept_block = self.block.take();
        let mut engines: Vec<&mut Engine<B>> = self.cells.iter_mut().chain([self.head.engine()]).collect();
        if !grads.kept {
            for (engine, g) in engines.iter_mut().zip(grads.cells.iter().chain([&grads.head])) {
                engine.set_grads(g)?;
            }
            engines[0].set_table_grad(&grads.words)?;
        }
        // The step's block: the gate, the head's outputs if they are still on the backend, then
        // every engine's partial sums of squares (its parameters', the bottom one's word vectors').
        let sums_at = GATE_LEN + outputs + outputs % 2;
        let regions: usize = engines.iter().map(|e| e.grad_regions()).sum();
        let len = sums_at + regions * SUM_WORDS;
        let backend = engines[0].backend();
        let mut block = match kept_block {
            Some(b) if backend.len(&b) >= len => b,
            _ => backend.alloc(len.next_power_of_two())?,
        };
        let mut at = sums_at;
        for engine in engines.iter_mut() {
            let (written, regions) = (at, engine.grad_regions());
            lent(engine, &mut block, |e| e.sum_grad_squares(written))?;
            at += regions * SUM_WORDS;
        }
        let clip = clip.unwrap_or(f32::INFINITY);
        lent(engines.last_mut().expect("the head's engine"), &mut block, |head| {
            head.decide(sums_at, regions, clip)?;
            if outputs > 0 {
                head.copy_kept_outputs(GATE_LEN)?;
            }
            Ok(())
        })?;
        opt.begin_step();
        for (k, (engine, names)) in engines.iter_mut().zip(&names).enumerate() {
            lent(engine, &mut block, |e| {
                e.optimize(&names.iter().map(|n| opt.update_of(n)).collect::<Vec<_>>())?;
                if k == 0 {
                    e.optimize_table(opt.update_of("embedding"))?;
                }
                Ok(())
            })?;
        }
        // The step's one read.
        let backend = engines[0].backend();
        let read = profile::time(Activity::Read, || backend.read_vec(&block, 0, GATE_LEN + outputs))?;
        self.block = Some(block);
        if grads.outputs_kept {
            grads.outputs = self.head.engine_ref().unpack_kept(&read[GATE_LEN..]);
            grads.outputs_kept = false;
        }
        let applied = gate::applies(&read);
        if !applied {
            opt.cancel_step();
        }
        match &mut self.loss_scale {
            Some(scaler) => Ok(scaler.update(applied)),
            None if applied => Ok(true),
            None => Err(self.first_not_finite(step, &names)?),
        }
    }

    /// The error that names the first gradient that is not finite (of the parameters in order
    /// of `names`, then the word vectors').
    fn first_not_finite(&mut self, step: u64, names: &[Vec<String>]) -> Result<Error> {
        let engines = self.cells.iter_mut().chain([self.head.engine()]);
        for (engine, names) in engines.zip(names) {
            if !engine.grad_sum_squares()?.0.is_finite() {
                let g = engine.param_grads()?;
                let named = names.iter().map(String::as_str).zip(g.iter().map(Vec::as_slice));
                if let Err(e) = check_finite(step, "the gradient of", named) {
                    return Ok(e);
                }
            }
        }
        let g = self.cells[0].held_table_grad()?;
        match check_finite(step, "the gradient of", [("embedding", g.values.as_slice())]) {
            Err(e) => Ok(e),
            Ok(()) => {
                Ok(Error::Diverged { step, what: "the gradient of", tensor: "a parameter".into(), value: f32::NAN })
            }
        }
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
