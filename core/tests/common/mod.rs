//! Shared helpers of arbor-core's integration tests: reading a vertex's values, the gradient
//! check of [`arbor_core::testing`] that also refuses all-zero gradients, the Tree-LSTM cells and
//! a validity check of kernel plans.
//!
//! Each test binary uses only part of this module.
#![allow(dead_code)]

use arbor_core::fusion::{Plan, Step, PHASES};
use arbor_core::ir::{Builder, Func, Init, Op, ParamGrad, ValueId, VertexFn};
use arbor_core::testing::{check_vertex, GradReport, VertexCase};

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

/// [`check_vertex`], panicking with its message; also fails when all gradients are (near) zero,
/// since such a check proves nothing.
#[track_caller]
pub fn assert_gradients(f: &VertexFn, case: &VertexCase) -> GradReport {
    let report = check_vertex(f, case).unwrap_or_else(|e| panic!("{e}"));
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
                Step::Attend(v) => {
                    let node = func.node(*v);
                    if !node.op.is_attention() {
                        return Err(format!("attention step {v} is {}", node.op.name()));
                    }
                    if let Some(x) = node.op.inputs().into_iter().find(|x| !mem[x.index()]) {
                        return Err(format!("attention {v} reads {x} before it is in memory"));
                    }
                    if !plan.stored[v.index()] {
                        return Err(format!("attention {v} not marked stored"));
                    }
                    mem[v.index()] = true;
                    computed[v.index()] += 1;
                    computed_in[v.index()] = Some(p);
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
    // A child's state F′ reads only into fused kernels is read by index where the child's state
    // is, not from a copy (checked below).
    let by_index =
        |v: &ValueId| matches!(f.forward().node(*v).op, Op::Gather { .. }) && !f.forward_plan().stored[v.index()];
    roots.extend(f.backward().saved.iter().copied().filter(|v| !by_index(v)));
    check_plan(
        f.forward(),
        f.forward_plan(),
        |op| matches!(op, Op::Gather { .. } | Op::GatherAll { .. } | Op::GatherSoftmax { .. }),
        &rec_out,
        &roots,
    )
    .map_err(|e| format!("forward plan: {e}\n{}", f.forward_plan()))?;

    let b = f.backward();
    let rec_out: Vec<ValueId> = b.child_grads.iter().map(|c| c.value).chain(b.edge_grads.iter().copied()).collect();
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

    // Every forward value F' reads must be kept from the forward pass, and one read by index
    // only by fused kernels.
    let users = b.func.users();
    for (i, n) in b.func.nodes.iter().enumerate() {
        if let Op::Primal { value } = n.op {
            if !b.saved.contains(&value) {
                return Err(format!("F' reads primal {value}, which is not in `saved`"));
            }
            let p = ValueId(i as u32);
            if by_index(&value) && (roots.contains(&p) || users[i].iter().any(|u| b.func.node(*u).op.is_standalone())) {
                return Err(format!("F' reads primal {value} from memory, but F does not store it"));
            }
        }
    }
    Ok(())
}

/// Runs the gradient check on a few random cases of `f` (children as given by `present`).
#[track_caller]
pub fn check(f: &VertexFn, present: &[bool]) {
    for seed in 0..3 {
        let case = VertexCase::random(f, 1000 + seed, present);
        let r = assert_gradients(f, &case);
        let want_children =
            present.iter().filter(|&&p| p).count() * f.states().iter().map(|s| s.shape.numel()).sum::<usize>();
        assert_eq!(r.children, want_children);
        assert_eq!(r.pulls, f.inputs().iter().map(|p| p.shape.numel()).sum::<usize>());
        assert_eq!(r.params, f.params().iter().map(|p| p.shape.numel()).sum::<usize>());
    }
    if let Err(e) = check_plans(f) {
        panic!("{e}")
    }
}

/// Each entry of `got` within 1e-5 (relative, past 1) of `want`'s.
#[track_caller]
pub fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "[{i}]: {g} vs {w}");
    }
}
