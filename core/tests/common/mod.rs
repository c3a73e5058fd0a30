//! Shared helpers of arbor-core's integration tests: random test cases for one vertex, a
//! central-difference gradient check through the reference interpreter, the Tree-LSTM cells and
//! a validity check of kernel plans.
//!
//! Each test binary uses only part of this module.
#![allow(dead_code)]

use arbor_core::fusion::{Plan, Step, PHASES};
use arbor_core::ir::interp::{self, BackwardIo, VertexGrads};
use arbor_core::ir::{Builder, Func, Init, Op, ParamGrad, ValueId, VertexFn};
use arbor_core::rng::Rng;

/// Step of the central differences `(L(x + ε) − L(x − ε)) / 2ε`.
///
/// The interpreter computes in f32, so ε cannot be tiny: with values of order 1, the rounding
/// error of `L` (≈ 1e-7·Σ|terms|) divided by 2ε stays around 1e-5, and the truncation error
/// (ε²/6·L''') around 2e-5 for the bounded nonlinearities used here.
pub const EPS: f32 = 1e-2;

/// Tolerance of one gradient entry: `|analytic − numeric| ≤ ATOL + RTOL·|numeric| + noise`,
/// where `noise = NOISE·S/ε` grows with `S = Σ|weight·value|`, the magnitude of the terms of `L`
/// (f32 rounding of `L` scales with it). For the functions tested here `S` is 1–30, so the
/// bound is about 2e-3 + 1% — two orders of magnitude above the observed finite-difference
/// error, and one to two orders below what a wrong derivative (a missing term, a wrong factor, a
/// transposed product, a gradient sent to the wrong slot) produces on O(0.1–1) gradients.
pub const ATOL: f64 = 2e-3;
/// See [`ATOL`].
pub const RTOL: f64 = 1e-2;
/// See [`ATOL`].
pub const NOISE: f64 = 1e-6;

/// One vertex's inputs and the weights of the scalar objective
/// `L = Σ_o ⟨push_grads[o], pushed_o⟩ + Σ_s ⟨state_grads[s], scattered_s⟩`.
#[derive(Clone, Debug)]
pub struct Case {
    /// Parameter values, in declaration order.
    pub params: Vec<Vec<f32>>,
    /// Per child slot: that child's states (indexed like `f.states()`), or `None`.
    pub children: Vec<Option<Vec<Vec<f32>>>>,
    /// Per pulled input: this vertex's row.
    pub pulls: Vec<Vec<f32>>,
    /// Weight of each pushed output (its gradient in the backward pass).
    pub push_grads: Vec<Vec<f32>>,
    /// Weight of each scattered state. States that no vertex gathers get zero weight: no parent
    /// ever reads them, and F' (by design) sends them no gradient.
    pub state_grads: Vec<Vec<f32>>,
}

/// Uniform magnitude in `[lo, hi)` with a random sign: inputs stay away from 0 (relu's kink).
pub fn signed(rng: &mut Rng, lo: f32, hi: f32) -> f32 {
    let m = rng.range(lo, hi);
    if rng.below(2) == 0 {
        m
    } else {
        -m
    }
}

impl Case {
    /// Random parameters (from the function's initialisers), child states and pulls of magnitude
    /// in `[0.1, 1)` with random signs, and objective weights in `[-1, 1)`. `present[k]` says
    /// whether child slot `k` holds a child.
    pub fn random(f: &VertexFn, seed: u64, present: &[bool]) -> Case {
        let mut rng = Rng::new(seed);
        let params = f.init_params(&mut rng);
        let children = present
            .iter()
            .map(|&p| {
                p.then(|| {
                    f.states()
                        .iter()
                        .map(|s| (0..s.shape.numel()).map(|_| signed(&mut rng, 0.1, 1.0)).collect())
                        .collect()
                })
            })
            .collect();
        let mut pulls: Vec<Vec<f32>> =
            f.inputs().iter().map(|p| (0..p.shape.numel()).map(|_| signed(&mut rng, 0.1, 1.0)).collect()).collect();
        // Dropout masks, drawn once: the function is then differentiable in everything else.
        let key = arbor_core::dropout::DropoutKey { seed, step: 1, first: 0 };
        for (site, (&p, port)) in f.dropout_rates().iter().zip(&f.all_inputs()[f.inputs().len()..]).enumerate() {
            let mut row = vec![0.0; port.shape.numel()];
            arbor_core::dropout::mask_row(key, site, 0, 0, p, &mut row);
            pulls.push(row);
        }
        let push_grads =
            f.outputs().iter().map(|o| (0..o.shape.numel()).map(|_| rng.range(-1.0, 1.0)).collect()).collect();
        let state_grads = f
            .states()
            .iter()
            .map(|s| (0..s.shape.numel()).map(|_| if s.gathered { rng.range(-1.0, 1.0) } else { 0.0 }).collect())
            .collect();
        Case { params, children, pulls, push_grads, state_grads }
    }

    /// Which child slots hold a child.
    pub fn present(&self) -> Vec<bool> {
        self.children.iter().map(Option::is_some).collect()
    }
}

/// Every forward value of the vertex (`interp::forward`).
pub fn forward_vals(f: &VertexFn, case: &Case) -> Vec<Vec<f32>> {
    let children: Vec<Option<&[Vec<f32>]>> = case.children.iter().map(|c| c.as_deref()).collect();
    let pulls: Vec<&[f32]> = case.pulls.iter().map(Vec::as_slice).collect();
    interp::forward(f, &case.params, &children, &pulls)
}

/// The value of output `name` (pushed) in `vals`.
pub fn output<'v>(f: &VertexFn, vals: &'v [Vec<f32>], name: &str) -> &'v [f32] {
    let o = f.outputs().iter().find(|o| o.name == name).unwrap_or_else(|| panic!("no output {name}"));
    &vals[o.value.index()]
}

/// The value of state `name` (scattered) in `vals`.
pub fn state<'v>(f: &VertexFn, vals: &'v [Vec<f32>], name: &str) -> &'v [f32] {
    let s = f.states().iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no state {name}"));
    &vals[s.value.index()]
}

fn dot(w: &[f32], x: &[f32]) -> (f64, f64) {
    assert_eq!(w.len(), x.len(), "weight and value lengths differ");
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| (s + f64::from(w) * f64::from(x), a + f64::from(w * x).abs()))
}

/// The objective `L` of the case and the magnitude `S = Σ|weight·value|` of its terms.
pub fn objective(f: &VertexFn, case: &Case) -> (f64, f64) {
    let vals = forward_vals(f, case);
    let mut total = (0.0, 0.0);
    let terms = f
        .outputs()
        .iter()
        .zip(&case.push_grads)
        .map(|(o, w)| (o.value, w))
        .chain(f.states().iter().zip(&case.state_grads).map(|(s, w)| (s.value, w)));
    for (v, w) in terms {
        let (s, a) = dot(w, &vals[v.index()]);
        total.0 += s;
        total.1 += a;
    }
    total
}

/// The analytic gradients of `L`: the vertex's gradients and the parameter gradients.
pub fn analytic(f: &VertexFn, case: &Case) -> (VertexGrads, Vec<Vec<f32>>) {
    let vals = forward_vals(f, case);
    let present = case.present();
    let io = BackwardIo { children: &present, state_grads: &case.state_grads, push_grads: &case.push_grads };
    let mut param_grads: Vec<Vec<f32>> = case.params.iter().map(|p| vec![0.0; p.len()]).collect();
    let grads = interp::backward(f, &case.params, &vals, &io, &mut param_grads);
    (grads, param_grads)
}

/// One scalar input of the vertex a gradient is checked for.
#[derive(Clone, Copy, Debug)]
enum Target {
    Child { slot: usize, state: usize, e: usize },
    Pull { input: usize, e: usize },
    Param { param: usize, e: usize },
}

fn entry(case: &mut Case, t: Target) -> &mut f32 {
    match t {
        Target::Child { slot, state, e } => &mut case.children[slot].as_mut().expect("present child")[state][e],
        Target::Pull { input, e } => &mut case.pulls[input][e],
        Target::Param { param, e } => &mut case.params[param][e],
    }
}

fn label(f: &VertexFn, t: Target) -> String {
    match t {
        Target::Child { slot, state, e } => {
            format!("child {slot} state `{}`[{e}]", f.states()[state].name)
        }
        Target::Pull { input, e } => format!("pull `{}`[{e}]", f.inputs()[input].name),
        Target::Param { param, e } => format!("param `{}`[{e}]", f.params()[param].name),
    }
}

/// The central difference of `L` along one input.
fn numeric(f: &VertexFn, case: &mut Case, t: Target, eps: f32) -> f64 {
    let x = *entry(case, t);
    let (hi, lo) = (x + eps, x - eps);
    *entry(case, t) = hi;
    let lp = objective(f, case).0;
    *entry(case, t) = lo;
    let lm = objective(f, case).0;
    *entry(case, t) = x;
    (lp - lm) / f64::from(hi - lo)
}

/// What a gradient check looked at.
#[derive(Clone, Debug, Default)]
pub struct GradReport {
    /// Child-state entries checked.
    pub children: usize,
    /// Pull entries checked.
    pub pulls: usize,
    /// Parameter entries checked.
    pub params: usize,
    /// Largest `|analytic − numeric|`.
    pub max_err: f64,
    /// Largest `|analytic − numeric|` relative to its tolerance (≤ 1 when the check passes).
    pub worst: f64,
    /// Euclidean norm of all numeric gradients (a check of an all-zero gradient proves little).
    pub norm: f64,
}

/// Compares `interp::backward` with central differences of `L` for every entry of every present
/// child's states, every pull and every parameter. Also checks the shapes of what backward
/// returns. `Err` lists the mismatches. Set `ARBOR_GRADCHECK_DEBUG=1` (with `--nocapture`) to
/// print every check's [`GradReport`].
pub fn check_gradients(f: &VertexFn, case: &Case) -> Result<GradReport, String> {
    let (grads, param_grads) = analytic(f, case);
    let mut case = case.clone();
    let (_, scale) = objective(f, &case);
    let mut report = GradReport::default();
    let mut errors = Vec::new();

    if grads.children.len() != case.children.len() {
        return Err(format!(
            "backward returned {} child slots for {} given",
            grads.children.len(),
            case.children.len()
        ));
    }
    if grads.pulls.len() != f.all_inputs().len() {
        let inputs = f.all_inputs().len();
        return Err(format!("backward returned {} pull gradients for {inputs} inputs", grads.pulls.len()));
    }
    let mut targets = Vec::new();
    for (slot, (given, got)) in case.children.iter().zip(&grads.children).enumerate() {
        match (given, got) {
            (None, None) => {}
            (Some(states), Some(gs)) => {
                if gs.len() != states.len() {
                    return Err(format!("child {slot}: {} state gradients", gs.len()));
                }
                for (s, (x, g)) in states.iter().zip(gs).enumerate() {
                    if x.len() != g.len() {
                        return Err(format!("child {slot} state {s}: gradient length {}", g.len()));
                    }
                    for (e, &g) in g.iter().enumerate() {
                        targets.push((Target::Child { slot, state: s, e }, g));
                    }
                }
            }
            (Some(_), None) => return Err(format!("no gradient for present child {slot}")),
            (None, Some(_)) => return Err(format!("a gradient for missing child {slot}")),
        }
    }
    // Dropout masks (the inputs after the user's) are constants.
    for (i, (x, g)) in case.pulls.iter().zip(&grads.pulls).take(f.inputs().len()).enumerate() {
        if x.len() != g.len() {
            return Err(format!("pull {i}: gradient length {}", g.len()));
        }
        for (e, &g) in g.iter().enumerate() {
            targets.push((Target::Pull { input: i, e }, g));
        }
    }
    for (p, g) in param_grads.iter().enumerate() {
        for (e, &g) in g.iter().enumerate() {
            targets.push((Target::Param { param: p, e }, g));
        }
    }
    let noise = NOISE * scale / f64::from(EPS);
    let mut sq = 0.0;
    for (t, a) in targets {
        let n = numeric(f, &mut case, t, EPS);
        let a = f64::from(a);
        let err = (a - n).abs();
        sq += n * n;
        report.max_err = report.max_err.max(err);
        match t {
            Target::Child { .. } => report.children += 1,
            Target::Pull { .. } => report.pulls += 1,
            Target::Param { .. } => report.params += 1,
        }
        let tol = ATOL + RTOL * n.abs() + noise;
        report.worst = report.worst.max(err / tol);
        if err.is_nan() || err > tol {
            errors.push(format!("{}: analytic {a:.6}, numeric {n:.6} (|diff| {err:.2e})", label(f, t)));
        }
    }
    report.norm = sq.sqrt();
    if std::env::var_os("ARBOR_GRADCHECK_DEBUG").is_some() {
        eprintln!("gradcheck `{}`: {report:?}", f.name());
    }
    if !errors.is_empty() {
        let shown = errors.len().min(12);
        return Err(format!(
            "vertex function `{}`: {} of {} gradient entries differ from finite differences \
             (eps {EPS}, tol {ATOL} + {RTOL}·|numeric| + {noise:.1e}):\n  {}{}",
            f.name(),
            errors.len(),
            report.children + report.pulls + report.params,
            errors[..shown].join("\n  "),
            if shown < errors.len() { "\n  …" } else { "" }
        ));
    }
    Ok(report)
}

/// [`check_gradients`], panicking with its message; also fails when all gradients are (near)
/// zero, since such a check proves nothing.
#[track_caller]
pub fn assert_gradients(f: &VertexFn, case: &Case) -> GradReport {
    let report = match check_gradients(f, case) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    assert!(
        report.norm > 1e-2,
        "vertex function `{}`: all gradients are (near) zero (norm {:.2e}); the check proves nothing",
        f.name(),
        report.norm
    );
    report
}

/// The binary (N = 2) Tree-LSTM cell of Tai et al. (2015), inputs of width `d`, hidden width
/// `h`. Gates `[i f0 f1 o u] = x·W + h0·U0 + h1·U1 + b`; `c = i⊙u + f0⊙c0 + f1⊙c1`;
/// `h = o⊙tanh(c)`. States: `h` (index 0) and `c` (index 1); output `h`.
pub fn binary_tree_lstm(d: usize, h: usize) -> VertexFn {
    let f = Builder::new("tree-lstm", 2);
    let x = f.pull("x", d);
    let h0 = f.gather(0, "h", h);
    let c0 = f.gather(0, "c", h);
    let h1 = f.gather(1, "h", h);
    let c1 = f.gather(1, "c", h);
    let w = f.param("W", [d, 5 * h], Init::Xavier);
    let u0 = f.param("U0", [h, 5 * h], Init::Xavier);
    let u1 = f.param("U1", [h, 5 * h], Init::Xavier);
    let b = f.param("b", [1, 5 * h], Init::Uniform(0.5));
    let gates = x.matmul(w) + h0.matmul(u0) + h1.matmul(u1) + b;
    let i = gates.slice(0, h).sigmoid();
    let f0 = gates.slice(h, h).sigmoid();
    let f1 = gates.slice(2 * h, h).sigmoid();
    let o = gates.slice(3 * h, h).sigmoid();
    let u = gates.slice(4 * h, h).tanh();
    let c = i * u + f0 * c0 + f1 * c1;
    let h_new = o * c.tanh();
    f.scatter("h", h_new);
    f.scatter("c", c);
    f.push("h", h_new);
    f.build().expect("binary Tree-LSTM builds")
}

/// The child-sum Tree-LSTM cell, simplified: `h̃ = Σ_k h_k`, `[i o u] = x·W + h̃·U + b`.
/// Tai et al. give every child its own forget gate `f_k = σ(x·Wf + h_k·Uf + bf)` and
/// `c = i⊙u + Σ_k f_k⊙c_k`; `gather_sum` only yields sums, so here one forget gate
/// `f = σ(x·Wf + h̃·Uf + bf)` multiplies `c̃ = Σ_k c_k`: `c = i⊙u + f⊙c̃`, `h = o⊙tanh(c)`.
pub fn child_sum_tree_lstm(d: usize, h: usize) -> VertexFn {
    let f = Builder::new("child-sum-tree-lstm", 0);
    let x = f.pull("x", d);
    let h_sum = f.gather_sum("h", h);
    let c_sum = f.gather_sum("c", h);
    let w = f.param("W", [d, 3 * h], Init::Xavier);
    let u = f.param("U", [h, 3 * h], Init::Xavier);
    let b = f.param("b", [1, 3 * h], Init::Uniform(0.5));
    let wf = f.param("Wf", [d, h], Init::Xavier);
    let uf = f.param("Uf", [h, h], Init::Xavier);
    let bf = f.param("bf", [1, h], Init::Uniform(0.5));
    let iou = x.matmul(w) + h_sum.matmul(u) + b;
    let i = iou.slice(0, h).sigmoid();
    let o = iou.slice(h, h).sigmoid();
    let u_ = iou.slice(2 * h, h).tanh();
    let fg = (x.matmul(wf) + h_sum.matmul(uf) + bf).sigmoid();
    let c = i * u_ + fg * c_sum;
    let h_new = o * c.tanh();
    f.scatter("h", h_new);
    f.scatter("c", c);
    f.push("h", h_new);
    f.build().expect("child-sum Tree-LSTM builds")
}

/// Checks that `plan` is a valid schedule of `func`:
/// - every non-load value is computed exactly once, by a GEMM step (matrix products) or a fused
///   kernel (everything else), and only from values already in memory or computed earlier in
///   the same kernel; a kernel's local wiring matches the function's;
/// - a computed value that is not stored is used only inside its own kernel and is no root;
///   every root ends up in memory (or is a load the engine can address directly);
/// - no prologue step depends on the recurrence input (`rec_in`), and every recurrence output
///   (`rec_out`) is computed before the epilogue;
/// - `plan.stored` agrees with what the steps write.
pub fn check_plan(
    func: &Func,
    plan: &Plan,
    rec_in: impl Fn(&Op) -> bool,
    rec_out: &[ValueId],
    roots: &[ValueId],
) -> Result<(), String> {
    let n = func.nodes.len();
    let users = func.users();
    let mut dep = vec![false; n];
    for (i, node) in func.nodes.iter().enumerate() {
        dep[i] = rec_in(&node.op) || node.op.inputs().iter().any(|x| dep[x.index()]);
    }
    let addressable = |op: &Op| {
        matches!(
            op,
            Op::Pull { .. } | Op::Param { .. } | Op::Primal { .. } | Op::StateGrad { .. } | Op::PushGrad { .. }
        )
    };
    let mut mem: Vec<bool> = func.nodes.iter().map(|n| addressable(&n.op)).collect();
    let mut computed = vec![0usize; n];
    let mut computed_in = vec![None; n];
    if plan.stored.len() != n {
        return Err(format!("plan.stored has {} entries for {n} values", plan.stored.len()));
    }
    for p in PHASES {
        for step in &plan.phases[p as usize] {
            match step {
                Step::Gemms(vs) => {
                    if let Some(v) = vs.iter().find(|v| func.node(**v).op.inputs().iter().any(|x| vs.contains(x))) {
                        return Err(format!("gemm {v} reads a product of its own batch"));
                    }
                    for v in vs {
                        let node = func.node(*v);
                        if !node.op.is_matmul() {
                            return Err(format!("gemm step {v} is {}", node.op.name()));
                        }
                        for x in node.op.inputs() {
                            if !mem[x.index()] {
                                return Err(format!("gemm {v} reads {x} before it is in memory"));
                            }
                        }
                        if !plan.stored[v.index()] {
                            return Err(format!("gemm {v} not marked stored"));
                        }
                        mem[v.index()] = true;
                        computed[v.index()] += 1;
                        computed_in[v.index()] = Some(p);
                    }
                }
                Step::Fused(k) => {
                    if k.nodes.len() != k.values.len() {
                        return Err("kernel nodes and values differ in length".into());
                    }
                    let mut local_computed = vec![false; k.nodes.len()];
                    for (l, (node, &v)) in k.nodes.iter().zip(&k.values).enumerate() {
                        let orig = func.node(v);
                        if node.shape != orig.shape {
                            return Err(format!("kernel member {v} has shape {}", node.shape));
                        }
                        match &node.op {
                            Op::Stored { value } => {
                                if *value != v || !mem[v.index()] {
                                    return Err(format!("kernel reads {v} from memory before it is there"));
                                }
                            }
                            op if op.is_load() => {
                                if *op != orig.op {
                                    return Err(format!("kernel load {v} is {}", op.name()));
                                }
                            }
                            op => {
                                if op.name() != orig.op.name() {
                                    return Err(format!(
                                        "kernel computes {v} as {} instead of {}",
                                        op.name(),
                                        orig.op.name()
                                    ));
                                }
                                let ins = op.inputs();
                                let want = orig.op.inputs();
                                if ins.len() != want.len() {
                                    return Err(format!("kernel member {v}: wrong arity"));
                                }
                                for (li, w) in ins.iter().zip(&want) {
                                    if li.index() >= l || k.values[li.index()] != *w {
                                        return Err(format!(
                                            "kernel member {v}: input {li} is not {w} computed earlier"
                                        ));
                                    }
                                }
                                local_computed[l] = true;
                                computed[v.index()] += 1;
                                computed_in[v.index()] = Some(p);
                            }
                        }
                    }
                    for &s in &k.stores {
                        let v = k.values[s];
                        if !plan.stored[v.index()] {
                            return Err(format!("kernel stores {v}, not marked stored"));
                        }
                        mem[v.index()] = true;
                    }
                    for (l, &v) in k.values.iter().enumerate() {
                        if !local_computed[l] || k.stores.contains(&l) {
                            continue;
                        }
                        if roots.contains(&v) {
                            return Err(format!("root {v} is computed but not stored"));
                        }
                        for u in &users[v.index()] {
                            let inside = k.values.iter().position(|x| x == u).is_some_and(|ul| local_computed[ul]);
                            if !inside {
                                return Err(format!("{v} is not stored but used by {u} outside its kernel"));
                            }
                        }
                    }
                }
            }
        }
    }
    for (i, node) in func.nodes.iter().enumerate() {
        let v = ValueId(i as u32);
        if node.op.is_load() {
            continue;
        }
        if computed[i] != 1 {
            return Err(format!("{v} ({}) is computed {} times", node.op.name(), computed[i]));
        }
        if computed_in[i] == Some(arbor_core::fusion::Phase::Prologue) && dep[i] {
            return Err(format!("{v} depends on the recurrence but runs in the prologue"));
        }
    }
    for r in roots {
        if !mem[r.index()] {
            return Err(format!("root {r} never reaches memory"));
        }
    }
    for r in rec_out {
        if computed_in[r.index()] == Some(arbor_core::fusion::Phase::Epilogue) {
            return Err(format!("recurrence output {r} is computed in the epilogue"));
        }
    }
    Ok(())
}

/// [`check_plan`] for both plans of a built function.
pub fn check_plans(f: &VertexFn) -> Result<(), String> {
    let rec_out: Vec<ValueId> = f.states().iter().filter(|s| s.gathered).map(|s| s.value).collect();
    let mut roots: Vec<ValueId> = f.states().iter().map(|s| s.value).collect();
    roots.extend(f.outputs().iter().map(|o| o.value));
    roots.extend(f.backward().saved.iter().copied());
    check_plan(
        f.forward(),
        f.forward_plan(),
        |op| matches!(op, Op::Gather { .. } | Op::GatherSum { .. }),
        &rec_out,
        &roots,
    )
    .map_err(|e| format!("forward plan: {e}\n{}", f.forward_plan()))?;

    let b = f.backward();
    let rec_out: Vec<ValueId> = b.child_grads.iter().map(|c| c.value).collect();
    let mut roots = rec_out.clone();
    roots.extend(b.pull_grads.iter().flatten().copied());
    for g in &b.param_grads {
        match *g {
            ParamGrad::MatMul { x, dy, .. } => roots.extend([x, dy]),
            ParamGrad::SumRows { dy, .. } => roots.push(dy),
        }
    }
    check_plan(&b.func, f.backward_plan(), |op| matches!(op, Op::StateGrad { .. }), &rec_out, &roots)
        .map_err(|e| format!("backward plan: {e}\n{}", f.backward_plan()))?;

    // Every forward value F' reads must be kept from the forward pass.
    for n in &b.func.nodes {
        if let Op::Primal { value } = n.op {
            if !b.saved.contains(&value) {
                return Err(format!("F' reads primal {value}, which is not in `saved`"));
            }
        }
    }
    Ok(())
}
