//! The gradient check of a cell over whole graphs, through the engine.

use super::{random_params, uniform_rows, EntryKind, GradComparisons, GradReport, Mismatch, Tolerance};
use crate::dropout::DropoutKey;
use crate::engine::Pass;
use crate::graph::{InputGraph, NO_CHILD};
use crate::ir::VertexFn;
use crate::rng::Rng;
use crate::{CpuBackend, Engine, Pull};
use arbor_core::testing::{check_vertex, signed, VertexCase};

/// What [`check_gradients`] draws and how it compares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradCheck {
    /// Seed of the parameters, the pulled rows, the objective's weights, the dropout masks and
    /// the entries sampled.
    pub seed: u64,
    /// Finite-difference step and tolerances.
    pub tolerance: Tolerance,
    /// At most this many entries of each parameter and of each pulled input are checked (a
    /// random sample of larger ones): each costs two forward passes.
    pub max_entries: usize,
}

impl Default for GradCheck {
    fn default() -> GradCheck {
        GradCheck { seed: 1, tolerance: Tolerance::default(), max_entries: 64 }
    }
}

/// One entry a gradient is checked for.
#[derive(Clone, Copy)]
enum Target {
    Param { param: usize, e: usize },
    Pull { input: usize, e: usize },
}

/// Checks the gradients arbor derives for `f` against central differences, over the minibatch
/// `graphs` on the CPU backend: with random parameters (the initialisers' values moved by up to
/// ±0.1), pulled rows of magnitude 0.1–1 and the objective `L = Σ ⟨w, pushed⟩` over every
/// pushed output of every vertex (random weights `w` in `[-1, 1)`), the engine's backward pass
/// must give `∂L/∂θ` for every parameter entry and `∂L/∂x` for every pulled entry (up to
/// [`GradCheck::max_entries`] of each, sampled) within the [`Tolerance`]. Dropout masks are
/// drawn once and held fixed.
///
/// This checks the whole path a cell's gradient takes — the symbolic derivative, the fused
/// kernels, the batching of vertices and the sums over them — where [`check_vertex`] checks one
/// vertex through the reference interpreter. A [`Mismatch`] names each wrong entry, the worst
/// first: ``param `U`[1, 3]`` (row, column), ``pull `x`[vertex 4, 2]``.
///
/// When values differ, the check localizes: it re-checks one vertex at a time with
/// [`check_vertex`] (through the reference interpreter), one of each kind of vertex in `graphs`
/// (which child slots hold a child, or how many children), and its detail names the first
/// vertex whose own derivative is wrong and its wrong entries (``child 0 state `h`[1]``) — or
/// says that every kind of vertex checks alone, so the batching, a fused kernel or a sum over
/// vertices is what differs.
///
/// First, though, a failed check is run again at a step ten and a hundred times smaller: where
/// it passes there, its detail says so — a kink (`relu`, a max, `abs`, a clamp) within ε of a
/// checked value, which a correct derivative fails at, not a wrong derivative, which fails at
/// any step.
///
/// [`check_vertex`]: super::check_vertex
pub fn check_gradients(f: &VertexFn, graphs: &[InputGraph], opts: &GradCheck) -> Result<GradReport, Mismatch> {
    if graphs.iter().all(InputGraph::is_empty) {
        let what = format!("gradients of `{}`", f.name());
        return Err(Mismatch::other(what, "no vertex to check: give at least one graph with a vertex"));
    }
    check_whole(f, graphs, opts).map_err(|m| {
        if m.wrong.is_empty() {
            return m;
        }
        kink_or(m, opts, |finer| check_whole(f, graphs, finer).is_ok(), |m| localize(f, graphs, opts, m))
    })
}

/// `m`, a check failed under `opts`, with its detail saying so where `passes` at a step ten or
/// a hundred times smaller (a kink within ε of a checked value), else `otherwise(m)`.
pub(crate) fn kink_or(
    mut m: Mismatch,
    opts: &GradCheck,
    mut passes: impl FnMut(&GradCheck) -> bool,
    otherwise: impl FnOnce(Mismatch) -> Mismatch,
) -> Mismatch {
    let eps = opts.tolerance.eps;
    for finer in [eps / 10.0, eps / 100.0] {
        if passes(&GradCheck { tolerance: Tolerance { eps: finer, ..opts.tolerance }, ..*opts }) {
            m.detail += &format!(
                "; every value checks at ε = {finer:e}: so a kink lies within ε = {eps:e} of a checked value, not a \
                 wrong derivative (check such a function at that step, `Tolerance::eps`)"
            );
            return m;
        }
    }
    otherwise(m)
}

/// Adds to `m` (a failed [`check_gradients`]) the first kind of vertex of `graphs` whose own
/// derivative fails [`check_vertex`](super::check_vertex), in minibatch order, or that none does.
fn localize(f: &VertexFn, graphs: &[InputGraph], opts: &GradCheck, mut m: Mismatch) -> Mismatch {
    let mut seen: Vec<Vec<bool>> = Vec::new();
    let mut vertex = 0;
    for g in graphs {
        for v in 0..g.len() {
            let children = g.children(v);
            let present: Vec<bool> = match f.max_children() {
                None => vec![true; children.iter().filter(|&&c| c != NO_CHILD).count()],
                Some(arity) => (0..arity).map(|s| children.get(s).is_some_and(|&c| c != NO_CHILD)).collect(),
            };
            if !seen.contains(&present) {
                let case = VertexCase::random(f, opts.seed.wrapping_add(vertex as u64), &present);
                if let Err(alone) = check_vertex(f, &case) {
                    let first: Vec<String> = alone.wrong.iter().take(3).map(|d| d.place.clone()).collect();
                    m.detail += &format!(
                        "; localized: vertex {vertex} of the minibatch (children {present:?}) fails alone \
                         (check_vertex): {} of {} values, first {}",
                        alone.wrong.len(),
                        alone.checked,
                        if first.is_empty() { alone.detail } else { first.join(", ") }
                    );
                    return m;
                }
                seen.push(present);
            }
            vertex += 1;
        }
    }
    m.detail += "; every kind of vertex checks alone (check_vertex): the batching, a fused kernel or a sum over \
                 vertices differs";
    m
}

/// [`check_gradients`] before it localizes.
fn check_whole(f: &VertexFn, graphs: &[InputGraph], opts: &GradCheck) -> Result<GradReport, Mismatch> {
    let what = format!("gradients of `{}` over {} graphs", f.name(), graphs.len());
    let fail = |e: crate::Error| Mismatch::other(what.clone(), e.to_string());
    let mut rng = Rng::new(opts.seed);
    let mut params = random_params(f, &mut rng);
    let n: usize = graphs.iter().map(InputGraph::len).sum();
    let mut pulls: Vec<Vec<f32>> =
        f.inputs().iter().map(|p| (0..n * p.shape.numel()).map(|_| signed(&mut rng, 0.1, 1.0)).collect()).collect();
    let weights: Vec<Vec<f32>> = f.outputs().iter().map(|o| uniform_rows(&mut rng, n * o.shape.numel())).collect();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let mut engine = Engine::new(CpuBackend::new(), f.clone(), &params).map_err(fail)?;
    engine.set_dropout_key(DropoutKey { seed: opts.seed, step: 1, first: 0 });

    // L and the magnitude of its terms, in f64 over the engine's f32 outputs.
    let objective = |engine: &mut Engine<CpuBackend>, pulls: &[Vec<f32>]| -> crate::Result<(f64, f64)> {
        let rows: Vec<Pull> = pulls.iter().map(|p| Pull::Rows(p)).collect();
        let outputs = engine.run(Pass::train(&refs, &rows))?;
        let mut total = (0.0, 0.0);
        for (out, w) in outputs.iter().zip(&weights) {
            for (&y, &w) in out.iter().zip(w) {
                total.0 += f64::from(w) * f64::from(y);
                total.1 += (f64::from(w) * f64::from(y)).abs();
            }
        }
        Ok(total)
    };
    let (_, scale) = objective(&mut engine, &pulls).map_err(fail)?;
    let weight_refs: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
    let grads = engine.backward(&weight_refs).map_err(fail)?;

    let mut targets = Vec::new();
    for (p, port) in f.params().iter().enumerate() {
        let len = port.shape.numel();
        targets.extend(sample(&mut rng, len, opts.max_entries).into_iter().map(|e| Target::Param { param: p, e }));
    }
    for (i, values) in pulls.iter().enumerate() {
        targets
            .extend(sample(&mut rng, values.len(), opts.max_entries).into_iter().map(|e| Target::Pull { input: i, e }));
    }
    let label = |t: Target| match t {
        Target::Param { param, e } => {
            let cols = f.params()[param].shape.cols().max(1);
            format!("param `{}`[{}, {}]", f.params()[param].name, e / cols, e % cols)
        }
        Target::Pull { input, e } => {
            let block = f.inputs()[input].shape.numel().max(1);
            format!("pull `{}`[vertex {}, {}]", f.inputs()[input].name, e / block, e % block)
        }
    };
    let mut check = GradComparisons::new(what.clone(), opts.tolerance, scale);
    for t in targets {
        let (x, analytic, kind) = match t {
            Target::Param { param, e } => (params[param][e], grads.params[param][e], EntryKind::Param),
            Target::Pull { input, e } => (pulls[input][e], grads.pulls[input][e], EntryKind::Pull),
        };
        let points = check.points(x);
        let mut at = |engine: &mut Engine<CpuBackend>, value: f32| -> crate::Result<f64> {
            match t {
                Target::Param { param, e } => {
                    params[param][e] = value;
                    engine.set_params(&params)?;
                    params[param][e] = x;
                    Ok(objective(engine, &pulls)?.0)
                }
                Target::Pull { input, e } => {
                    pulls[input][e] = value;
                    let l = objective(engine, &pulls)?.0;
                    pulls[input][e] = x;
                    Ok(l)
                }
            }
        };
        let values = (at(&mut engine, points.0).map_err(fail)?, at(&mut engine, points.1).map_err(fail)?);
        if kind == EntryKind::Param {
            engine.set_params(&params).map_err(fail)?;
        }
        check.compare(kind, || label(t), analytic, points, values);
    }
    check.finish()
}

/// All of `0..len` when it has at most `max` entries, else `max` distinct ones drawn at random,
/// ascending.
pub(super) fn sample(rng: &mut Rng, len: usize, max: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..len).collect();
    if len > max {
        rng.shuffle(&mut all);
        all.truncate(max);
        all.sort_unstable();
    }
    all
}
