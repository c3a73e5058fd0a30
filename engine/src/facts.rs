//! What the engine knows about each task before running it: which columns of every value of F
//! and F' are zero, which are needed, and from that how each matrix product runs there.
//!
//! Tasks with the same loads known to be zero (no child in a slot, padding inputs, no output
//! gradient) share their facts, so a minibatch analyses only a handful of patterns; the
//! [`FactCache`] keeps them across minibatches.

use super::fnv::FnvMap;
use arbor_core::backend::Gemm;
use arbor_core::fusion::{Kernel, Phase};
use arbor_core::ir::{Cols, Func, Op, ValueId, VertexFn};
use std::ops::Range;
use std::sync::Arc;

/// Zero and needed columns of every value of one function on one task.
#[derive(Debug)]
pub(crate) struct Facts {
    pub(crate) zero: Vec<Cols>,
    pub(crate) need: Vec<Cols>,
    /// Per value, whether any value of the function reads it.
    read: Vec<bool>,
    /// Per value, whether it is all zeros, and whether no column of it is needed.
    all_zero: Vec<bool>,
    none_needed: Vec<bool>,
    /// Per value, its columns not known to be zero, as runs.
    nonzero: Vec<Vec<Range<usize>>>,
    /// Per value, how it runs if it is a matrix product ([`Cut::Full`] for other values).
    cuts: Vec<Cut>,
}

impl Facts {
    fn new(func: &Func, zero: Vec<Cols>, need: Vec<Cols>) -> Facts {
        let read = func.users().iter().map(|u| !u.is_empty()).collect();
        let all_zero = zero.iter().map(Cols::is_full).collect();
        let none_needed = need.iter().map(Cols::is_empty).collect();
        let nonzero = zero.iter().map(|z| z.complement().ranges()).collect();
        let mut facts = Facts { zero, need, read, all_zero, none_needed, nonzero, cuts: Vec::new() };
        facts.cuts = (0..func.nodes.len()).map(|v| facts.find_cut(func, ValueId(v as u32))).collect();
        facts
    }

    /// Whether value `v` is all zeros.
    pub(crate) fn is_zero(&self, v: ValueId) -> bool {
        self.all_zero[v.index()]
    }

    /// Whether value `v` can be read as zeros: it is zero, or no column of it is needed (what
    /// reads it then either is not needed or multiplies it by zeros).
    pub(crate) fn reads_as_zero(&self, v: ValueId) -> bool {
        self.is_zero(v) || self.none_needed[v.index()]
    }

    /// Whether nothing needs value `v` (no column of it, and no value reads it).
    pub(crate) fn unused(&self, v: ValueId) -> bool {
        self.none_needed[v.index()] && !self.read[v.index()]
    }

    /// The columns of value `v` not known to be zero, as runs (empty: all zero).
    pub(crate) fn nonzero(&self, v: ValueId) -> &[Range<usize>] {
        &self.nonzero[v.index()]
    }

    /// How the product `v` runs on this task.
    pub(crate) fn cut(&self, v: ValueId) -> &Cut {
        &self.cuts[v.index()]
    }

    fn find_cut(&self, func: &Func, v: ValueId) -> Cut {
        let Op::MatMul { a, b, ta, .. } = func.node(v).op else { return Cut::Full };
        if self.unused(v) {
            return Cut::Skip;
        }
        let compute = self.need[v.index()].minus(&self.zero[v.index()]);
        if compute.is_empty() {
            return Cut::Zero;
        }
        // Only a product with a parameter on the right and A not transposed is narrowed; others
        // compute every column (exact values, just more work).
        let narrowable = !ta && func.node(b).is_param;
        if !narrowable || compute.is_full() && self.zero[a.index()].is_empty() {
            return Cut::Full;
        }
        let inner = self.zero[a.index()].complement();
        Cut::Cols { cols: compute.ranges(), zero: compute.complement().ranges(), inner: inner.ranges() }
    }
}

/// How a matrix product runs on a task.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Cut {
    /// Every column, the whole inner dimension.
    Full,
    /// All zeros (written as zeros).
    Zero,
    /// Not at all: nothing reads it.
    Skip,
    /// Columns `cols` over the inner ranges `inner` (summed), with the columns `zero` written
    /// as zeros.
    Cols {
        /// Output columns to compute.
        cols: Vec<Range<usize>>,
        /// Output columns to set to zero.
        zero: Vec<Range<usize>>,
        /// Ranges of the inner dimension where A is not known to be zero.
        inner: Vec<Range<usize>>,
    },
}

/// `g` restricted to the output columns `cols` and the inner range `inner` (A not transposed),
/// accumulating when `accumulate`.
pub(crate) fn narrow(g: &Gemm, cols: Range<usize>, inner: Range<usize>, accumulate: bool) -> Gemm {
    let b = if g.tb { cols.start * g.ldb + inner.start } else { inner.start * g.ldb + cols.start };
    Gemm {
        n: cols.len(),
        k: inner.len(),
        a: g.a.offset_by(inner.start),
        b: g.b.offset_by(b),
        c: g.c.offset_by(cols.start),
        accumulate,
        ..*g
    }
}

/// Per value of F and of F′, whether it must be written as zeros on a task where it is known to
/// be zero. A kernel that runs on that task alone reads zeros without them being written, and a
/// product reading it is known to be zero there too; anything else (a kernel over every task, a
/// parent's gather, a download to the host) reads memory.
pub(crate) fn must_fill(f: &VertexFn) -> (Vec<bool>, Vec<bool>) {
    let (fwd, bwd) = (f.forward(), &f.backward().func);
    let (fwd_plan, bwd_plan) = (f.forward_plan(), f.backward_plan());
    // Attention reads its operands from memory wherever it runs.
    let reads_memory = |func: &Func, phase: &[Phase], users: &[ValueId]| {
        users.iter().any(|u| {
            let op = &func.node(*u).op;
            op.is_attention() || !op.is_matmul() && phase[u.index()] != Phase::Recurrent
        })
    };
    let fwd_users = fwd.users();
    let mut fill_f: Vec<bool> = fwd_users.iter().map(|u| reads_memory(fwd, &fwd_plan.phase, u)).collect();
    for v in f.states().iter().map(|s| s.value).chain(f.outputs().iter().map(|o| o.value)) {
        fill_f[v.index()] = true;
    }
    let bwd_users = bwd.users();
    for (p, node) in bwd.nodes.iter().enumerate() {
        if let Op::Primal { value } = node.op {
            fill_f[value.index()] |= reads_memory(bwd, &bwd_plan.phase, &bwd_users[p]);
        }
    }
    let b = f.backward();
    let mut fill_b: Vec<bool> = bwd_users.iter().map(|u| reads_memory(bwd, &bwd_plan.phase, u)).collect();
    for g in b.pull_grads.iter().flatten() {
        fill_b[g.index()] = true;
    }
    for cg in &b.child_grads {
        fill_b[cg.value.index()] |= bwd_plan.phase[cg.value.index()] != Phase::Recurrent;
    }
    (fill_f, fill_b)
}

/// The stores of kernel `k` that need not be written on a task with facts `facts` (bit `j` for
/// `k.stores[j]`): values known to be zero there or not needed there, which nothing outside that
/// task's own kernels and products reads from memory (`fills`, see [`must_fill`]); those read
/// them as zeros. A kernel of more than 64 stores writes them all.
pub(crate) fn unread_stores(k: &Kernel, facts: &Facts, fills: &[bool]) -> u64 {
    if k.stores.len() > 64 {
        return 0;
    }
    let unread = |l: usize| {
        let v = k.values[l];
        !fills[v.index()] && facts.reads_as_zero(v)
    };
    k.stores.iter().enumerate().filter(|&(_, &l)| unread(l)).fold(0, |m, (j, _)| m | 1 << j)
}

/// Which loads of a function are all zeros on a task, by value (false for other values).
pub(crate) type Loads = Vec<bool>;

/// Facts by load pattern, kept across minibatches.
#[derive(Default)]
pub(crate) struct FactCache {
    /// F's facts by which of F's loads are zero, for inference and for training.
    forward: [FnvMap<Loads, Arc<Facts>>; 2],
    /// F′'s facts by which loads of F, then of F′, are zero (one pattern after the other).
    backward: FnvMap<Loads, Arc<Facts>>,
    /// The key of the last backward lookup.
    key: Loads,
}

impl FactCache {
    /// F's facts on a task whose F loads `loads` are zero; `train` adds what F' will need of it.
    pub(crate) fn forward(&mut self, f: &VertexFn, loads: &Loads, train: bool, skip_padding: bool) -> Arc<Facts> {
        let cache = &mut self.forward[usize::from(train)];
        if let Some(facts) = cache.get(loads) {
            return Arc::clone(facts);
        }
        Arc::clone(cache.entry(loads.clone()).or_insert_with(|| {
            let zero = forward_zeros(f, loads);
            let mut need: Vec<Cols> = f.forward().nodes.iter().map(|n| Cols::none(n.shape.cols())).collect();
            for v in f.states().iter().map(|s| s.value).chain(f.outputs().iter().map(|o| o.value)) {
                need[v.index()] = Cols::all(f.forward().node(v).shape.cols());
            }
            if train {
                // Output gradients are not known yet: assume every one may be non-zero (F' then
                // needs at least as much as it will).
                let none = vec![false; f.backward().func.nodes.len()];
                let b = backward_facts(f, &zero, loads, &none, skip_padding);
                for (node, need_b) in f.backward().func.nodes.iter().zip(&b.need) {
                    if let Op::Primal { value } = node.op {
                        need[value.index()].add_at(need_b, 0);
                    }
                }
            }
            let need = f.forward().needed_columns(&zero, need);
            Arc::new(Facts::new(f.forward(), zero, need))
        }))
    }

    /// F′'s facts on a task whose F loads `loads` and F′ loads `grad_loads` are zero.
    pub(crate) fn backward(
        &mut self,
        f: &VertexFn,
        loads: &Loads,
        grad_loads: &Loads,
        skip_padding: bool,
    ) -> Arc<Facts> {
        self.key.clear();
        self.key.extend_from_slice(loads);
        self.key.extend_from_slice(grad_loads);
        if let Some(facts) = self.backward.get(&self.key) {
            return Arc::clone(facts);
        }
        Arc::clone(
            self.backward.entry(self.key.clone()).or_insert_with(|| {
                Arc::new(backward_facts(f, &forward_zeros(f, loads), loads, grad_loads, skip_padding))
            }),
        )
    }

    /// Forgets everything (the padding setting changed).
    pub(crate) fn clear(&mut self) {
        self.forward.iter_mut().for_each(FnvMap::clear);
        self.backward.clear();
    }
}

fn forward_zeros(f: &VertexFn, loads: &Loads) -> Vec<Cols> {
    f.forward().zero_columns(|v, _| Cols::all_if(loads[v.index()], f.forward().node(v).shape.cols()))
}

/// F′'s facts given F's zero columns: it must produce the children's gradients where the task
/// has children in that slot, the inputs' gradients unless they are padding (when
/// `skip_padding`), and every parameter gradient's factors.
fn backward_facts(f: &VertexFn, fwd_zero: &[Cols], loads: &Loads, grad_loads: &Loads, skip_padding: bool) -> Facts {
    let b = f.backward();
    let func = &b.func;
    let width = |v: ValueId| func.node(v).shape.cols();
    let zero = func.zero_columns(|v, op| match *op {
        Op::Primal { value } => fwd_zero[value.index()].clone(),
        _ => Cols::all_if(grad_loads[v.index()], width(v)),
    });
    let mut need: Vec<Cols> = func.nodes.iter().map(|n| Cols::none(n.shape.cols())).collect();
    let fwd = f.forward();
    // A gather of every child (of one label) known to be zero: no such child on the task.
    let has_children = |slot: Option<usize>, label: Option<u32>| {
        !fwd.nodes.iter().enumerate().any(|(i, n)| match n.op {
            Op::Gather { slot: s, .. } => Some(s) == slot && loads[i],
            Op::GatherAll { label: l, .. } => slot.is_none() && l == label && loads[i],
            _ => false,
        })
    };
    for cg in &b.child_grads {
        if has_children(cg.slot, cg.label) {
            need[cg.value.index()] = Cols::all(width(cg.value));
        }
    }
    if has_children(None, None) {
        for &g in &b.edge_grads {
            need[g.index()] = Cols::all(width(g));
        }
    }
    let users = func.users();
    for (i, g) in b.pull_grads.iter().enumerate() {
        let Some(g) = *g else { continue };
        let padding =
            fwd.nodes.iter().enumerate().any(|(j, n)| matches!(n.op, Op::Pull { input } if input == i) && loads[j]);
        if !(skip_padding && padding && users[g.index()].is_empty()) {
            need[g.index()] = Cols::all(width(g));
        }
    }
    for pg in &b.param_grads {
        match *pg {
            arbor_core::ir::ParamGrad::MatMul { x, dy, .. } => {
                need[x.index()] = Cols::all(width(x));
                need[dy.index()] = Cols::all(width(dy));
            }
            arbor_core::ir::ParamGrad::SumRows { dy, .. } => need[dy.index()] = Cols::all(width(dy)),
        }
    }
    let need = func.needed_columns(&zero, need);
    Facts::new(func, zero, need)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_core::fusion::Step;

    /// The fused kernels of `plan`'s recurrent phase.
    fn kernels(plan: &arbor_core::fusion::Plan) -> Vec<&Kernel> {
        let steps = &plan.phases[Phase::Recurrent as usize];
        steps.iter().filter_map(|s| if let Step::Fused(k) = s { Some(k) } else { None }).collect()
    }

    /// The values of the stores `mask` selects.
    fn named(k: &Kernel, mask: u64) -> Vec<String> {
        k.stores
            .iter()
            .enumerate()
            .filter(|&(j, _)| mask >> j & 1 == 1)
            .map(|(_, &l)| k.values[l].to_string())
            .collect()
    }

    /// On a Tree-LSTM's leaves the children's copied states (zeros) and the forget gates (which
    /// scale missing cells) are not stored, nor the gradients for missing children; internal
    /// vertices store everything.
    #[test]
    fn leaves_leave_out_what_no_one_reads() {
        let f = arbor::nn::tree_lstm(6, 5).unwrap();
        let fwd = f.forward();
        let gathers: Loads = fwd.nodes.iter().map(|n| matches!(n.op, Op::Gather { .. })).collect();
        let pads: Loads = fwd.nodes.iter().map(|n| matches!(n.op, Op::Pull { .. })).collect();
        let (fill_f, fill_b) = must_fill(&f);
        let mut cache = FactCache::default();
        let grads = vec![false; f.backward().func.nodes.len()];
        let [gather, cell] = kernels(f.forward_plan())[..] else { panic!("two forward kernels") };
        let [backward] = kernels(f.backward_plan())[..] else { panic!("one backward kernel") };

        let leaf = cache.forward(&f, &gathers, true, false);
        // (The children's `c` are not copied at all: F′ reads them by index.)
        assert_eq!(named(gather, unread_stores(gather, &leaf, &fill_f)), ["%1", "%3"]);
        assert_eq!(named(cell, unread_stores(cell, &leaf, &fill_f)), ["%22", "%24"]);
        let leaf_b = cache.backward(&f, &gathers, &grads, false);
        let child_grads: Vec<String> = f.backward().child_grads.iter().map(|g| g.value.to_string()).collect();
        let mut unread = named(backward, unread_stores(backward, &leaf_b, &fill_b));
        unread.sort();
        let mut dc: Vec<String> = child_grads
            .into_iter()
            .filter(|v| backward.stores.iter().any(|&l| backward.values[l].to_string() == *v))
            .collect();
        dc.sort();
        assert_eq!(unread, dc, "a leaf's backward kernel leaves out exactly its stored child gradients");
        assert_eq!(dc.len(), 2);

        let inner = cache.forward(&f, &pads, true, false);
        let inner_b = cache.backward(&f, &pads, &grads, false);
        assert_eq!(unread_stores(gather, &inner, &fill_f), 0);
        assert_eq!(unread_stores(cell, &inner, &fill_f), 0);
        assert_eq!(unread_stores(backward, &inner_b, &fill_b), 0);
    }
}
