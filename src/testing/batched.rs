//! The batched engine against the reference interpreter run one graph at a time.

use super::{random_params, uniform_rows, Comparisons, Mismatch};
use crate::batching::{Agenda, ByDepth, ByHeight, Policy};
use crate::dropout::{self, DropoutKey};
use crate::engine::Pass;
use crate::graph::InputGraph;
use crate::ir::interp::run_graph;
use crate::ir::VertexFn;
use crate::rng::Rng;
use crate::{CpuBackend, Engine, Pull, SparseGrad};

/// What [`check_batched_with`] draws and how it compares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Batched {
    /// Seed of the parameters, pulled rows, output gradients and dropout masks.
    pub seed: u64,
    /// Draw each pulled row from a table of this many rows (row 0 all zeros, as a padding word),
    /// and check the engine's lookups in that table too (row 0 as padding for even seeds): its
    /// table gradients must equal the reference's row gradients summed per row.
    pub table: Option<usize>,
    /// Every value within `rtol` times its tensor's largest magnitude (at least 1) of the
    /// reference: the engine sums many rows at once in another order than the interpreter.
    pub rtol: f32,
}

impl Batched {
    /// Pulled rows drawn at random, the default tolerance (2e-5).
    pub fn new(seed: u64) -> Batched {
        Batched { seed, table: None, rtol: 2e-5 }
    }
}

/// [`check_batched_with`] with [`Batched::new`]`(seed)`.
pub fn check_batched(f: &VertexFn, graphs: &[InputGraph], seed: u64) -> Result<(), Mismatch> {
    check_batched_with(f, graphs, &Batched::new(seed))
}

/// Pulled rows for `n` vertices, `len` wide: random, or (with `table`) each a random one of
/// `table` random rows, the first of them zeros, with the table and the ids.
struct Pulled {
    rows: Vec<f32>,
    lookup: Option<(Vec<f32>, Vec<u32>)>,
}

fn pulled_rows(rng: &mut Rng, n: usize, len: usize, table: Option<usize>) -> Pulled {
    let Some(k) = table.map(|k| k.max(1)) else { return Pulled { rows: uniform_rows(rng, n * len), lookup: None } };
    let mut t = vec![0.0; len];
    t.extend(uniform_rows(rng, (k - 1) * len));
    let ids: Vec<u32> = (0..n).map(|_| rng.below(k) as u32).collect();
    let rows = ids.iter().flat_map(|&i| t[i as usize * len..][..len].to_vec()).collect();
    Pulled { rows, lookup: Some((t, ids)) }
}

/// The gradient of a table from the gradient rows of the vertices that looked it up (`ids`),
/// summed per id in f64, every id but `padding`.
fn table_grad(ids: &[u32], rows: &[f32], len: usize, padding: Option<u32>) -> SparseGrad {
    let mut sums = std::collections::BTreeMap::<u32, Vec<f64>>::new();
    for (v, &id) in ids.iter().enumerate().filter(|&(_, &id)| Some(id) != padding) {
        let s = sums.entry(id).or_insert_with(|| vec![0.0; len]);
        for (a, &x) in s.iter_mut().zip(&rows[v * len..(v + 1) * len]) {
            *a += f64::from(x);
        }
    }
    SparseGrad { rows: sums.keys().copied().collect(), values: sums.values().flatten().map(|&x| x as f32).collect() }
}

/// What the reference interpreter computes, one graph at a time.
struct Reference {
    outputs: Vec<Vec<f32>>,
    inferred: Vec<Vec<f32>>,
    pulls: Vec<Vec<f32>>,
    params: Vec<Vec<f32>>,
}

/// Checks that the engine on the CPU backend, running the minibatch `graphs` at once (under
/// each scheduling policy: by height, by depth, and an agenda of at most 5 vertices a task),
/// computes what the reference interpreter computes one vertex and one graph at a time: pushed
/// outputs in training and in inference, the pulled inputs' gradients and the parameters'
/// gradients (summed over the graphs) for random output gradients; with dropout, the same masks.
/// Also that asking for some rows only (`Pass::rows`, in inference, training and the backward pass after it) gives
/// exactly those rows' bits, and, with [`Batched::table`], that lookups give the rows' results
/// and the table gradients.
///
/// A [`Mismatch`] names the policy and each wrong value (`by-height: output 0[17]`).
pub fn check_batched_with(f: &VertexFn, graphs: &[InputGraph], opts: &Batched) -> Result<(), Mismatch> {
    let what = format!("`{}` batched over {} graphs against one graph at a time", f.name(), graphs.len());
    let fail = |e: crate::Error| Mismatch::other(what.clone(), e.to_string());
    let mut rng = Rng::new(opts.seed);
    let params = random_params(f, &mut rng);
    let total: usize = graphs.iter().map(InputGraph::len).sum();
    let pulled: Vec<Pulled> =
        f.inputs().iter().map(|p| pulled_rows(&mut rng, total, p.shape.numel(), opts.table)).collect();
    let pulls: Vec<&[f32]> = pulled.iter().map(|p| p.rows.as_slice()).collect();
    let push_grads: Vec<Vec<f32>> =
        f.outputs().iter().map(|o| uniform_rows(&mut rng, total * o.shape.numel())).collect();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let pull_refs: Vec<Pull> = pulls.iter().map(|p| Pull::Rows(p)).collect();
    let grad_refs: Vec<&[f32]> = push_grads.iter().map(Vec::as_slice).collect();
    // Dropout masks are drawn per graph of the minibatch and vertex: the reference runs graph `k`
    // alone, as the pass's graph `k`. Inference (masks of ones) is checked against its own run.
    let key = DropoutKey { seed: opts.seed ^ 0x5eed, step: opts.seed % 7, first: 0 };
    let want = reference(f, &params, graphs, &pulls, &push_grads, key);
    let detail = format!("each value within {} of its tensor's largest magnitude", opts.rtol);
    let mut cmp = Comparisons::new(what.clone(), detail);
    let mut close = |place: &str, got: &[f32], want: &[f32]| {
        if got.len() != want.len() {
            cmp.compare(|| format!("{place} (length)"), got.len() as f64, want.len() as f64, 0.0);
            return;
        }
        let scale = want.iter().fold(1.0f32, |m, w| m.max(w.abs()));
        let bound = f64::from(opts.rtol * scale);
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            cmp.compare(|| format!("{place}[{i}]"), f64::from(g), f64::from(w), bound);
        }
    };
    let mut exact: Vec<String> = Vec::new();
    let policies: [Box<dyn Policy>; 3] = [Box::new(ByHeight), Box::new(ByDepth), Box::new(Agenda { max_batch: 5 })];
    for policy in policies {
        let name = policy.name();
        let mut engine = Engine::new(CpuBackend::new(), f.clone(), &params).map_err(fail)?;
        engine.set_policy(policy);
        engine.set_dropout_key(key);
        let inferred = engine.run(Pass::infer(&refs, &pull_refs)).map_err(fail)?;
        // Some vertices, out of order and one twice: each output's rows of `infer`, in that order.
        let rows: Vec<usize> = (0..total).rev().step_by(3).chain((total > 0).then_some(0)).collect();
        let picked = engine.run(Pass::infer(&refs, &pull_refs).rows(&rows)).map_err(fail)?;
        for (o, (got, all)) in picked.iter().zip(&inferred).enumerate() {
            if got != &pick(all, &rows, f.outputs()[o].shape.numel()) {
                exact.push(format!("{name}: `infer_rows` output {o} differs from those rows of `infer`"));
            }
        }
        let outputs = engine.run(Pass::train(&refs, &pull_refs)).map_err(fail)?;
        let grads = engine.backward(&grad_refs).map_err(fail)?;
        for (o, (got, want)) in inferred.iter().zip(&want.inferred).enumerate() {
            close(&format!("{name}: inferred output {o}"), got, want);
        }
        for (o, (got, want)) in outputs.iter().zip(&want.outputs).enumerate() {
            close(&format!("{name}: output {o}"), got, want);
        }
        for (i, (got, want)) in grads.pulls.iter().zip(&want.pulls).enumerate() {
            close(&format!("{name}: gradient of pull `{}`", f.inputs()[i].name), got, want);
        }
        for (p, (got, want)) in grads.params.iter().zip(&want.params).enumerate() {
            close(&format!("{name}: gradient of param `{}`", f.params()[p].name), got, want);
        }
        // Gradients given at some vertices only (the targets of a loss): the same bits as the
        // whole gradient with zeros at every other vertex.
        let chosen = |v: usize| v % 3 != 1;
        let some: Vec<usize> = (0..total).filter(|&v| chosen(v)).collect();
        let (mut sparse, mut dense) = (Vec::new(), Vec::new());
        for (g, o) in push_grads.iter().zip(f.outputs()) {
            let block = o.shape.numel();
            sparse.push(pick(g, &some, block));
            dense.push(
                g.chunks_exact(block)
                    .enumerate()
                    .flat_map(|(v, r)| r.iter().map(move |&x| if chosen(v) { x } else { 0.0 }))
                    .collect::<Vec<f32>>(),
            );
        }
        let picked = engine.run(Pass::train(&refs, &pull_refs).rows(&some)).map_err(fail)?;
        for (o, (got, all)) in picked.iter().zip(&outputs).enumerate() {
            if got != &pick(all, &some, f.outputs()[o].shape.numel()) {
                exact.push(format!("{name}: `forward_rows` output {o} differs from those rows of `forward`"));
            }
        }
        let got = engine.backward(&sparse.iter().map(Vec::as_slice).collect::<Vec<_>>()).map_err(fail)?;
        engine.run(Pass::train(&refs, &pull_refs)).map_err(fail)?;
        let all = engine.backward(&dense.iter().map(Vec::as_slice).collect::<Vec<_>>()).map_err(fail)?;
        if (got.pulls, got.params) != (all.pulls, all.params) {
            exact.push(format!("{name}: `backward_rows` differs from `backward` with zeros at the other rows"));
        }
    }
    if opts.table.is_some() {
        let padding = opts.seed.is_multiple_of(2).then_some(0);
        let lookups: Vec<Pull> = pulled
            .iter()
            .filter_map(|p| p.lookup.as_ref())
            .map(|(table, ids)| Pull::Lookup { table, ids, padding })
            .collect();
        let mut engine = Engine::new(CpuBackend::new(), f.clone(), &params).map_err(fail)?;
        engine.set_dropout_key(key);
        let outputs = engine.run(Pass::train(&refs, &lookups)).map_err(fail)?;
        let grads = engine.backward(&grad_refs).map_err(fail)?;
        for (o, (got, want)) in outputs.iter().zip(&want.outputs).enumerate() {
            close(&format!("lookup: output {o}"), got, want);
        }
        for (i, ((got, want), port)) in grads.tables.iter().zip(&want.pulls).zip(f.inputs()).enumerate() {
            let (Some(got), Some((_, ids))) = (got, &pulled[i].lookup) else {
                exact.push(format!("lookup: no table gradient for pull `{}`", port.name));
                continue;
            };
            let want = table_grad(ids, want, port.shape.numel(), padding);
            if got.rows != want.rows {
                exact.push(format!("lookup: the rows of the table gradient of pull `{}` differ", port.name));
            }
            close(&format!("lookup: table gradient of pull `{}`", port.name), &got.values, &want.values);
            if !grads.pulls[i].is_empty() {
                exact.push(format!("lookup: gradient rows given for pull `{}`", port.name));
            }
        }
        for (p, (got, want)) in grads.params.iter().zip(&want.params).enumerate() {
            close(&format!("lookup: gradient of param `{}`", f.params()[p].name), got, want);
        }
        // The first input's table held by the engine (the others looked up): the same outputs,
        // its table's gradient left in the engine and read back the same.
        if let Some((table, ids)) = pulled.first().and_then(|p| p.lookup.as_ref()) {
            let block = f.inputs()[0].shape.numel();
            let mut mixed = lookups.clone();
            mixed[0] = Pull::Held { ids, padding };
            let mut engine = Engine::new(CpuBackend::new(), f.clone(), &params).map_err(fail)?;
            engine.set_dropout_key(key);
            engine.set_table(table, block).map_err(fail)?;
            let outputs = engine.run(Pass::train(&refs, &mixed)).map_err(fail)?;
            let grads = engine.backward(&grad_refs).map_err(fail)?;
            for (o, (got, want)) in outputs.iter().zip(&want.outputs).enumerate() {
                close(&format!("held: output {o}"), got, want);
            }
            if grads.tables[0].is_some() {
                exact.push("held: a table gradient came back for the held input".into());
            }
            let got = engine.held_table_grad().map_err(fail)?;
            let want = table_grad(ids, &want.pulls[0], block, padding);
            if got.rows != want.rows {
                exact.push("held: the rows of the held table's gradient differ".into());
            }
            close("held: the held table's gradient", &got.values, &want.values);
        }
    }
    let checked = cmp.checked();
    cmp.finish()?;
    match exact.is_empty() {
        true => Ok(()),
        false => Err(Mismatch { what, detail: exact.join("; "), wrong: Vec::new(), checked }),
    }
}

/// The blocks `rows` (each `block` wide) of `all`, in that order.
fn pick(all: &[f32], rows: &[usize], block: usize) -> Vec<f32> {
    rows.iter().flat_map(|&r| all[r * block..(r + 1) * block].iter().copied()).collect()
}

/// The reference run: each graph alone (as the minibatch's graph `k` for its dropout masks),
/// in training and in inference; parameter gradients summed over the graphs in f64.
fn reference(
    f: &VertexFn,
    params: &[Vec<f32>],
    graphs: &[InputGraph],
    pulls: &[&[f32]],
    push_grads: &[Vec<f32>],
    key: DropoutKey,
) -> Reference {
    let mut want = Reference {
        outputs: vec![Vec::new(); f.outputs().len()],
        inferred: vec![Vec::new(); f.outputs().len()],
        pulls: vec![Vec::new(); f.inputs().len()],
        params: Vec::new(),
    };
    let mut param_sums: Vec<Vec<f64>> = f.params().iter().map(|p| vec![0.0; p.shape.numel()]).collect();
    let mut start = 0;
    for (k, g) in graphs.iter().enumerate() {
        let slice = |rows: &[f32], block: usize| rows[start * block..(start + g.len()) * block].to_vec();
        let p: Vec<Vec<f32>> = pulls.iter().zip(f.inputs()).map(|(x, port)| slice(x, port.shape.numel())).collect();
        let d: Vec<Vec<f32>> =
            push_grads.iter().zip(f.outputs()).map(|(x, port)| slice(x, port.shape.numel())).collect();
        let dr: Vec<&[f32]> = d.iter().map(Vec::as_slice).collect();
        let with_masks = |train: bool| {
            let masks = dropout::masks(f, DropoutKey { first: k, ..key }, &[g], train);
            p.iter().chain(&masks).cloned().collect::<Vec<Vec<f32>>>()
        };
        let (drawn, ones) = (with_masks(true), with_masks(false));
        let pr: Vec<&[f32]> = drawn.iter().map(Vec::as_slice).collect();
        let run = run_graph(f, params, g, &pr, &dr);
        let pr: Vec<&[f32]> = ones.iter().map(Vec::as_slice).collect();
        for (w, o) in want.inferred.iter_mut().zip(run_graph(f, params, g, &pr, &dr).outputs) {
            w.extend(o);
        }
        for (w, o) in want.outputs.iter_mut().zip(run.outputs) {
            w.extend(o);
        }
        for (w, o) in want.pulls.iter_mut().zip(run.pull_grads) {
            w.extend(o);
        }
        for (w, o) in param_sums.iter_mut().zip(run.param_grads) {
            for (a, b) in w.iter_mut().zip(o) {
                *a += f64::from(b);
            }
        }
        start += g.len();
    }
    want.params = param_sums.iter().map(|w| w.iter().map(|&x| x as f32).collect()).collect();
    want
}
