//! The ops of the vertex-function IR. Element-wise ops are defined in
//! [`elementwise`](super::elementwise), one file each.

pub use super::elementwise::{BinaryOp, UnaryOp};
use smallvec::{smallvec, SmallVec};
use std::fmt;

/// How a vertex combines the rows its children scattered when it reads all of them, whatever
/// their number: element by element, each column on its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reduce {
    /// The sum (`gather_sum`); its gradient reaches every child.
    #[default]
    Sum,
    /// The sum divided by the number of children (`gather_mean`); its gradient reaches every
    /// child, divided likewise.
    Mean,
    /// The largest (`gather_max`); its gradient reaches, in each column, the first child holding
    /// the largest value there.
    Max,
    /// The sum with each child's row times value `feature` of its edge's feature row
    /// (`gather_weighted`: [`InputGraph::with_edge_features`](crate::graph::InputGraph::with_edge_features));
    /// its gradient reaches every child times the same value. The edge values are data: no
    /// gradient reaches them.
    Weighted {
        /// Which value of an edge's feature row weighs its child.
        feature: u32,
    },
}

impl Reduce {
    /// Every reduction that reads nothing of the edges.
    pub const ALL: [Reduce; 3] = [Reduce::Sum, Reduce::Mean, Reduce::Max];

    /// The builder method's name: `gather_sum`, `gather_mean`, `gather_max` or `gather_weighted`.
    pub fn name(self) -> &'static str {
        match self {
            Reduce::Sum => "gather_sum",
            Reduce::Mean => "gather_mean",
            Reduce::Max => "gather_max",
            Reduce::Weighted { .. } => "gather_weighted",
        }
    }

    /// The edge feature this reduction weighs children by, if it does.
    pub fn feature(self) -> Option<u32> {
        match self {
            Reduce::Weighted { feature } => Some(feature),
            _ => None,
        }
    }
}

/// Index of a value in a function's value list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl ValueId {
    /// The index as `usize`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One node of a vertex function (forward F or derived backward F').
///
/// Every vertex value has a per-vertex shape `[r × c]`; over a batch of `n` vertices it is stored
/// as an `[n·r × c]` row-major matrix, one contiguous `r·c` block per vertex.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// The state `state` scattered by the child in slot `slot` (zeros when that child is missing).
    Gather {
        /// Child slot.
        slot: usize,
        /// State index.
        state: usize,
    },
    /// The state `state` of every child (of those whose edge carries `label`, when given),
    /// combined by `reduce` (zeros when there is none).
    GatherAll {
        /// State index.
        state: usize,
        /// How the children's rows combine.
        reduce: Reduce,
        /// Only the children whose edge carries this label.
        label: Option<u32>,
    },
    /// This vertex's row of external input `input`.
    Pull {
        /// Input index.
        input: usize,
    },
    /// A parameter, shared by every vertex.
    Param {
        /// Parameter index.
        param: usize,
    },
    /// Backward only: the forward value `value` of this vertex.
    Primal {
        /// The forward function's value.
        value: ValueId,
    },
    /// Backward only: the gradient of this vertex's scattered state, summed over its parents.
    StateGrad {
        /// State index.
        state: usize,
    },
    /// Backward only: the gradient of this vertex's pushed output `output`.
    PushGrad {
        /// Output index.
        output: usize,
    },
    /// Backward only: zeros.
    Zeros,
    /// Fused kernels only: a value an earlier step stored in memory.
    Stored {
        /// The function's value.
        value: ValueId,
    },
    /// `op(a) · op(b)` where `op` transposes when the flag is set. `b` may be a parameter.
    MatMul {
        /// Left operand (a vertex value).
        a: ValueId,
        /// Right operand (a vertex value or a parameter).
        b: ValueId,
        /// Transpose `a`.
        ta: bool,
        /// Transpose `b`.
        tb: bool,
    },
    /// An element-wise op of one input.
    Unary {
        /// The op.
        op: UnaryOp,
        /// Its input.
        x: ValueId,
    },
    /// An element-wise op of two inputs; one may be a parameter broadcast over vertices (and over
    /// rows when it has one row).
    Binary {
        /// The op.
        op: BinaryOp,
        /// Left input.
        a: ValueId,
        /// Right input.
        b: ValueId,
    },
    /// Columns `start..start + len` of every row.
    Slice {
        /// Input.
        x: ValueId,
        /// First column.
        start: usize,
        /// Number of columns.
        len: usize,
    },
    /// The inputs side by side, column-wise.
    Concat {
        /// Inputs, left to right.
        parts: Vec<ValueId>,
    },
    /// The sum of each row's columns: `[r × c] → [r × 1]`.
    SumCols {
        /// Input.
        x: ValueId,
    },
    /// Attention over all children (`gather_softmax`): for each row `h` of `query` (a head), a
    /// score per child `s_c = σ(query[h] · key_c[h])`, `σ` the leaky ReLU of `slope` (the
    /// identity at 1), normalized over the vertex's children by a softmax shifted by their
    /// largest score, weighting the children's rows `value_c[h]`; zeros for a leaf. `key` and
    /// `value` are states (the children's scattered rows), `query` a value of this vertex.
    GatherSoftmax {
        /// The vertex's query, `[heads × d]`.
        query: ValueId,
        /// The state scored against it, `[heads × d]`.
        key: usize,
        /// The state weighted, `[heads × m]`.
        value: usize,
        /// The leaky ReLU's slope for negative scores (1: none).
        slope: f32,
    },
    /// Backward only: the gradient of a [`Op::GatherSoftmax`]'s query, given its forward query
    /// and its output's gradient (the weights are computed again from the children's rows); the
    /// same step adds the gradients of the children's `key` and `value` rows to their state
    /// gradients.
    GatherSoftmaxGrad {
        /// The forward query (a `Primal`).
        query: ValueId,
        /// The output's gradient.
        grad: ValueId,
        /// As in the forward op.
        key: usize,
        /// As in the forward op.
        value: usize,
        /// As in the forward op.
        slope: f32,
    },
    /// The largest of each row's columns: `[r × c] → [r × 1]`. No gradient flows through it: it
    /// shifts softmaxes and log-sum-exps, whose values the shift does not change.
    MaxCols {
        /// Input.
        x: ValueId,
    },
    /// A `[r × 1]` column repeated to `[r × cols]`.
    BroadcastCols {
        /// Input.
        x: ValueId,
        /// Output columns.
        cols: usize,
    },
}

/// The pattern of every load op: one that reads no value but memory the engine provides.
macro_rules! load_ops {
    () => {
        $crate::ir::Op::Gather { .. }
            | $crate::ir::Op::GatherAll { .. }
            | $crate::ir::Op::Pull { .. }
            | $crate::ir::Op::Param { .. }
            | $crate::ir::Op::Primal { .. }
            | $crate::ir::Op::StateGrad { .. }
            | $crate::ir::Op::PushGrad { .. }
            | $crate::ir::Op::Zeros
            | $crate::ir::Op::Stored { .. }
    };
}
pub(crate) use load_ops;

impl Op {
    /// The values this op reads.
    pub fn inputs(&self) -> SmallVec<[ValueId; 2]> {
        match self {
            load_ops!() => SmallVec::new(),
            Op::MatMul { a, b, .. } | Op::Binary { a, b, .. } => smallvec![*a, *b],
            Op::Unary { x, .. }
            | Op::Slice { x, .. }
            | Op::SumCols { x }
            | Op::MaxCols { x }
            | Op::BroadcastCols { x, .. } => smallvec![*x],
            Op::Concat { parts } => parts.iter().copied().collect(),
            Op::GatherSoftmax { query, .. } => smallvec![*query],
            Op::GatherSoftmaxGrad { query, grad, .. } => smallvec![*query, *grad],
        }
    }

    /// Whether the op is attention over the children or its gradient (a step of its own that
    /// reads the children's rows; never fused).
    pub fn is_attention(&self) -> bool {
        matches!(self, Op::GatherSoftmax { .. } | Op::GatherSoftmaxGrad { .. })
    }

    /// Whether the op runs as a step of its own rather than inside a fused kernel (a matrix
    /// product or attention).
    pub fn is_standalone(&self) -> bool {
        self.is_matmul() || self.is_attention()
    }

    /// Whether the op reads no value but memory the engine provides (gathers, pulls, parameters,
    /// primal values, gradients).
    pub fn is_load(&self) -> bool {
        matches!(self, load_ops!())
    }

    /// Whether the op is a matrix product (its own kernel; never fused).
    pub fn is_matmul(&self) -> bool {
        matches!(self, Op::MatMul { .. })
    }

    /// The op's short name, as plans and errors print it.
    pub fn name(&self) -> String {
        match self {
            Op::Gather { slot, state } => format!("gather(slot {slot}, state {state})"),
            Op::GatherAll { state, reduce: Reduce::Weighted { feature }, label: None } => {
                format!("gather_weighted(state {state}, feature {feature})")
            }
            Op::GatherAll { state, reduce, label: None } => format!("{}(state {state})", reduce.name()),
            Op::GatherAll { state, reduce, label: Some(l) } => format!("{}(state {state}, label {l})", reduce.name()),
            Op::Pull { input } => format!("pull({input})"),
            Op::Param { param } => format!("param({param})"),
            Op::Primal { value } => format!("primal({value})"),
            Op::StateGrad { state } => format!("state_grad({state})"),
            Op::PushGrad { output } => format!("push_grad({output})"),
            Op::Zeros => "zeros".into(),
            Op::Stored { value } => format!("stored({value})"),
            Op::MatMul { ta, tb, .. } => match (ta, tb) {
                (false, false) => "matmul".into(),
                (true, false) => "matmul(aᵀ)".into(),
                (false, true) => "matmul(bᵀ)".into(),
                (true, true) => "matmul(aᵀ,bᵀ)".into(),
            },
            Op::Unary { op: UnaryOp::Scale(s), .. } => format!("scale({s})"),
            Op::Unary { op: UnaryOp::Offset(c), .. } => format!("offset({c})"),
            Op::Unary { op, .. } => op.name().into(),
            Op::Binary { op, .. } => op.name().into(),
            Op::Slice { start, len, .. } => format!("slice({start}..{})", start + len),
            Op::Concat { .. } => "concat".into(),
            Op::SumCols { .. } => "sum_cols".into(),
            Op::MaxCols { .. } => "max_cols".into(),
            Op::BroadcastCols { cols, .. } => format!("broadcast_cols({cols})"),
            Op::GatherSoftmax { key, value, .. } => format!("gather_softmax(key {key}, value {value})"),
            Op::GatherSoftmaxGrad { key, value, .. } => format!("gather_softmax_grad(key {key}, value {value})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `is_load` (a plain match, on the engine's hot paths) says what `inputs` says.
    #[test]
    fn loads_are_the_ops_without_inputs() {
        let v = ValueId(0);
        let ops = [
            Op::Gather { slot: 0, state: 0 },
            Op::GatherAll { state: 0, reduce: Reduce::Max, label: Some(1) },
            Op::Pull { input: 0 },
            Op::Param { param: 0 },
            Op::Primal { value: v },
            Op::StateGrad { state: 0 },
            Op::PushGrad { output: 0 },
            Op::Zeros,
            Op::Stored { value: v },
            Op::MatMul { a: v, b: v, ta: false, tb: true },
            Op::Unary { op: UnaryOp::Gelu, x: v },
            Op::Binary { op: BinaryOp::Add, a: v, b: v },
            Op::Slice { x: v, start: 0, len: 1 },
            Op::Concat { parts: vec![v, v] },
            Op::SumCols { x: v },
            Op::BroadcastCols { x: v, cols: 2 },
            Op::GatherSoftmax { query: v, key: 0, value: 0, slope: 1.0 },
            Op::GatherSoftmaxGrad { query: v, grad: v, key: 0, value: 0, slope: 1.0 },
        ];
        for op in ops {
            assert_eq!(op.is_load(), op.inputs().is_empty(), "{}", op.name());
        }
    }
}
