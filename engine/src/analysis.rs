//! What the engine works out once per vertex function, before any minibatch: where the
//! parameters are, which values must be written as zeros, the fused kernels of its plans, and
//! which pass claims each product of F. That last decision is made here and only here: a
//! product of a pulled input with a parameter runs over the input's distinct rows ([`dedup`]);
//! of the others, a sibling may accumulate into its output ([`sums`]); a product over distinct
//! rows that only fused kernels read may stay where it was computed and be read by index.

use super::dedup;
use super::facts;
use super::fnv::FnvMap;
use super::sums::Sums;
use arbor_batching::MemoryLayout;
use arbor_core::fusion::{Kernel, Phase, Plan, Step};
use arbor_core::ir::{Op, ParamGrad, Reduce, ValueId, VertexFn};
use std::sync::{Arc, OnceLock};

/// Which plan of the vertex function a fused kernel comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlanKind {
    /// F, keeping what F′ needs.
    Forward,
    /// F for inference.
    Inference,
    /// F′.
    Backward,
}

impl PlanKind {
    /// The plan of `f` this names.
    pub(super) fn of(self, f: &VertexFn) -> &Plan {
        match self {
            PlanKind::Forward => f.forward_plan(),
            PlanKind::Inference => f.inference_plan(),
            PlanKind::Backward => f.backward_plan(),
        }
    }

    /// A short name for listings.
    pub(super) fn name(self) -> &'static str {
        match self {
            PlanKind::Forward => "forward",
            PlanKind::Inference => "inference",
            PlanKind::Backward => "backward",
        }
    }
}

/// One fused step of one plan: which plan, which phase, which step of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepRef {
    /// The plan.
    pub plan: PlanKind,
    /// Its phase.
    pub phase: Phase,
    /// The step's index in the phase.
    pub step: usize,
}

/// The per-function facts the lowering reads.
pub(super) struct Analysis {
    pub f: Arc<VertexFn>,
    /// Per parameter, where its values start in the parameter buffer (and its gradient in the
    /// gradient buffer); `params_len` values in all.
    pub param_at: Vec<usize>,
    pub params_len: usize,
    /// Per value of F and of F′: written as zeros where known to be zero (see [`facts::must_fill`]).
    pub must_fill: (Vec<bool>, Vec<bool>),
    /// Every fused step of the three plans.
    pub kernels: FnvMap<StepRef, Arc<Kernel>>,
    /// Products of F accumulating into a sibling's output.
    pub sums: Sums,
    /// Per value of F: a product over distinct rows that fused kernels may read where it was
    /// computed, by index.
    pub by_index: Vec<bool>,
    /// Per value of F, for inference and for training (by `train`): a child's state that only
    /// products read from memory (fused kernels read it by index), as their left factor over a
    /// parameter, so a product may read it where the child's state is instead of from a copy
    /// (see [`read_in_place`]).
    pub in_place: [Vec<bool>; 2],
    /// Per input: whether a forward product reads it as its left factor.
    pub pulled_factor: Vec<bool>,
    /// Per input: whether anything reads its rows one per vertex (see [`dedup::rows_read`]); a
    /// looked-up input's rows are copied to the vertices only then.
    pub rows_read: Vec<bool>,
    /// Per input whose gradient is `dy·Wᵀ` for a parameter gradient `xᵀ·dy` over it: that
    /// parameter gradient (index into F′'s), through which a looked-up input's table gradient
    /// is formed per distinct row.
    pub table_grad_via: Vec<Option<usize>>,
    /// Scratch columns per distinct row: the widest set of products over one input that run
    /// together, or the widest output gradient a parameter gradient sums per distinct row.
    pub shared_width: usize,
    /// The edge labels F gathers children by (`gather_labelled`), ascending.
    pub edge_labels: Vec<u32>,
    /// The edge features F weighs children by (`gather_weighted`), ascending.
    pub edge_features: Vec<u32>,
    /// The arena's layout for inference and for training, made on first use.
    layouts: [OnceLock<MemoryLayout>; 2],
}

impl Analysis {
    /// The analysis of `f`.
    pub(super) fn new(f: Arc<VertexFn>) -> Analysis {
        let mut param_at = Vec::with_capacity(f.params().len());
        let mut params_len = 0;
        for p in f.params() {
            param_at.push(params_len);
            params_len += p.shape.numel();
        }
        let fwd = f.forward();
        let mut pulled_factor = vec![false; f.all_inputs().len()];
        let mut claimed = vec![false; fwd.nodes.len()];
        let mut shared_width = 0;
        for v in (0..fwd.nodes.len()).map(|v| ValueId(v as u32)) {
            if let Some(i) = dedup::pulled_factor(fwd, v) {
                pulled_factor[i] = true;
                claimed[v.index()] = true;
                shared_width += fwd.node(v).shape.numel();
            }
        }
        for pg in &f.backward().param_grads {
            if let ParamGrad::MatMul { dy, .. } = *pg {
                shared_width = shared_width.max(f.backward().func.node(dy).shape.numel());
            }
        }
        let sums = Sums::new(&f, &claimed);
        let by_index = read_by_index(&f, &claimed, &sums);
        let mut kernels = FnvMap::default();
        for plan in [PlanKind::Forward, PlanKind::Inference, PlanKind::Backward] {
            for phase in [Phase::Prologue, Phase::Recurrent, Phase::Epilogue] {
                for (step, s) in plan.of(&f).phases[phase as usize].iter().enumerate() {
                    if let Step::Fused(k) = s {
                        kernels.insert(StepRef { plan, phase, step }, Arc::new(k.clone()));
                    }
                }
            }
        }
        Analysis {
            param_at,
            params_len,
            must_fill: facts::must_fill(&f),
            kernels,
            sums,
            by_index,
            in_place: [false, true].map(|train| read_in_place(&f, train)),
            pulled_factor,
            rows_read: (0..f.all_inputs().len()).map(|i| dedup::rows_read(&f, i)).collect(),
            table_grad_via: (0..f.all_inputs().len()).map(|i| table_grad_via(&f, i)).collect(),
            shared_width,
            edge_labels: edge_keys(&f, |label, _| label),
            edge_features: edge_keys(&f, |_, reduce| reduce.feature()),
            layouts: Default::default(),
            f,
        }
    }

    /// The arena's layout for a training (`train`) or inference minibatch.
    pub fn layout(&self, train: bool) -> &MemoryLayout {
        self.layouts[usize::from(train)].get_or_init(|| MemoryLayout::new(&self.f, train))
    }
}

/// Per value of F: a product over a pulled input's distinct rows (`claimed`) that only F's fused
/// kernels read, so it can stay in scratch and be read there by index instead of being copied to
/// every vertex's row. Not when it is a state or an output, a factor of another product, a value
/// F′ reads, or summed with a sibling product.
fn read_by_index(f: &VertexFn, claimed: &[bool], sums: &Sums) -> Vec<bool> {
    let fwd = f.forward();
    let mut ok: Vec<bool> = (0..fwd.nodes.len())
        .map(|v| {
            let v = ValueId(v as u32);
            claimed[v.index()] && sums.target(v).is_none() && sums.source(v).is_none()
        })
        .collect();
    let mut not = |v: ValueId| ok[v.index()] = false;
    f.states().iter().for_each(|s| not(s.value));
    f.outputs().iter().for_each(|o| not(o.value));
    for n in &fwd.nodes {
        if let Op::MatMul { a, b, .. } = n.op {
            not(a);
            not(b);
        }
    }
    for n in &f.backward().func.nodes {
        if let Op::Primal { value } = n.op {
            not(value);
        }
    }
    ok
}

/// Per value of F: a gathered child's state (one row per vertex) that only products read from
/// memory (fused kernels load it by index), each as its untransposed left factor over a
/// parameter, and that is neither a state nor an output (nor, when `train`, a value F′ reads).
/// Where a task's children lie evenly spaced in that state's rows, those products read them
/// there and the copy is not written ([`Lowering::gathered_in_place`](super::Lowering)).
fn read_in_place(f: &VertexFn, train: bool) -> Vec<bool> {
    let fwd = f.forward();
    let mut ok: Vec<bool> =
        fwd.nodes.iter().map(|n| matches!(n.op, Op::Gather { .. }) && n.shape.rows() == 1).collect();
    let mut not = |v: ValueId| ok[v.index()] = false;
    f.states().iter().for_each(|s| not(s.value));
    f.outputs().iter().for_each(|o| not(o.value));
    for n in &fwd.nodes {
        match n.op {
            Op::MatMul { b, ta: false, .. } if fwd.node(b).is_param => not(b),
            ref op if op.is_standalone() => op.inputs().into_iter().for_each(&mut not),
            _ => {}
        }
    }
    if train {
        for n in &f.backward().func.nodes {
            if let Op::Primal { value } = n.op {
                not(value);
            }
        }
    }
    ok
}

/// The parameter gradient `xᵀ·dy` (index into F′'s) whose `dy` gives the gradient of input
/// `input` as `dy·Wᵀ`, if it is formed that way.
fn table_grad_via(f: &VertexFn, input: usize) -> Option<usize> {
    let b = f.backward();
    let Op::MatMul { a: dy, b: w, ta: false, tb: true } = b.func.node(b.pull_grads[input]?).op else { return None };
    let Op::Param { param } = b.func.node(w).op else { return None };
    b.param_grads.iter().position(|pg| match *pg {
        ParamGrad::MatMul { param: p, x, dy: d } => {
            p == param
                && d == dy
                && matches!(b.func.node(x).op, Op::Primal { value } if f.forward().node(value).op == Op::Pull { input })
        }
        ParamGrad::SumRows { .. } => false,
    })
}

/// What `f`'s gathers over all children name of the edges (`part` of each: a label, a
/// weighing feature), ascending, each once.
fn edge_keys(f: &VertexFn, part: impl Fn(Option<u32>, Reduce) -> Option<u32>) -> Vec<u32> {
    let mut keys: Vec<u32> = f
        .forward()
        .nodes
        .iter()
        .filter_map(|n| match n.op {
            Op::GatherAll { label, reduce, .. } => part(label, reduce),
            _ => None,
        })
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}
