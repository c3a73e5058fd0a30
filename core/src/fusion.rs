//! The kernel plan of a vertex function: which values run as GEMMs, which element-wise ops fuse
//! into one kernel, which values are stored, and in which phase of a minibatch each runs.
//!
//! A function splits into three phases:
//! - **prologue**: values that do not depend on the recurrence (a gathered state in F, a state
//!   gradient in F'). They run once over every vertex of the minibatch (hoisting).
//! - **recurrent**: values that depend on the recurrence and feed it (the scattered states in F,
//!   the children's gradients in F'). They run task by task.
//! - **epilogue**: values that depend on the recurrence but do not feed it. They run once over
//!   every vertex after the task loop.
//!
//! Within a phase, every matrix product is a step of its own and the other ops are grouped by
//! the number of products on their longest path, each group a single fused [`Kernel`] that reads
//! its inputs once and writes only the values used outside it.

use crate::ir::{Backward, Declaration, Func, Node, Op, ValueId};
use std::collections::BTreeMap;
use std::fmt;

/// When a step runs within one minibatch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Once over all vertices, before the task loop.
    #[default]
    Prologue = 0,
    /// Once per task, in schedule order.
    Recurrent = 1,
    /// Once over all vertices, after the task loop.
    Epilogue = 2,
}

/// The three phases, in execution order.
pub const PHASES: [Phase; 3] = [Phase::Prologue, Phase::Recurrent, Phase::Epilogue];

/// A group of row-local ops fused into one kernel.
///
/// `nodes` are the group's ops in execution order; their inputs are rewritten to indices into
/// `nodes` (`ValueId(i)` is the i-th op). Load ops (no inputs) are the kernel's inputs, bound by
/// the engine in the order they appear; `stores` lists the ops whose results it writes out.
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// The function value each op computes.
    pub values: Vec<ValueId>,
    /// The ops, with inputs as local indices.
    pub nodes: Vec<Node>,
    /// Local indices of the ops whose results are written to memory, in order.
    pub stores: Vec<usize>,
}

impl Kernel {
    /// Local indices of the load ops, in the order the engine binds them.
    pub fn loads(&self) -> impl Iterator<Item = usize> + '_ {
        self.nodes.iter().enumerate().filter(|(_, n)| n.op.is_load()).map(|(i, _)| i)
    }

    /// This kernel writing only the stores `keep` selects (by position in `stores`); the ops
    /// that only the others needed are then left uncomputed.
    pub fn keeping_stores(&self, keep: impl Fn(usize) -> bool) -> Kernel {
        let stores = self.stores.iter().enumerate().filter(|&(j, _)| keep(j)).map(|(_, &l)| l).collect();
        Kernel { stores, ..self.clone() }
    }

    /// Why `loads` bindings and `stores` locations do not fit this kernel, if they do not.
    pub fn binding_mismatch(&self, loads: usize, stores: usize) -> Option<String> {
        let want = (self.loads().count(), self.stores.len());
        (want != (loads, stores))
            .then(|| format!("kernel has {} loads and {} stores, got {loads} and {stores}", want.0, want.1))
    }

    /// A stable text naming the kernel's computation (ops, shapes and wiring), for caches.
    pub fn signature(&self) -> String {
        let mut s = String::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let ins: Vec<String> = n.op.inputs().iter().map(|v| v.0.to_string()).collect();
            let kind = match &n.op {
                op if op.is_load() => format!("load{}", if n.is_param { "p" } else { "" }),
                Op::Unary { op, .. } => format!("{op:?}"),
                Op::Binary { op, .. } => format!("{op:?}"),
                op => op.name(),
            };
            s.push_str(&format!("{i}={kind}{}({});", n.shape, ins.join(",")));
        }
        let stores: Vec<String> = self.stores.iter().map(ToString::to_string).collect();
        s.push_str(&format!("store({})", stores.join(",")));
        s
    }
}

/// One step of a phase.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Independent matrix products computing these values: none reads another, so a backend may
    /// run them concurrently.
    Gemms(Vec<ValueId>),
    /// A fused group of row-local ops.
    Fused(Kernel),
    /// Attention over the children ([`Op::GatherSoftmax`]) or its gradient, computing this value.
    Attend(ValueId),
}

/// The kernel plan of one function (F or F').
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// Steps of each phase, in execution order (indexed by `Phase as usize`).
    pub phases: [Vec<Step>; 3],
    /// Whether each value of the function is written to memory.
    pub stored: Vec<bool>,
    /// The phase each value belongs to.
    pub phase: Vec<Phase>,
}

/// Loads whose data the engine can hand to a GEMM or an output directly.
fn addressable(op: &Op) -> bool {
    matches!(op, Op::Pull { .. } | Op::Param { .. } | Op::Primal { .. } | Op::StateGrad { .. } | Op::PushGrad { .. })
}

impl Plan {
    /// The plan of a function's forward pass: it stores the states, the pushed outputs and every
    /// value the backward pass reads, but a child's state that F′ reads only into fused kernels
    /// (see [`read_where_gathered`]).
    pub(crate) fn forward(f: &Declaration, backward: &Backward) -> Plan {
        let where_gathered = read_where_gathered(f, backward);
        let keep: Vec<ValueId> = backward.saved.iter().copied().filter(|v| !where_gathered[v.index()]).collect();
        Plan::forward_keeping(f, &keep)
    }

    /// The plan of a function's forward pass for inference: it stores only the states and the
    /// pushed outputs, nothing for a backward pass.
    pub(crate) fn inference(f: &Declaration) -> Plan {
        Plan::forward_keeping(f, &[])
    }

    fn forward_keeping(f: &Declaration, keep: &[ValueId]) -> Plan {
        let rec_out: Vec<ValueId> = f.states.iter().filter(|s| s.gathered).map(|s| s.value).collect();
        let mut roots: Vec<ValueId> = f.states.iter().map(|s| s.value).collect();
        roots.extend(f.outputs.iter().map(|o| o.value));
        roots.extend(keep);
        let rec_in = |op: &Op| matches!(op, Op::Gather { .. } | Op::GatherAll { .. } | Op::GatherSoftmax { .. });
        Plan::new(&f.forward, rec_in, &rec_out, &roots)
    }

    /// The plan of a function's backward pass (its derived F').
    pub(crate) fn backward(b: &Backward) -> Plan {
        let rec_out = recurrent_outputs(b);
        Plan::new(&b.func, |op| matches!(op, Op::StateGrad { .. }), &rec_out, &backward_roots(b))
    }

    /// Plans `func` given which loads carry the recurrence, which values feed it, and which
    /// values must be stored.
    pub fn new(func: &Func, rec_in: impl Fn(&Op) -> bool, rec_out: &[ValueId], roots: &[ValueId]) -> Plan {
        let n = func.nodes.len();
        let users = func.users();
        let mut dep = vec![false; n];
        for (i, node) in func.nodes.iter().enumerate() {
            dep[i] = rec_in(&node.op) || node.op.inputs().iter().any(|x| dep[x.index()]);
        }
        let mut feeds = vec![false; n];
        for v in rec_out {
            feeds[v.index()] = true;
        }
        for i in (0..n).rev() {
            feeds[i] = feeds[i] || users[i].iter().any(|u| feeds[u.index()]);
        }
        let phase: Vec<Phase> = (0..n)
            .map(|i| match (dep[i], feeds[i]) {
                (false, _) => Phase::Prologue,
                (true, true) => Phase::Recurrent,
                (true, false) => Phase::Epilogue,
            })
            .collect();
        // Level: matrix products on the longest path within the phase.
        let mut level = vec![0usize; n];
        for (i, node) in func.nodes.iter().enumerate() {
            if node.op.is_load() {
                continue;
            }
            level[i] = node
                .op
                .inputs()
                .iter()
                .filter(|x| !func.node(**x).op.is_load() && phase[x.index()] == phase[i])
                .map(|x| level[x.index()] + usize::from(func.node(*x).op.is_standalone()))
                .max()
                .unwrap_or(0);
        }
        let key = |i: usize| (phase[i], level[i]);
        let mut is_root = vec![false; n];
        for r in roots {
            is_root[r.index()] = true;
        }
        let mut stored = vec![false; n];
        let mut groups: BTreeMap<(Phase, usize), BTreeMap<usize, Member>> = BTreeMap::new();
        for (i, node) in func.nodes.iter().enumerate() {
            if node.op.is_load() {
                if addressable(&node.op) {
                    continue;
                }
                // A gather or zeros block handed to a GEMM, attention or an output needs a copy in
                // memory.
                let mut homes: Vec<(Phase, usize)> =
                    users[i].iter().filter(|u| func.node(**u).op.is_standalone()).map(|u| key(u.index())).collect();
                if is_root[i] {
                    homes.push((phase[i], 0));
                }
                for h in homes {
                    groups.entry(h).or_default().insert(i, Member::Stored);
                    stored[i] = true;
                }
                continue;
            }
            if node.op.is_standalone() {
                stored[i] = true;
                continue;
            }
            let k = key(i);
            let escapes =
                is_root[i] || users[i].iter().any(|u| func.node(*u).op.is_standalone() || key(u.index()) != k);
            stored[i] = escapes;
            let g = groups.entry(k).or_default();
            g.insert(i, if escapes { Member::Stored } else { Member::Local });
            for x in node.op.inputs() {
                let xn = func.node(x);
                if xn.op.is_load() {
                    g.entry(x.index()).or_insert(Member::Local);
                } else if xn.op.is_standalone() || key(x.index()) != k {
                    g.insert(x.index(), Member::Input);
                }
            }
        }
        let mut phases: [Vec<Step>; 3] = Default::default();
        let max_level = level.iter().copied().max().unwrap_or(0);
        for p in PHASES {
            for l in 0..=max_level {
                if let Some(members) = groups.get(&(p, l)) {
                    phases[p as usize].push(Step::Fused(kernel(func, members)));
                }
                // Products of one level read only earlier levels, never each other.
                let gemms: Vec<ValueId> = (0..n)
                    .filter(|&i| func.nodes[i].op.is_matmul() && key(i) == (p, l))
                    .map(|i| ValueId(i as u32))
                    .collect();
                if !gemms.is_empty() {
                    phases[p as usize].push(Step::Gemms(gemms));
                }
                // Attention of one level reads neither those products nor another attention.
                let attention = (0..n).filter(|&i| func.nodes[i].op.is_attention() && key(i) == (p, l));
                phases[p as usize].extend(attention.map(|i| Step::Attend(ValueId(i as u32))));
            }
        }
        Plan { phases, stored, phase }
    }

    /// Number of matrix products and of fused kernels over all phases.
    pub fn counts(&self) -> (usize, usize) {
        let steps = self.phases.iter().flatten();
        let gemms = steps.clone().map(|s| if let Step::Gemms(vs) = s { vs.len() } else { 0 }).sum();
        (gemms, steps.filter(|s| matches!(s, Step::Fused(_))).count())
    }
}

/// The values F′ sends back through the recurrence: the children's gradients and attention's.
fn recurrent_outputs(b: &Backward) -> Vec<ValueId> {
    b.child_grads.iter().map(|c| c.value).chain(b.edge_grads.iter().copied()).collect()
}

/// The values of F′ the engine reads from memory: the recurrence's outputs, the inputs'
/// gradients and the factors of the parameter gradients.
fn backward_roots(b: &Backward) -> Vec<ValueId> {
    let mut roots = recurrent_outputs(b);
    roots.extend(b.pull_grads.iter().flatten().copied());
    for g in &b.param_grads {
        match *g {
            crate::ir::ParamGrad::MatMul { x, dy, .. } => roots.extend([x, dy]),
            crate::ir::ParamGrad::SumRows { dy, .. } => roots.push(dy),
        }
    }
    roots
}

/// Per value of F: a child's state gathered by slot that F′ reads, if at all, only as a load of
/// its fused kernels (no product, output or parameter gradient reads it there). F′'s kernels
/// then read it by index where the child's state is, as F's do, and F stores no copy for F′.
fn read_where_gathered(f: &Declaration, b: &Backward) -> Vec<bool> {
    let mut ok: Vec<bool> = f.forward.nodes.iter().map(|n| matches!(n.op, Op::Gather { .. })).collect();
    let roots = backward_roots(b);
    let users = b.func.users();
    for (i, n) in b.func.nodes.iter().enumerate() {
        if let Op::Primal { value } = n.op {
            let p = ValueId(i as u32);
            if roots.contains(&p) || users[i].iter().any(|u| b.func.node(*u).op.is_standalone()) {
                ok[value.index()] = false;
            }
        }
    }
    ok
}

/// The role of a function value in a fused group.
#[derive(Clone, Copy, PartialEq)]
enum Member {
    /// Computed (or loaded) here and used only here.
    Local,
    /// Computed (or loaded) here and written to memory.
    Stored,
    /// Stored by an earlier step and read here.
    Input,
}

/// Builds the kernel of a group from its members.
fn kernel(func: &Func, members: &BTreeMap<usize, Member>) -> Kernel {
    let local: BTreeMap<usize, usize> = members.keys().enumerate().map(|(l, &v)| (v, l)).collect();
    let remap = |v: &ValueId| ValueId(local[&v.index()] as u32);
    let mut nodes = Vec::with_capacity(members.len());
    let mut stores = Vec::new();
    for (l, (&v, &role)) in members.iter().enumerate() {
        let mut node = func.nodes[v].clone();
        node.op = match node.op {
            _ if role == Member::Input => Op::Stored { value: ValueId(v as u32) },
            Op::MatMul { .. } | Op::GatherSoftmax { .. } | Op::GatherSoftmaxGrad { .. } => {
                unreachable!("matrix products and attention are never fused")
            }
            Op::Unary { op, x } => Op::Unary { op, x: remap(&x) },
            Op::Binary { op, a, b } => Op::Binary { op, a: remap(&a), b: remap(&b) },
            Op::Slice { x, start, len } => Op::Slice { x: remap(&x), start, len },
            Op::Concat { parts } => Op::Concat { parts: parts.iter().map(remap).collect() },
            Op::SumCols { x } => Op::SumCols { x: remap(&x) },
            Op::MaxCols { x } => Op::MaxCols { x: remap(&x) },
            Op::BroadcastCols { x, cols } => Op::BroadcastCols { x: remap(&x), cols },
            load => load,
        };
        nodes.push(node);
        if role == Member::Stored {
            stores.push(l);
        }
    }
    Kernel { values: members.keys().map(|&v| ValueId(v as u32)).collect(), nodes, stores }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ops: Vec<String> = self
            .nodes
            .iter()
            .zip(&self.values)
            .enumerate()
            .map(|(l, (n, v))| format!("{v}{}={}", if self.stores.contains(&l) { "*" } else { "" }, n.op.name()))
            .collect();
        write!(f, "fused[{}]", ops.join(" "))
    }
}

impl fmt::Display for Plan {
    /// One line per step, by phase; stored values of a fused kernel carry a `*`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for p in PHASES {
            let steps = &self.phases[p as usize];
            if steps.is_empty() {
                continue;
            }
            writeln!(f, "  {p:?}:")?;
            for s in steps {
                match s {
                    Step::Gemms(vs) => {
                        let vs: Vec<String> = vs.iter().map(ToString::to_string).collect();
                        writeln!(f, "    gemm {}", vs.join(" "))?
                    }
                    Step::Fused(k) => writeln!(f, "    {k}")?,
                    Step::Attend(v) => writeln!(f, "    attend {v}")?,
                }
            }
        }
        Ok(())
    }
}
