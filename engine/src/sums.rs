//! Sums of sibling products. Where F adds two products that run in one step of the recurrent
//! phase (the Tree-LSTM's `h₀·U₀ + h₁·U₁`) and nothing else reads either of them (or the partial
//! sum), the second product accumulates into the first one's output. The fused kernel after them
//! then reads one product instead of two and skips one add over the products' full width.

use arbor_core::fusion::{Phase, Plan, Step};
use arbor_core::ir::{BinaryOp, Op, ValueId, VertexFn};

/// Which products of F accumulate into a sibling's output, both ways round.
#[derive(Debug, Default)]
pub(super) struct Sums {
    /// Per value: the product it accumulates into instead of its own output.
    target: Vec<Option<ValueId>>,
    /// Per value: the product accumulating into its output.
    source: Vec<Option<ValueId>>,
}

impl Sums {
    /// The sums of `f`'s forward function among the products not `claimed` (per value) by
    /// another pass.
    pub(super) fn new(f: &VertexFn, claimed: &[bool]) -> Sums {
        let target = accumulated_into(f, claimed);
        let mut source = vec![None; target.len()];
        for (p2, p1) in target.iter().enumerate() {
            if let Some(p1) = p1 {
                source[p1.index()] = Some(ValueId(p2 as u32));
            }
        }
        Sums { target, source }
    }

    /// The product `v` accumulates into, if any.
    pub(super) fn target(&self, v: ValueId) -> Option<ValueId> {
        self.target[v.index()]
    }

    /// The product accumulating into `v`, if any.
    pub(super) fn source(&self, v: ValueId) -> Option<ValueId> {
        self.source[v.index()]
    }
}

/// Per value of F: the product it accumulates into instead of its own output, if any (never a
/// `claimed` one).
fn accumulated_into(f: &VertexFn, claimed: &[bool]) -> Vec<Option<ValueId>> {
    let func = f.forward();
    let users = func.users();
    let kept: Vec<ValueId> = f
        .backward()
        .saved
        .iter()
        .copied()
        .chain(f.states().iter().map(|s| s.value))
        .chain(f.outputs().iter().map(|o| o.value))
        .collect();
    // Read only by `by`, and not kept for backward or handed out.
    let private = |v: ValueId, by: ValueId| users[v.index()] == [by] && !kept.contains(&v);
    let mut into = vec![None; func.nodes.len()];
    for (s, node) in func.nodes.iter().enumerate() {
        let s = ValueId(s as u32);
        let Op::Binary { op: BinaryOp::Add, a, b } = node.op else { continue };
        for (q, p2) in [(a, b), (b, a)] {
            // `q` is the first product, or a private sum of it with something else.
            let firsts = match func.node(q).op {
                Op::MatMul { .. } => vec![q],
                Op::Binary { op: BinaryOp::Add, a: x, b: y } if private(q, s) => vec![x, y],
                _ => Vec::new(),
            };
            let sibling = |p1: ValueId| {
                p1 != p2
                    && [p1, p2].iter().all(|&p| func.node(p).op.is_matmul() && !claimed[p.index()])
                    && private(p2, s)
                    && private(p1, if p1 == q { s } else { q })
                    && func.node(p1).shape == func.node(p2).shape
                    && [p1, p2].iter().all(|&p| into[p.index()].is_none() && !into.contains(&Some(p)))
                    && [f.forward_plan(), f.inference_plan()].iter().all(|plan| same_recurrent_step(plan, p1, p2))
            };
            if let Some(p1) = firsts.into_iter().find(|&p1| sibling(p1)) {
                into[p2.index()] = Some(p1);
                break;
            }
        }
    }
    into
}

/// Whether `p1` and `p2` are computed by one product step of `plan`'s recurrent phase.
fn same_recurrent_step(plan: &Plan, p1: ValueId, p2: ValueId) -> bool {
    plan.phases[Phase::Recurrent as usize]
        .iter()
        .any(|s| matches!(s, Step::Gemms(vs) if vs.contains(&p1) && vs.contains(&p2)))
}
