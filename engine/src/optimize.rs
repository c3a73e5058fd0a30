//! The optimizer beside the parameters: the gradients a backward pass leaves in the engine
//! ([`Engine::backward_kept`]) are tested, clipped and applied where they are, with the state of
//! each parameter's rule kept in the engine's own buffers, so a step on a device moves nothing
//! parameter-sized between it and the host. The test and the clipping are the step's gate
//! ([`arbor_core::gate`]), decided on the backend in a block the engines of a model share
//! ([`STEP`], lent by [`Engine::swap_block`]) and read by every update there: a step reads the
//! host nothing until its end.

use crate::launch::{GRADS, PARAMS};
use crate::Engine;
use arbor_core::backend::{Backend, Loc, Mem, OptimAt};
use arbor_core::error::{Error, Result};
use arbor_core::gate::{self, GATE_LEN, SUM_WORDS};
use arbor_core::optim::Update;
use arbor_core::profile::{self, Activity};

/// The engine's buffer of the step's block, lent by the model for its calls
/// ([`Engine::swap_block`]): the gate at word 0 ([`GATE_LEN`] words), partial sums of squares
/// where the model puts them.
pub const STEP: usize = 14;

/// The engine's buffers of optimizer state, laid out as [`PARAMS`]: the first and second state
/// tensor of every parameter's rule (see [`OptimAt`]).
pub const STATE_M: usize = 3;
/// See [`STATE_M`].
pub const STATE_V: usize = 4;

/// A parameter's optimizer state as the host sees it: its two tensors (`m`, `v`).
pub type ParamState = [Vec<f32>; 2];

impl<B: Backend> Engine<B> {
    /// Each parameter's offset and length in [`PARAMS`], [`GRADS`] and the state buffers.
    fn param_spans(&self) -> Vec<(usize, usize)> {
        let f = self.function();
        f.params().iter().zip(&self.lowering.a.param_at).map(|(p, &at)| (at, p.shape.numel())).collect()
    }

    /// Whether the state buffers are allocated (on first use).
    fn has_state(&self) -> bool {
        self.backend.len(&self.bufs[STATE_M]) == self.lowering.a.params_len && self.lowering.a.params_len > 0
    }

    /// The state buffers, allocated (zero) on first use.
    fn ensure_state(&mut self) -> Result<()> {
        if !self.has_state() {
            let total = self.lowering.a.params_len;
            self.bufs[STATE_M] = self.backend.alloc(total)?;
            self.bufs[STATE_V] = self.backend.alloc(total)?;
        }
        Ok(())
    }

    /// Swaps `block` with the engine's [`STEP`] buffer: the model lends its step's block to
    /// each engine for the calls that use it, and takes it back with a second swap. An engine's
    /// updates are gated by the block while it holds one ([`GATE_LEN`] words or more).
    pub fn swap_block(&mut self, block: &mut B::Buffer) {
        std::mem::swap(block, &mut self.bufs[STEP]);
    }

    /// The gate of the lent block, if one is lent.
    pub(super) fn gate(&self) -> Option<Loc> {
        (self.backend.len(&self.bufs[STEP]) >= GATE_LEN).then_some(Loc { buf: STEP, offset: 0 })
    }

    /// Regions [`Engine::sum_grad_squares`] writes: the parameters' gradient, and the held
    /// table's if there is one.
    pub fn grad_regions(&self) -> usize {
        1 + usize::from(self.table_grad_region().is_some())
    }

    /// Writes the partial sums of the squares ([`Backend::sum_squares`]) of every parameter's
    /// gradient as the engine holds it, then of the held table's gradient if any, into the lent
    /// block from word `at` on (even; [`SUM_WORDS`] per region, [`Engine::grad_regions`]
    /// regions): nothing is read back.
    pub fn sum_grad_squares(&mut self, at: usize) -> Result<()> {
        let mut regions = vec![(Loc { buf: GRADS, offset: 0 }, self.lowering.a.params_len)];
        regions.extend(self.table_grad_region());
        let mut mem = Mem { data: &mut self.bufs, index: &self.index };
        self.calls += 1 + regions.len() as u64;
        self.backend.sum_squares(&mut mem, &regions, Loc { buf: STEP, offset: at })
    }

    /// Decides the step's gate in the lent block ([`Backend::decide`]) from the `regions`
    /// regions' partial sums at word `sums`, clipping to norm `clip` (∞: none).
    pub fn decide(&mut self, sums: usize, regions: usize, clip: f32) -> Result<()> {
        let mut mem = Mem { data: &mut self.bufs, index: &self.index };
        self.calls += 1;
        self.backend.decide(&mut mem, Loc { buf: STEP, offset: sums }, regions, clip, Loc { buf: STEP, offset: 0 })
    }

    /// The sums of the squares of every parameter's gradient as the engine holds it and of the
    /// held table's gradient (0 without one), in f64 (not finite exactly where a value is not),
    /// read back: for tests and for naming what is not finite.
    pub fn grad_sum_squares(&mut self) -> Result<(f64, f64)> {
        let mut block = self.backend.alloc(2 * SUM_WORDS)?;
        self.swap_block(&mut block);
        let summed = self.sum_grad_squares(0);
        self.swap_block(&mut block);
        summed?;
        let words = profile::time(Activity::Read, || self.backend.read_vec(&block, 0, 2 * SUM_WORDS))?;
        let sums = gate::region_sums(&words, 2);
        Ok((sums[0], sums[1]))
    }

    /// Multiplies every parameter's gradient as the engine holds it by `s` (clipping).
    pub fn scale_grads(&mut self, s: f32) -> Result<()> {
        let len = self.lowering.a.params_len;
        let mut mem = Mem { data: &mut self.bufs, index: &self.index };
        self.calls += 1;
        self.backend.scale(&mut mem, Loc { buf: GRADS, offset: 0 }, len, s)
    }

    /// Every parameter's gradient as the engine holds it (from the last backward pass, scaled or
    /// replaced since), in the order of `f.params()`.
    pub fn param_grads(&self) -> Result<Vec<Vec<f32>>> {
        self.read_params(GRADS)
    }

    /// Replaces the gradients the engine holds (e.g. by their sum across workers), one per
    /// parameter in the order of `f.params()`.
    pub fn set_grads(&mut self, grads: &[Vec<f32>]) -> Result<()> {
        self.write_params(GRADS, grads, "gradients")
    }

    /// Applies one optimizer update to every parameter from the gradient the engine holds:
    /// `updates[i]` to parameter `i` (`None` leaves it, and its state, as it is), with the state
    /// the engine keeps for each (zeros before its first update; [`Engine::optimizer_state`]).
    /// Neighbouring parameters with the same update are one backend call (what lies between
    /// them in the buffers is zero and stays zero under every rule). Gated by the lent block, if
    /// any ([`Engine::swap_block`]).
    pub fn optimize(&mut self, updates: &[Option<Update>]) -> Result<()> {
        let spans = self.param_spans();
        if updates.len() != spans.len() {
            let f = self.function();
            return Err(Error::input(
                format!("updates of `{}`", f.name()),
                format!("one per parameter ({})", spans.len()),
                format!("{}", updates.len()),
            ));
        }
        self.ensure_state()?;
        self.updated.resize(spans.len(), false);
        // Parameters side by side with the same update run as one call (all of them, usually).
        let mut k = 0;
        while k < spans.len() {
            let Some(u) = updates[k] else {
                k += 1;
                continue;
            };
            // `u` itself counts whatever its values (a NaN is never equal to itself).
            let run = k + 1 + updates[k + 1..].iter().take_while(|x| **x == Some(u)).count();
            let (at, (last, len)) = (spans[k].0, spans[run - 1]);
            let loc = |buf| Loc { buf, offset: at };
            let gate = self.gate();
            let where_ = OptimAt { p: loc(PARAMS), g: loc(GRADS), m: loc(STATE_M), v: loc(STATE_V), gate };
            let mut mem = Mem { data: &mut self.bufs, index: &self.index };
            self.backend.update(&mut mem, &u, &where_, last + len - at)?;
            self.calls += 1;
            self.updated[k..run].fill(true);
            k = run;
        }
        Ok(())
    }

    /// The optimizer state of every parameter [`Engine::optimize`] has updated (`None` for the
    /// others), in the order of `f.params()`: read from the engine's buffers.
    pub fn optimizer_state(&self) -> Result<Vec<Option<ParamState>>> {
        let spans = self.param_spans();
        if !self.has_state() {
            return Ok(vec![None; spans.len()]);
        }
        let read = |buf: usize, (at, len): (usize, usize)| self.backend.read_vec(&self.bufs[buf], at, len);
        spans
            .into_iter()
            .enumerate()
            .map(|(k, span)| match self.updated.get(k) {
                Some(true) => Ok(Some([read(STATE_M, span)?, read(STATE_V, span)?])),
                _ => Ok(None),
            })
            .collect()
    }

    /// Replaces the optimizer state (as [`Engine::optimizer_state`] gives it; `None`: zeros, as
    /// before a first update).
    pub fn set_optimizer_state(&mut self, state: &[Option<ParamState>]) -> Result<()> {
        let spans = self.param_spans();
        if !self.has_state() && state.iter().all(Option::is_none) {
            self.updated.clear();
            return Ok(());
        }
        self.ensure_state()?;
        let zeros = |len| [vec![0.0; len], vec![0.0; len]];
        let full: Vec<ParamState> = spans
            .iter()
            .zip(state.iter().chain(std::iter::repeat(&None)))
            .map(|(&(_, len), s)| s.clone().unwrap_or_else(|| zeros(len)))
            .collect();
        let (m, v): (Vec<Vec<f32>>, Vec<Vec<f32>>) = full.into_iter().map(|[m, v]| (m, v)).unzip();
        self.write_params(STATE_M, &m, "optimizer state")?;
        self.write_params(STATE_V, &v, "optimizer state")?;
        self.updated = (0..spans.len()).map(|k| state.get(k).is_some_and(Option::is_some)).collect();
        Ok(())
    }
}
