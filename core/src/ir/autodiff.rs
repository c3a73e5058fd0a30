//! Symbolic differentiation of a vertex function F into its backward function F'.
//!
//! F' is IR like F. It reads the forward values it needs (`Primal`), the gradient of each scattered
//! state summed over the vertex's parents (`StateGrad`) and the gradient of each pushed output
//! (`PushGrad`). It yields the gradient of every gathered state (scatter-added into the child),
//! of every pulled input, and, for every parameter use, the per-vertex rows from which the engine
//! forms the parameter gradient in one batched operation over all vertices.

use super::declaration::Declaration;
use super::elementwise::Derive;
use super::func::Func;
use super::op::{BinaryOp, Op, Reduce, UnaryOp, ValueId};
use crate::error::{Error, Result};
use std::collections::HashMap;

/// A gradient that leaves the vertex for a child.
#[derive(Clone, Debug, PartialEq)]
pub struct ChildGrad {
    /// The child slot (`None`: every child, from `gather_sum`, `gather_mean` or `gather_max`).
    pub slot: Option<usize>,
    /// For every child: how the gradient is shared among them (the forward reduction).
    pub reduce: Reduce,
    /// For every child: only those whose edge carries this label.
    pub label: Option<u32>,
    /// The state whose gradient this is.
    pub state: usize,
    /// The gradient value in F'.
    pub value: ValueId,
}

/// One term of a parameter's gradient, summed over all vertices by the engine.
#[derive(Clone, Debug, PartialEq)]
pub enum ParamGrad {
    /// `dW += Xᵀ · dY` over the rows of all vertices (from `x · W`).
    MatMul {
        /// The parameter.
        param: usize,
        /// The forward input rows (a `Primal` value of F').
        x: ValueId,
        /// The output-gradient rows (a value of F').
        dy: ValueId,
    },
    /// `dP += Σ rows of dY`, folding each vertex block onto the parameter's shape (from a
    /// broadcast parameter operand of an element-wise op).
    SumRows {
        /// The parameter.
        param: usize,
        /// The gradient rows (a value of F').
        dy: ValueId,
    },
}

impl ParamGrad {
    /// The parameter this term belongs to.
    pub fn param(&self) -> usize {
        match self {
            ParamGrad::MatMul { param, .. } | ParamGrad::SumRows { param, .. } => *param,
        }
    }
}

/// The backward function F' of a vertex function.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Backward {
    /// The IR of F'.
    pub func: Func,
    /// Gradients sent to children.
    pub child_grads: Vec<ChildGrad>,
    /// Attention's gradient steps ([`Op::GatherSoftmaxGrad`]): each also adds gradients to its
    /// children's states, so it runs before them whether or not its own value is used.
    pub edge_grads: Vec<ValueId>,
    /// Gradient of each pulled input (`None`: it does not affect the outputs).
    pub pull_grads: Vec<Option<ValueId>>,
    /// Parameter-gradient terms.
    pub param_grads: Vec<ParamGrad>,
    /// Forward values F' reads (they must be kept from the forward pass).
    pub saved: Vec<ValueId>,
}

/// A gradient contribution to one forward value.
enum Contrib {
    Full(ValueId),
    Cols { start: usize, grad: ValueId },
}

struct Deriver<'a> {
    f: &'a Declaration,
    out: Func,
    primal: HashMap<ValueId, ValueId>,
    zeros: HashMap<(usize, usize), ValueId>,
}

impl Deriver<'_> {
    fn emit(&mut self, op: Op) -> Result<ValueId> {
        let name = op.name();
        self.out.push(op).map_err(|reason| Error::Shape {
            at: None,
            function: format!("{} (backward)", self.f.name),
            op: name,
            inputs: vec![],
            reason,
        })
    }

    fn load(&mut self, op: Op, shape: crate::tensor::Shape, is_param: bool) -> ValueId {
        self.out.nodes.push(super::func::Node { op, shape, is_param });
        ValueId(self.out.nodes.len() as u32 - 1)
    }

    /// The forward value `v` inside F' (a parameter stays a parameter).
    fn primal_of(&mut self, v: ValueId) -> ValueId {
        if let Some(&p) = self.primal.get(&v) {
            return p;
        }
        let n = self.f.forward.node(v).clone();
        let op = match n.op {
            Op::Param { param } => Op::Param { param },
            _ => Op::Primal { value: v },
        };
        let p = self.load(op, n.shape, n.is_param);
        self.primal.insert(v, p);
        p
    }

    fn zeros(&mut self, rows: usize, cols: usize) -> ValueId {
        if let Some(&z) = self.zeros.get(&(rows, cols)) {
            return z;
        }
        let z = self.load(Op::Zeros, crate::tensor::Shape::mat(rows, cols), false);
        self.zeros.insert((rows, cols), z);
        z
    }

    /// Sums the contributions to a value of per-vertex shape `[rows × cols]` into one gradient.
    fn total(&mut self, contribs: Vec<Contrib>, rows: usize, cols: usize) -> Result<ValueId> {
        let mut full = Vec::new();
        let mut pieces = Vec::new();
        for c in contribs {
            match c {
                Contrib::Full(g) => full.push(g),
                Contrib::Cols { start, grad } => {
                    let width = self.out.node(grad).shape.cols();
                    if start == 0 && width == cols {
                        full.push(grad);
                    } else {
                        pieces.push((start, width, grad));
                    }
                }
            }
        }
        pieces.sort_by_key(|p| p.0);
        // Disjoint column pieces become one concatenation; overlapping ones a concatenation each.
        let mut groups: Vec<Vec<(usize, usize, ValueId)>> = Vec::new();
        for p in pieces {
            let fits = groups.last().and_then(|g| g.last()).is_some_and(|last| last.0 + last.1 <= p.0);
            match groups.last_mut() {
                Some(g) if fits => g.push(p),
                _ => groups.push(vec![p]),
            }
        }
        for g in groups {
            let mut parts = Vec::new();
            let mut at = 0;
            for (start, width, grad) in g {
                if start > at {
                    parts.push(self.zeros(rows, start - at));
                }
                parts.push(grad);
                at = start + width;
            }
            if at < cols {
                parts.push(self.zeros(rows, cols - at));
            }
            full.push(if parts.len() == 1 { parts[0] } else { self.emit(Op::Concat { parts })? });
        }
        let mut sum = full[0];
        for &g in &full[1..] {
            sum = self.binary(BinaryOp::Add, sum, g)?;
        }
        Ok(sum)
    }
}

impl Derive for Deriver<'_> {
    fn primal(&mut self, v: ValueId) -> ValueId {
        self.primal_of(v)
    }

    fn unary(&mut self, op: UnaryOp, x: ValueId) -> Result<ValueId> {
        self.emit(Op::Unary { op, x })
    }

    fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.emit(Op::Binary { op, a, b })
    }
}

/// Derives F' from F.
pub(crate) fn derive(f: &Declaration) -> Result<Backward> {
    let fwd = &f.forward;
    let mut d = Deriver { f, out: Func::default(), primal: HashMap::new(), zeros: HashMap::new() };
    let mut contribs: Vec<Vec<Contrib>> = (0..fwd.nodes.len()).map(|_| Vec::new()).collect();
    let mut back = Backward { pull_grads: vec![None; f.inputs.len()], ..Backward::default() };

    for (s, st) in f.states.iter().enumerate() {
        if st.gathered {
            let g = d.load(Op::StateGrad { state: s }, st.shape.clone(), false);
            contribs[st.value.index()].push(Contrib::Full(g));
        }
    }
    for (o, out) in f.outputs.iter().enumerate() {
        let g = d.load(Op::PushGrad { output: o }, out.shape.clone(), false);
        contribs[out.value.index()].push(Contrib::Full(g));
    }

    for i in (0..fwd.nodes.len()).rev() {
        let v = ValueId(i as u32);
        let node = &fwd.nodes[i];
        let cs = std::mem::take(&mut contribs[i]);
        if cs.is_empty() || node.is_param {
            continue;
        }
        let g = d.total(cs, node.shape.rows(), node.shape.cols())?;
        match node.op {
            Op::Gather { slot, state } => {
                back.child_grads.push(ChildGrad { slot: Some(slot), reduce: Reduce::Sum, label: None, state, value: g })
            }
            Op::GatherAll { state, reduce, label } => {
                back.child_grads.push(ChildGrad { slot: None, reduce, label, state, value: g })
            }
            // A dropout mask is a constant: no gradient.
            Op::Pull { input } if input < f.inputs.len() - f.dropout.len() => back.pull_grads[input] = Some(g),
            Op::Pull { .. } => {}
            Op::MatMul { a, b, .. } => {
                let bp = d.primal(b);
                let da = d.emit(Op::MatMul { a: g, b: bp, ta: false, tb: true })?;
                contribs[a.index()].push(Contrib::Full(da));
                let ap = d.primal(a);
                match fwd.node(b).op {
                    Op::Param { param } => back.param_grads.push(ParamGrad::MatMul { param, x: ap, dy: g }),
                    _ => {
                        let db = d.emit(Op::MatMul { a: ap, b: g, ta: true, tb: false })?;
                        contribs[b.index()].push(Contrib::Full(db));
                    }
                }
            }
            Op::GatherSoftmax { query, key, value, slope } => {
                let q = d.primal(query);
                let dq = d.emit(Op::GatherSoftmaxGrad { query: q, grad: g, key, value, slope })?;
                back.edge_grads.push(dq);
                contribs[query.index()].push(Contrib::Full(dq));
            }
            // A stop-gradient: nothing flows back through it.
            Op::Unary { op: UnaryOp::Detach, .. } => {}
            Op::Unary { op, x } => {
                let dx = op.derivative(&mut d, x, v, g)?;
                contribs[x.index()].push(Contrib::Full(dx));
            }
            Op::Binary { op, a, b } => {
                let Some((da, db)) = op.derivative(&mut d, a, b, v, g)? else {
                    return Err(Error::Shape {
                        at: None,
                        function: f.name.clone(),
                        op: op.name().into(),
                        inputs: vec![],
                        reason: "backward-only ops cannot be differentiated".into(),
                    });
                };
                for (operand, grad) in [(a, da), (b, db)] {
                    match fwd.node(operand).op {
                        Op::Param { param } => back.param_grads.push(ParamGrad::SumRows { param, dy: grad }),
                        _ => contribs[operand.index()].push(Contrib::Full(grad)),
                    }
                }
            }
            Op::Slice { x, start, .. } => contribs[x.index()].push(Contrib::Cols { start, grad: g }),
            Op::Concat { ref parts } => {
                let mut at = 0;
                for &p in parts {
                    let len = fwd.node(p).shape.cols();
                    let gp = d.emit(Op::Slice { x: g, start: at, len })?;
                    contribs[p.index()].push(Contrib::Full(gp));
                    at += len;
                }
            }
            Op::SumCols { x } => {
                let cols = fwd.node(x).shape.cols();
                let gx = d.emit(Op::BroadcastCols { x: g, cols })?;
                contribs[x.index()].push(Contrib::Full(gx));
            }
            Op::BroadcastCols { x, .. } => {
                let gx = d.emit(Op::SumCols { x: g })?;
                contribs[x.index()].push(Contrib::Full(gx));
            }
            Op::Param { .. }
            | Op::Primal { .. }
            | Op::StateGrad { .. }
            | Op::PushGrad { .. }
            | Op::Zeros
            | Op::Stored { .. }
            | Op::GatherSoftmaxGrad { .. }
            | Op::MaxCols { .. } => {}
        }
    }
    let mut saved: Vec<ValueId> = d.primal.keys().filter(|v| !fwd.node(**v).is_param).copied().collect();
    saved.sort();
    back.saved = saved;
    back.func = d.out;
    Ok(back)
}
