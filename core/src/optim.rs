//! The optimizer's update rules, defined once: the settings ([`Config`]), one step's coefficients
//! for a backend ([`Update`]) and the arithmetic every backend reproduces ([`apply`]). The CPU
//! runs [`apply`] itself; the CUDA backend's kernels repeat it operation for operation (no fused
//! multiply-adds), so both give the same bits.

use crate::error::{Error, Result};

/// Which update rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    /// SGD with momentum (0 for plain SGD); weight decay is added to the gradient.
    Sgd {
        /// Momentum coefficient.
        momentum: f32,
    },
    /// Adagrad; weight decay is added to the gradient.
    Adagrad,
    /// Adam; weight decay is added to the gradient (L2).
    Adam,
    /// AdamW: Adam with decoupled weight decay.
    AdamW,
}

/// Optimizer settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    /// The update rule.
    pub rule: Rule,
    /// Learning rate.
    pub lr: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// Adam's β₁.
    pub beta1: f32,
    /// Adam's β₂.
    pub beta2: f32,
    /// Denominator guard (Adagrad, Adam).
    pub eps: f32,
}

impl Rule {
    /// Whether the rule keeps a second state tensor (`v`: Adam's second moment).
    pub fn uses_v(self) -> bool {
        matches!(self, Rule::Adam | Rule::AdamW)
    }
}

impl Config {
    /// Settings for `rule` at learning rate `lr`, with common defaults for the rest.
    pub fn new(rule: Rule, lr: f32) -> Config {
        Config { rule, lr, weight_decay: 0.0, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }

    /// Refuses settings no update can follow, naming what they are for (`what`, formed only
    /// then): a learning rate or weight decay that is negative or not finite, a momentum, β₁ or
    /// β₂ outside `[0, 1)`, a denominator guard that is not positive and finite.
    pub fn check(&self, what: impl FnOnce() -> String) -> Result<()> {
        let momentum = match self.rule {
            Rule::Sgd { momentum } => momentum,
            _ => 0.0,
        };
        let unit = |x: f32| (0.0..1.0).contains(&x);
        let bad = [
            ("learning rate", self.lr, self.lr.is_finite() && self.lr >= 0.0, "finite and at least 0"),
            (
                "weight decay",
                self.weight_decay,
                self.weight_decay.is_finite() && self.weight_decay >= 0.0,
                "finite and at least 0",
            ),
            ("momentum", momentum, unit(momentum), "in [0, 1)"),
            ("β₁", self.beta1, unit(self.beta1), "in [0, 1)"),
            ("β₂", self.beta2, unit(self.beta2), "in [0, 1)"),
            ("eps", self.eps, self.eps.is_finite() && self.eps > 0.0, "finite and above 0"),
        ];
        match bad.iter().find(|(.., ok, _)| !ok) {
            Some((name, value, _, expected)) => {
                Err(Error::input(format!("{name} of {}", what()), *expected, value.to_string()))
            }
            None => Ok(()),
        }
    }
}

/// One tensor's update at one step: its settings and Adam's bias corrections for the step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Update {
    /// The settings (the tensor's own learning rate already in `lr`).
    pub config: Config,
    /// `1 − β₁ᵗ`.
    pub bc1: f32,
    /// `1 − β₂ᵗ`.
    pub bc2: f32,
}

impl Update {
    /// The update with `config` at step `t` (counted from 1).
    pub fn new(config: Config, t: u64) -> Update {
        let t = t.clamp(1, i32::MAX as u64) as i32;
        Update { config, bc1: 1.0 - config.beta1.powi(t), bc2: 1.0 - config.beta2.powi(t) }
    }

    /// The rule as the CUDA kernels number it: 0 SGD, 1 Adagrad, 2 Adam, 3 AdamW.
    pub fn rule_code(&self) -> i32 {
        match self.config.rule {
            Rule::Sgd { .. } => 0,
            Rule::Adagrad => 1,
            Rule::Adam => 2,
            Rule::AdamW => 3,
        }
    }

    /// Whether the rule keeps a second state tensor ([`Rule::uses_v`]).
    pub fn uses_v(&self) -> bool {
        self.config.rule.uses_v()
    }

    /// SGD's momentum (0 for the other rules).
    pub fn momentum(&self) -> f32 {
        match self.config.rule {
            Rule::Sgd { momentum } => momentum,
            _ => 0.0,
        }
    }
}

/// Applies `u` to the values `p` with gradient `g` and state `m` (momentum, Adagrad's sum of
/// squares, Adam's first moment) and `v` (Adam's second moment), element by element.
#[inline(always)]
pub fn apply(u: &Update, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let c = u.config;
    match c.rule {
        Rule::Sgd { momentum } => {
            for ((p, &g), m) in p.iter_mut().zip(g).zip(m) {
                let g = g + c.weight_decay * *p;
                *m = momentum * *m + g;
                *p -= c.lr * *m;
            }
        }
        Rule::Adagrad => {
            for ((p, &g), m) in p.iter_mut().zip(g).zip(m) {
                let g = g + c.weight_decay * *p;
                *m += g * g;
                *p -= c.lr * g / (m.sqrt() + c.eps);
            }
        }
        Rule::Adam | Rule::AdamW => {
            let (b1, b2) = (c.beta1, c.beta2);
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                let g = if c.rule == Rule::Adam { g + c.weight_decay * *p } else { g };
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let step = (*m / u.bc1) / ((*v / u.bc2).sqrt() + c.eps);
                if c.rule == Rule::AdamW {
                    *p -= c.lr * c.weight_decay * *p;
                }
                *p -= c.lr * step;
            }
        }
    }
}

/// Moves the weight average `avg` `1 − keep` of the way to the values `x`, element by element:
/// `avg += (1 − keep)·(x − avg)` (a multiply and an add, never fused), the rule of every
/// backend's [`Backend::average`](crate::backend::Backend::average).
#[inline(always)]
pub fn average(avg: &mut [f32], x: &[f32], keep: f32) {
    let step = 1.0 - keep;
    for (a, &x) in avg.iter_mut().zip(x) {
        *a += step * (x - *a);
    }
}

/// The sum of the squares of `x` in f64: finite exactly when every value is (a finite f32
/// squared is below 2²⁵⁶, so no sum of fewer than 2⁷⁶⁸ of them overflows), so one pass gives both
/// a gradient norm and its finiteness test. Element `i` goes into running sum `i % 16`, and the
/// sixteen are added in a fixed tree: independent chains a vector unit runs side by side, the
/// same bits on every instruction set.
#[inline(always)]
pub fn sum_squares(x: &[f32]) -> f64 {
    const LANES: usize = 16;
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v) * f64::from(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(rest) {
        *a += f64::from(v) * f64::from(v);
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_no_update_can_follow_are_refused() {
        assert!(Config::new(Rule::Adam, 0.01).check(|| "the optimizer".into()).is_ok());
        let nan = Config::new(Rule::Adam, f32::NAN).check(|| "the optimizer".into()).unwrap_err().to_string();
        assert!(nan.contains("learning rate of the optimizer") && nan.contains("NaN"), "{nan}");
        let decay =
            Config { weight_decay: -1.0, ..Config::new(Rule::Adagrad, 0.1) }.check(|| "`cell.W`".into()).unwrap_err();
        assert!(decay.to_string().contains("weight decay of `cell.W`"), "{decay}");
        assert!(Config::new(Rule::Sgd { momentum: 1.0 }, 0.1).check(|| "x".into()).is_err());
        assert!(Config { beta2: 1.0, ..Config::new(Rule::Adam, 0.1) }.check(|| "x".into()).is_err());
        assert!(Config { eps: 0.0, ..Config::new(Rule::Adam, 0.1) }.check(|| "x".into()).is_err());
        assert!(Config::new(Rule::Sgd { momentum: 0.0 }, f32::INFINITY).check(|| "x".into()).is_err());
    }

    #[test]
    fn bias_corrections_follow_the_step() {
        let u = Update::new(Config::new(Rule::Adam, 0.1), 2);
        assert_eq!((u.bc1, u.bc2), (1.0 - 0.9f32 * 0.9, 1.0 - 0.999f32 * 0.999));
        assert_eq!(Update::new(Config::new(Rule::Adam, 0.1), 0), Update::new(Config::new(Rule::Adam, 0.1), 1));
        assert_eq!(Update::new(Config::new(Rule::Sgd { momentum: 0.5 }, 0.1), 1).momentum(), 0.5);
    }

    #[test]
    fn one_step_of_each_rule() {
        let step = |rule, wd: f32| {
            let u = Update::new(Config { weight_decay: wd, ..Config::new(rule, 0.5) }, 1);
            let (mut p, mut m, mut v) = ([1.0f32], [0.0f32], [0.0f32]);
            apply(&u, &mut p, &[2.0], &mut m, &mut v);
            p[0]
        };
        assert_eq!(step(Rule::Sgd { momentum: 0.9 }, 0.0), 0.0);
        assert_eq!(step(Rule::Sgd { momentum: 0.0 }, 1.0), -0.5);
        assert!((step(Rule::Adagrad, 0.0) - 0.5).abs() < 1e-6);
        // Adam's first step moves every value by about lr.
        assert!((step(Rule::Adam, 0.0) - 0.5).abs() < 1e-6);
        assert!((step(Rule::AdamW, 0.1) - 0.45).abs() < 1e-6);
    }

    #[test]
    fn sixteen_running_sums_added_in_a_fixed_tree() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let mut lanes = [0.0f64; 16];
        for (i, &v) in x.iter().enumerate() {
            lanes[i % 16] += f64::from(v) * f64::from(v);
        }
        for w in [8, 4, 2, 1] {
            for i in 0..w {
                lanes[i] += lanes[i + w];
            }
        }
        assert_eq!(sum_squares(&x).to_bits(), lanes[0].to_bits());
        let naive: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        assert!((sum_squares(&x) - naive).abs() <= 1e-12 * naive);
    }

    #[test]
    fn a_value_that_is_not_finite_makes_the_sum_not_finite() {
        assert_eq!(sum_squares(&[3.0, 4.0]), 25.0);
        assert!(sum_squares(&[f32::MAX; 1000]).is_finite());
        assert!(!sum_squares(&[1.0, f32::NAN]).is_finite());
        assert!(!sum_squares(&[f32::NEG_INFINITY]).is_finite());
    }
}
