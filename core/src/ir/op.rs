//! The ops of the vertex-function IR and the scalar formula of each element-wise op.
//!
//! The formulas here are the single definition of what an element-wise op computes: the reference
//! interpreter, the CPU kernels and the CUDA code generator all read them.

use smallvec::{smallvec, SmallVec};
use std::fmt;

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

/// `e^x` in f32 by range reduction and a degree-6 polynomial (Cephes `expf`, about 1 ulp),
/// branch-free so loops over it vectorise, in fused multiply-adds (one instruction each where
/// the CPU has FMA). Inputs are clamped to [-87, 88].
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = x.mul_add(std::f32::consts::LOG2_E, 0.5).floor();
    let r = n.mul_add(2.121_944_4e-4, n.mul_add(-0.693_359_4, x));
    let p = [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5]
        .iter()
        .fold(1.987_569_2e-4f32, |p, &c| p.mul_add(r, c));
    let e = (p * r).mul_add(r, r + 1.0);
    // 2^n from n's bits: adding 1.5·2^23 puts the integer n (|n| ≤ 127) in the low mantissa bits.
    // (A float-to-int cast would saturate, which compilers do not vectorise.)
    let biased = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127);
    e * f32::from_bits(biased << 23)
}

/// Element-wise ops of one input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `s·x`
    Scale(f32),
    /// `1 / (1 + e^-x)`
    Sigmoid,
    /// `tanh x`
    Tanh,
    /// `max(x, 0)`
    Relu,
    /// `e^x`
    Exp,
    /// `ln x`
    Log,
}

impl UnaryOp {
    /// The op applied to one element.
    #[inline(always)]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Scale(s) => s * x,
            UnaryOp::Sigmoid => 1.0 / (1.0 + exp_f32(-x)),
            // 1 − 2/(e^{2x} + 1): exact at 0 and saturating to ±1.
            UnaryOp::Tanh => 1.0 - 2.0 / (exp_f32(2.0 * x) + 1.0),
            UnaryOp::Relu => x.max(0.0),
            UnaryOp::Exp => exp_f32(x),
            UnaryOp::Log => x.ln(),
        }
    }

    /// The op as a CUDA C expression over the operand expression `x` (f32).
    pub fn cuda(self, x: &str) -> String {
        match self {
            UnaryOp::Neg => format!("(-{x})"),
            UnaryOp::Scale(s) => format!("({:?}f*{x})", s),
            UnaryOp::Sigmoid => format!("(1.0f/(1.0f+__expf(-{x})))"),
            UnaryOp::Tanh => format!("tanhf({x})"),
            UnaryOp::Relu => format!("fmaxf({x},0.0f)"),
            UnaryOp::Exp => format!("__expf({x})"),
            UnaryOp::Log => format!("__logf({x})"),
        }
    }

    /// The op's name as printed in plans and errors.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Scale(_) => "scale",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Relu => "relu",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
        }
    }
}

/// Element-wise ops of two inputs. The `*Grad` ops appear only in derived backward functions:
/// they take the forward output `y` and the output gradient `dy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a · b`
    Mul,
    /// `a / b`
    Div,
    /// `dy · y · (1 − y)`, the sigmoid's derivative from its output `a = y`, `b = dy`.
    SigmoidGrad,
    /// `dy · (1 − y²)`, the tanh's derivative from its output `a = y`, `b = dy`.
    TanhGrad,
    /// `dy` where `y > 0`, else 0: the relu's derivative from its output `a = y`, `b = dy`.
    ReluGrad,
}

impl BinaryOp {
    /// The op applied to one pair of elements.
    #[inline(always)]
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::SigmoidGrad => b * a * (1.0 - a),
            BinaryOp::TanhGrad => b * (1.0 - a * a),
            BinaryOp::ReluGrad => {
                if a > 0.0 {
                    b
                } else {
                    0.0
                }
            }
        }
    }

    /// The op as a CUDA C expression over operand expressions `a` and `b` (f32).
    pub fn cuda(self, a: &str, b: &str) -> String {
        match self {
            BinaryOp::Add => format!("({a}+{b})"),
            BinaryOp::Sub => format!("({a}-{b})"),
            BinaryOp::Mul => format!("({a}*{b})"),
            BinaryOp::Div => format!("({a}/{b})"),
            BinaryOp::SigmoidGrad => format!("({b}*{a}*(1.0f-{a}))"),
            BinaryOp::TanhGrad => format!("({b}*(1.0f-{a}*{a}))"),
            BinaryOp::ReluGrad => format!("({a}>0.0f?{b}:0.0f)"),
        }
    }

    /// The op's name as printed in plans and errors.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::SigmoidGrad => "sigmoid_grad",
            BinaryOp::TanhGrad => "tanh_grad",
            BinaryOp::ReluGrad => "relu_grad",
        }
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
    /// The sum over all children of the state `state` they scattered (zeros for a leaf).
    GatherSum {
        /// State index.
        state: usize,
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
    /// Backward only: a `[r × 1]` column repeated to `[r × cols]`.
    BroadcastCols {
        /// Input.
        x: ValueId,
        /// Output columns.
        cols: usize,
    },
}

impl Op {
    /// The values this op reads.
    pub fn inputs(&self) -> SmallVec<[ValueId; 2]> {
        match self {
            Op::Gather { .. }
            | Op::GatherSum { .. }
            | Op::Pull { .. }
            | Op::Param { .. }
            | Op::Primal { .. }
            | Op::StateGrad { .. }
            | Op::PushGrad { .. }
            | Op::Zeros
            | Op::Stored { .. } => SmallVec::new(),
            Op::MatMul { a, b, .. } | Op::Binary { a, b, .. } => smallvec![*a, *b],
            Op::Unary { x, .. } | Op::Slice { x, .. } | Op::SumCols { x } | Op::BroadcastCols { x, .. } => {
                smallvec![*x]
            }
            Op::Concat { parts } => parts.iter().copied().collect(),
        }
    }

    /// Whether the op reads no value but memory the engine provides (gathers, pulls, parameters,
    /// primal values, gradients).
    pub fn is_load(&self) -> bool {
        self.inputs().is_empty()
    }

    /// Whether the op is a matrix product (its own kernel; never fused).
    pub fn is_matmul(&self) -> bool {
        matches!(self, Op::MatMul { .. })
    }

    /// The op's short name, as plans and errors print it.
    pub fn name(&self) -> String {
        match self {
            Op::Gather { slot, state } => format!("gather(slot {slot}, state {state})"),
            Op::GatherSum { state } => format!("gather_sum(state {state})"),
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
            Op::Unary { op, .. } => op.name().into(),
            Op::Binary { op, .. } => op.name().into(),
            Op::Slice { start, len, .. } => format!("slice({start}..{})", start + len),
            Op::Concat { .. } => "concat".into(),
            Op::SumCols { .. } => "sum_cols".into(),
            Op::BroadcastCols { cols, .. } => format!("broadcast_cols({cols})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{exp_f32, UnaryOp};

    #[test]
    fn fast_exp_and_friends_are_accurate() {
        let mut worst: (f64, f64, f64) = (0.0, 0.0, 0.0);
        for i in -20_000..=20_000 {
            let x = i as f32 * 4e-3; // −80 … 80
            let want = f64::from(x).exp();
            worst.0 = worst.0.max((f64::from(exp_f32(x)) - want).abs() / want);
            let t = f64::from(x).tanh();
            worst.1 = worst.1.max((f64::from(UnaryOp::Tanh.apply(x)) - t).abs());
            let s = 1.0 / (1.0 + (-f64::from(x)).exp());
            worst.2 = worst.2.max((f64::from(UnaryOp::Sigmoid.apply(x)) - s).abs());
        }
        assert!(worst.0 < 4e-7, "exp relative error {}", worst.0);
        assert!(worst.1 < 3e-7, "tanh absolute error {}", worst.1);
        assert!(worst.2 < 2e-7, "sigmoid absolute error {}", worst.2);
        assert_eq!(UnaryOp::Tanh.apply(0.0), 0.0);
        assert_eq!(UnaryOp::Tanh.apply(200.0), 1.0);
        assert_eq!(UnaryOp::Tanh.apply(-200.0), -1.0);
        assert!(exp_f32(-200.0) >= 0.0 && exp_f32(200.0).is_finite());
    }
}
