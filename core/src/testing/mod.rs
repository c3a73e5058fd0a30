//! Tools for testing a vertex function (feature `testing`): a central-difference gradient check
//! of one vertex through the reference interpreter ([`check_vertex`]), the report and error types
//! every check shares, and [`proptest`](mod@proptest) strategies for input graphs ([`strategy`]).
//!
//! The `arbor` crate's `arbor::testing` re-exports all of this and adds the checks that run the
//! engine: gradients over whole graphs, and a batched minibatch against one graph at a time.
//!
//! ```
//! # use arbor_core as arbor; // as the `arbor` crate re-exports it
//! use arbor::ir::{Builder, Init};
//! use arbor::testing::{check_vertex, VertexCase};
//!
//! let f = Builder::new("elman", 1);
//! let x = f.pull("x", 3);
//! let h = f.gather(0, "h", 4);
//! let w = f.param("W", [3, 4], Init::Xavier);
//! let u = f.param("U", [4, 4], Init::Xavier);
//! let h = (x.matmul(w) + h.matmul(u)).tanh();
//! f.scatter("h", h);
//! f.push("h", h);
//! let f = f.build().unwrap();
//! // One vertex with its child present, and one without.
//! for present in [[true], [false]] {
//!     let report = check_vertex(&f, &VertexCase::random(&f, 7, &present)).unwrap();
//!     assert_eq!(report.params, 3 * 4 + 4 * 4);
//! }
//! ```

pub mod strategy;
mod vertex;

pub use vertex::{check_vertex, VertexCase};

use std::fmt;

/// How close an analytic gradient must be to central differences `(L(x + ε) − L(x − ε)) / 2ε`:
/// `|analytic − numeric| ≤ atol + rtol·|numeric| + noise·S/ε`, where `S = Σ|weight·value|` is the
/// magnitude of the terms of the objective `L` (its f32 rounding grows with it).
///
/// The defaults suit values of order 1 computed in f32: ε cannot be tiny (the rounding of `L`,
/// ≈ 1e-7·S, divided by 2ε must stay small), and the truncation error ε²/6·L''' stays around
/// 2e-5 for bounded nonlinearities. They sit one to two orders of magnitude above the observed
/// finite-difference error and as far below what a wrong derivative (a missing term, a wrong
/// factor, a transposed product) gives on gradients of order 0.1–1. They are ε = 1e-2,
/// atol = 2e-3, rtol = 1e-2 and noise = 1e-6.
///
/// A kink — `abs`, `relu`, a max, a clamp — less than ε from a checked value makes the central
/// difference straddle it, and a correct gradient then fails there (`|h_a − h_b|` of two close
/// rows does). Check such a function with a smaller step (`Tolerance { eps: 1e-3, ..
/// Tolerance::default() }`), or draw its inputs away from the kink.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// The step ε.
    pub eps: f32,
    /// Absolute tolerance.
    pub atol: f64,
    /// Tolerance relative to the numeric gradient.
    pub rtol: f64,
    /// Rounding of `L` per unit of `S`, divided by ε in the bound.
    pub noise: f64,
}

impl Default for Tolerance {
    fn default() -> Tolerance {
        Tolerance { eps: 1e-2, atol: 2e-3, rtol: 1e-2, noise: 1e-6 }
    }
}

impl Tolerance {
    /// The bound for a numeric gradient `numeric` when the objective's terms sum to `scale`.
    pub fn bound(&self, numeric: f64, scale: f64) -> f64 {
        self.atol + self.rtol * numeric.abs() + self.noise * scale / f64::from(self.eps)
    }
}

/// What a gradient check looked at.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GradReport {
    /// Child-state entries checked.
    pub children: usize,
    /// Pulled-input entries checked.
    pub pulls: usize,
    /// Parameter entries checked.
    pub params: usize,
    /// Largest `|analytic − numeric|`.
    pub max_err: f64,
    /// Largest `|analytic − numeric|` relative to its tolerance (at most 1 when the check passes).
    pub worst: f64,
    /// Euclidean norm of all numeric gradients: a check of an all-zero gradient proves little.
    pub norm: f64,
}

/// One value a check found wrong.
#[derive(Clone, Debug, PartialEq)]
pub struct Discrepancy {
    /// What it is, e.g. ``param `W`[3]``, ``pull `x` of vertex 2 [0]``, `output 0 [17]`.
    pub place: String,
    /// What was computed (the analytic gradient, the engine's value).
    pub got: f64,
    /// What it should be (the finite difference, the reference interpreter's value).
    pub want: f64,
}

/// A failed check: what was checked and every value found wrong, the worst first.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// The check and the function, e.g. ``gradients of `tree-lstm` ``.
    pub what: String,
    /// How the values were compared (step, tolerances) or what else went wrong.
    pub detail: String,
    /// The values found wrong, the largest error relative to its tolerance first.
    pub wrong: Vec<Discrepancy>,
    /// How many values were compared.
    pub checked: usize,
}

impl Mismatch {
    /// A failure that is not about values (a shape, an error from the engine).
    pub fn other(what: impl Into<String>, detail: impl Into<String>) -> Mismatch {
        Mismatch { what: what.into(), detail: detail.into(), wrong: Vec::new(), checked: 0 }
    }

    /// Whether some wrong value's place mentions `name` (e.g. a parameter's name in backquotes).
    pub fn names(&self, name: &str) -> bool {
        self.wrong.iter().any(|d| d.place.contains(name))
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.wrong.is_empty() {
            return write!(f, "{}: {}", self.what, self.detail);
        }
        write!(f, "{}: {} of {} values differ ({})", self.what, self.wrong.len(), self.checked, self.detail)?;
        const SHOWN: usize = 12;
        for d in self.wrong.iter().take(SHOWN) {
            write!(f, "\n  {}: got {:.6}, want {:.6} (|diff| {:.2e})", d.place, d.got, d.want, (d.got - d.want).abs())?;
        }
        if self.wrong.len() > SHOWN {
            write!(f, "\n  … and {} more", self.wrong.len() - SHOWN)?;
        }
        Ok(())
    }
}

impl std::error::Error for Mismatch {}

/// Collects the comparisons of one check into a [`Mismatch`] (worst first) or its report.
#[derive(Debug)]
pub struct Comparisons {
    what: String,
    detail: String,
    wrong: Vec<(f64, Discrepancy)>,
    checked: usize,
}

impl Comparisons {
    /// An empty collection for the check `what`, compared as `detail` says.
    pub fn new(what: impl Into<String>, detail: impl Into<String>) -> Comparisons {
        Comparisons { what: what.into(), detail: detail.into(), wrong: Vec::new(), checked: 0 }
    }

    /// Compares `got` with `want` under `bound`; returns `|got − want| / bound` (NaN counts as
    /// wrong). `place` is only formatted for a wrong value.
    pub fn compare(&mut self, place: impl FnOnce() -> String, got: f64, want: f64, bound: f64) -> f64 {
        self.checked += 1;
        let err = (got - want).abs();
        let ratio = err / bound;
        if err.is_nan() || err > bound {
            self.wrong
                .push((if ratio.is_nan() { f64::INFINITY } else { ratio }, Discrepancy { place: place(), got, want }));
        }
        ratio
    }

    /// How many values were compared so far.
    pub fn checked(&self) -> usize {
        self.checked
    }

    /// `Ok(())` when every value agreed, else the [`Mismatch`], worst first.
    pub fn finish(mut self) -> Result<(), Mismatch> {
        if self.wrong.is_empty() {
            return Ok(());
        }
        self.wrong.sort_by(|a, b| b.0.total_cmp(&a.0));
        Err(Mismatch {
            what: self.what,
            detail: self.detail,
            wrong: self.wrong.into_iter().map(|(_, d)| d).collect(),
            checked: self.checked,
        })
    }
}

/// What a checked gradient entry is of, for [`GradReport`]'s counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A child's state.
    Child,
    /// A pulled input (or a word vector).
    Pull,
    /// A parameter.
    Param,
}

/// The comparisons of a gradient check: analytic gradients against central differences under a
/// [`Tolerance`], counted into a [`GradReport`].
#[derive(Debug)]
pub struct GradComparisons {
    cmp: Comparisons,
    report: GradReport,
    squares: f64,
    tol: Tolerance,
    scale: f64,
}

impl GradComparisons {
    /// The check `what` of an objective whose terms sum to `scale` in magnitude.
    pub fn new(what: impl Into<String>, tol: Tolerance, scale: f64) -> GradComparisons {
        let noise = tol.noise * scale / f64::from(tol.eps);
        let detail = format!(
            "analytic against central differences, eps {}, tol {} + {}·|numeric| + {noise:.1e}; a kink \
             (abs, relu, max) within eps of a value misleads them there: see `Tolerance`",
            tol.eps, tol.atol, tol.rtol
        );
        GradComparisons { cmp: Comparisons::new(what, detail), report: GradReport::default(), squares: 0.0, tol, scale }
    }

    /// The points `x ± ε` the objective is evaluated at for an entry whose value is `x`.
    pub fn points(&self, x: f32) -> (f32, f32) {
        (x + self.tol.eps, x - self.tol.eps)
    }

    /// Compares the analytic gradient of one entry with the central difference of the objective
    /// values `at_hi` and `at_lo` at the points `(hi, lo)` ([`GradComparisons::points`]).
    pub fn compare(
        &mut self,
        kind: EntryKind,
        place: impl FnOnce() -> String,
        analytic: f32,
        (hi, lo): (f32, f32),
        (at_hi, at_lo): (f64, f64),
    ) {
        let numeric = (at_hi - at_lo) / f64::from(hi - lo);
        let analytic = f64::from(analytic);
        self.squares += numeric * numeric;
        let r = &mut self.report;
        r.max_err = r.max_err.max((analytic - numeric).abs());
        match kind {
            EntryKind::Child => r.children += 1,
            EntryKind::Pull => r.pulls += 1,
            EntryKind::Param => r.params += 1,
        }
        let ratio = self.cmp.compare(place, analytic, numeric, self.tol.bound(numeric, self.scale));
        r.worst = r.worst.max(ratio);
    }

    /// The report when every entry agreed, else the [`Mismatch`], worst first.
    pub fn finish(self) -> Result<GradReport, Mismatch> {
        let report = GradReport { norm: self.squares.sqrt(), ..self.report };
        self.cmp.finish()?;
        Ok(report)
    }
}

/// Uniform magnitude in `[lo, hi)` with a random sign: inputs stay away from 0 (relu's kink).
pub fn signed(rng: &mut crate::rng::Rng, lo: f32, hi: f32) -> f32 {
    let m = rng.range(lo, hi);
    if rng.below(2) == 0 {
        m
    } else {
        -m
    }
}
