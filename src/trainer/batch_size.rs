//! `--batch auto`: the minibatch size chosen as training goes, as Pollux (Qiao et al., OSDI
//! 2021) chooses it — for the most *goodput*, throughput times statistical efficiency.
//!
//! - **The gradient noise scale** `B_noise = tr(Σ)/|G|²` (McCandlish et al. 2018, appendix A)
//!   is estimated from the gradients of two micro-batches of a minibatch ([`Noise`], measured
//!   every [`MEASURE_EVERY`] steps): `E|g_b|² = |G|² + tr(Σ)/b` at the micro-batches' size and
//!   at the minibatch's gives both terms, each smoothed by a moving average before their ratio
//!   is taken.
//! - **Statistical efficiency** of a batch of `M` examples against the base batch `M₀` (the
//!   one the learning rate was set for): `E(M) = (B_noise + M₀)/(B_noise + M)`, the progress
//!   an example makes at `M` relative to `M₀`.
//! - **Throughput** from the step-time model `a + b·M` (seconds a step: `a` a pass, `b` an
//!   example; measured once before training and kept in the checkpoint, so a resumed run
//!   decides as the uninterrupted one did): `T(M) = M/(a + b·M)`.
//! - The goodput `T(M)·E(M)` is largest at `M* = √(B_noise·a/b)`; every [`AutoBatch::every`]
//!   steps the batch moves towards it, by at most a factor of 2, within `[min, max]`.
//! - **The learning rate** follows the square-root rule, `lr·√(M/M₀)`, for every optimizer
//!   (Pollux's choice for Adam; AdaScale's gain, its choice for SGD, is not built).

use arbor_core::error::{Error, Result};
use serde_json::{json, Value};

/// Steps between two measurements of the gradient noise (each runs the minibatch as two
/// micro-batches).
pub const MEASURE_EVERY: u64 = 4;

/// Weight of the newest measurement in the moving averages of the noise's two terms.
const NEWEST: f64 = 0.1;

/// Measurements before the first decision.
const WARM: u32 = 4;

/// The settings of `--batch auto`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AutoBatch {
    /// The base batch `M₀`: the first one, and the one the learning rate is set for.
    pub base: usize,
    /// The smallest and largest batch it may choose.
    pub min: usize,
    /// See `min`.
    pub max: usize,
    /// Seconds a step costs besides its examples (`a`).
    pub pass_seconds: f64,
    /// Seconds a step costs per example (`b`).
    pub example_seconds: f64,
    /// Steps between decisions.
    pub every: u64,
}

impl AutoBatch {
    /// Checks the settings: `1 ≤ min ≤ base ≤ max`, a decision every step or more seldom, and
    /// step times that are finite and not negative.
    pub fn check(&self) -> Result<()> {
        let times = [self.pass_seconds, self.example_seconds];
        if self.min == 0 || self.min > self.base || self.base > self.max || self.every == 0 {
            let got = format!("min {}, base {}, max {}, every {}", self.min, self.base, self.max, self.every);
            return Err(Error::input(
                "an automatic batch size",
                "1 ≤ min ≤ base ≤ max and a decision every ≥ 1 steps",
                got,
            ));
        }
        if times.iter().any(|t| !(t.is_finite() && *t >= 0.0)) {
            let got = format!("{} s a step and {} s an example", self.pass_seconds, self.example_seconds);
            return Err(Error::input("an automatic batch size's step times", "finite seconds, 0 or more", got));
        }
        Ok(())
    }

    /// The settings a checkpoint's metadata `meta` records of an automatic batch size (its
    /// step-time model among them), if it has them and they hold: what a resumed run goes on
    /// with, so it need not time a step again.
    pub fn recorded(meta: &Value) -> Option<AutoBatch> {
        AutoBatch::from_json(&meta["batch_size"]["settings"])
    }

    /// As [`AutoBatch::to_json`] wrote it, if the settings hold.
    fn from_json(s: &Value) -> Option<AutoBatch> {
        let count = |v: &Value| v.as_u64().map(|n| n as usize);
        let auto = AutoBatch {
            base: count(&s["base"])?,
            min: count(&s["min"])?,
            max: count(&s["max"])?,
            pass_seconds: s["pass_seconds"].as_f64()?,
            example_seconds: s["example_seconds"].as_f64()?,
            every: s["every"].as_u64()?,
        };
        auto.check().ok().map(|()| auto)
    }

    /// As a checkpoint records it.
    fn to_json(self) -> Value {
        json!({
            "base": self.base, "min": self.min, "max": self.max, "pass_seconds": self.pass_seconds,
            "example_seconds": self.example_seconds, "every": self.every,
        })
    }
}

/// One measurement of the gradient noise: squared gradient norms at two batch sizes (in loss
/// terms: what each example's loss sums over, as a model counts them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Noise {
    /// The mean over the micro-batches of their mean gradient's squared norm.
    pub small: f64,
    /// The mean over the micro-batches of `1/terms` (the harmonic size of a micro-batch).
    pub inv_small: f64,
    /// The minibatch's mean gradient's squared norm.
    pub big: f64,
    /// Loss terms in the minibatch.
    pub terms: f64,
    /// Examples in the minibatch.
    pub examples: f64,
}

impl Noise {
    /// The two terms `(|G|², tr(Σ))` this measurement estimates, per loss term; `None` where
    /// its two sizes coincide.
    fn terms(&self) -> Option<(f64, f64)> {
        let gap = self.inv_small - 1.0 / self.terms;
        if gap.is_nan() || gap <= 0.0 || !self.small.is_finite() || !self.big.is_finite() {
            return None;
        }
        let trace = (self.small - self.big) / gap;
        Some((self.big - trace / self.terms, trace))
    }
}

/// Where an automatic batch size stands: its settings, the noise measured so far, the batch
/// chosen and every change (kept in checkpoints; a resumed run goes on from it).
#[derive(Clone, Debug, PartialEq)]
pub struct BatchSize {
    /// The settings.
    pub auto: AutoBatch,
    /// The batch now.
    pub batch: usize,
    /// Moving averages of `|G|²` and `tr(Σ)` (per loss term), and of loss terms per example.
    grad: f64,
    trace: f64,
    terms_per_example: f64,
    /// Measurements taken.
    measured: u32,
    /// `(step, batch)` at the start and at every change.
    pub trajectory: Vec<(u64, usize)>,
}

impl BatchSize {
    /// A run's batch size at the start of training, at `auto.base`.
    pub fn new(auto: AutoBatch) -> BatchSize {
        let batch = auto.base.clamp(auto.min.max(1), auto.max.max(1));
        BatchSize {
            auto,
            batch,
            grad: 0.0,
            trace: 0.0,
            terms_per_example: 1.0,
            measured: 0,
            trajectory: vec![(0, batch)],
        }
    }

    /// The learning-rate factor of the batch now (the square-root rule).
    pub fn lr_factor(&self) -> f32 {
        (self.batch as f64 / self.auto.base.max(1) as f64).sqrt() as f32
    }

    /// The gradient noise scale in examples, once measured.
    pub fn noise_scale(&self) -> Option<f64> {
        let b = self.trace / self.grad / self.terms_per_example;
        (self.measured > 0 && b.is_finite() && b > 0.0).then_some(b)
    }

    /// Takes in one measurement.
    pub fn observe(&mut self, noise: &Noise) {
        let Some((grad, trace)) = noise.terms() else { return };
        let blend = |old: f64, x: f64, first: bool| if first { x } else { NEWEST * x + (1.0 - NEWEST) * old };
        let first = self.measured == 0;
        self.grad = blend(self.grad, grad, first);
        self.trace = blend(self.trace, trace, first);
        self.terms_per_example = blend(self.terms_per_example, noise.terms / noise.examples.max(1.0), first);
        self.measured += 1;
    }

    /// The batch of the most goodput now, within a factor of 2 of the current one and the
    /// bounds (the current one before enough measurements).
    pub fn best(&self) -> usize {
        let (Some(noise), true) = (self.noise_scale(), self.measured >= WARM) else { return self.batch };
        let a = self.auto;
        let ideal =
            if a.example_seconds > 0.0 { (noise * a.pass_seconds / a.example_seconds).sqrt() } else { f64::MAX };
        let near = ideal.clamp(self.batch as f64 / 2.0, self.batch as f64 * 2.0);
        (near.round() as usize).clamp(a.min.max(1), a.max.max(1))
    }

    /// After `steps` steps: where a decision is due, moves to [`BatchSize::best`]; whether the
    /// batch changed.
    pub fn decide(&mut self, steps: u64) -> bool {
        if self.auto.every == 0 || !steps.is_multiple_of(self.auto.every) {
            return false;
        }
        let best = self.best();
        if best == self.batch {
            return false;
        }
        self.batch = best;
        self.trajectory.push((steps, best));
        true
    }

    /// As a checkpoint records it.
    pub(crate) fn to_json(&self) -> Value {
        json!({
            "settings": self.auto.to_json(), "batch": self.batch, "grad": self.grad, "trace": self.trace,
            "terms_per_example": self.terms_per_example, "measured": self.measured, "trajectory": self.trajectory,
        })
    }

    /// As a checkpoint recorded it; `None` for a checkpoint without one, or with settings that
    /// do not hold ([`AutoBatch::check`]): the run then starts afresh at the base.
    pub(crate) fn from_json(v: &Value) -> Option<BatchSize> {
        let count = |v: &Value| v.as_u64().map(|n| n as usize);
        let auto = AutoBatch::from_json(&v["settings"])?;
        let trajectory = v["trajectory"]
            .as_array()?
            .iter()
            .map(|p| Some((p[0].as_u64()?, count(&p[1])?)))
            .collect::<Option<Vec<_>>>()?;
        Some(BatchSize {
            auto,
            batch: count(&v["batch"]).filter(|&b| b > 0)?,
            grad: v["grad"].as_f64()?,
            trace: v["trace"].as_f64()?,
            terms_per_example: v["terms_per_example"].as_f64()?,
            measured: v["measured"].as_u64()? as u32,
            trajectory,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auto() -> AutoBatch {
        AutoBatch { base: 32, min: 4, max: 512, pass_seconds: 2e-3, example_seconds: 2e-4, every: 10 }
    }

    /// A measurement of a gradient with `|G|² = g` and `tr(Σ) = s` per term, without sampling
    /// noise: micro-batches of `b` terms, a minibatch of `2b`, one term an example.
    fn exact(g: f64, s: f64, b: f64) -> Noise {
        Noise { small: g + s / b, inv_small: 1.0 / b, big: g + s / (2.0 * b), terms: 2.0 * b, examples: 2.0 * b }
    }

    /// A batch size that has measured `|G|² = g`, `tr(Σ) = s` enough times to decide.
    fn warmed(g: f64, s: f64) -> BatchSize {
        let mut b = BatchSize::new(auto());
        for _ in 0..WARM {
            b.observe(&exact(g, s, 16.0));
        }
        b
    }

    #[test]
    fn the_noise_scale_is_recovered_from_two_sizes() {
        let mut b = BatchSize::new(auto());
        b.observe(&exact(0.5, 100.0, 16.0));
        let scale = b.noise_scale().expect("measured");
        assert!((scale - 200.0).abs() < 1e-9, "{scale}");
        // A measurement whose two sizes coincide says nothing.
        b.observe(&Noise { inv_small: 1.0 / 32.0, ..exact(0.5, 100.0, 16.0) });
        assert_eq!(b.measured, 1);
    }

    #[test]
    fn the_batch_moves_towards_the_goodput_optimum_by_at_most_two() {
        // Noise scale 2,000 examples, a/b = 10: the optimum is √20,000 ≈ 141.
        let mut b = warmed(0.05, 100.0);
        assert!(!b.decide(5), "not a decision step");
        assert!(b.decide(10));
        assert_eq!(b.batch, 64, "at most twice the batch");
        assert!(b.decide(20));
        assert_eq!(b.batch, 128);
        assert!(b.decide(30));
        assert_eq!(b.batch, 141);
        assert!(!b.decide(40), "at the optimum");
        assert_eq!(b.trajectory, vec![(0, 32), (10, 64), (20, 128), (30, 141)]);
        assert!((b.lr_factor() - (141.0f32 / 32.0).sqrt()).abs() < 1e-6);
        // A small noise scale shrinks it, to the bound at most.
        let mut small = warmed(1.0, 1.0);
        for k in 1..=4 {
            small.decide(10 * k);
        }
        assert_eq!(small.batch, 4, "{:?}", small.trajectory);
    }

    #[test]
    fn settings_that_cannot_hold_are_refused() {
        assert!(auto().check().is_ok());
        for bad in [
            AutoBatch { min: 0, ..auto() },
            AutoBatch { min: 40, ..auto() },
            AutoBatch { max: 16, ..auto() },
            AutoBatch { every: 0, ..auto() },
            AutoBatch { pass_seconds: f64::NAN, ..auto() },
            AutoBatch { example_seconds: -1.0, ..auto() },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn no_decision_before_enough_measurements() {
        let mut b = BatchSize::new(auto());
        b.observe(&exact(0.05, 100.0, 16.0));
        assert!(!b.decide(10));
        assert_eq!(b.batch, 32);
    }

    #[test]
    fn a_checkpoint_keeps_it_whole() {
        let mut b = warmed(0.05, 100.0);
        b.decide(10);
        assert_eq!(BatchSize::from_json(&b.to_json()), Some(b));
        assert_eq!(BatchSize::from_json(&json!(null)), None);
    }
}
