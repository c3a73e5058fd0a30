//! Element-wise ops, each defined once: its name, its formula, its CUDA C expression, its
//! derivative in IR terms and what it does to zeros. The reference interpreter, the CPU kernels
//! (scalar and vectorised alike), the CUDA code generator, autodiff and the zero analyses all read
//! these definitions and nothing else.
//!
//! A formula is written once, generic over [`Lanes`]: the arithmetic of one `f32` here, of a
//! vector of lanes in the CPU backend. Every primitive of [`Lanes`] rounds the same way on every
//! implementation, so a vectorised loop computes bit for bit what [`UnaryOp::apply`] does.
//!
//! To add an op, see `CONTRIBUTING.md`: one file here (the op, and the backward-only op its
//! derivative needs, if any), one line in `unary_ops!` or `binary_ops!` below, a builder
//! method, and its case in the gradient checks.

mod abs;
mod arith;
mod detach;
mod exp;
mod gelu;
mod log;
mod relu;
mod sigmoid;
mod tanh;

pub use self::exp::exp;

use super::op::ValueId;
use crate::error::Result;

/// The arithmetic element-wise formulas are written in: one `f32`, or (in the CPU backend) a
/// vector of lanes. Each method rounds exactly as the `f32` method of the same name does, so a
/// formula gives the same bits however many lanes compute it.
pub trait Lanes: Copy {
    /// Every lane `x`.
    fn splat(x: f32) -> Self;
    /// `self + b`.
    fn add(self, b: Self) -> Self;
    /// `self − b`.
    fn sub(self, b: Self) -> Self;
    /// `self · b`.
    fn mul(self, b: Self) -> Self;
    /// `self / b`.
    fn div(self, b: Self) -> Self;
    /// `−self` (the sign flipped).
    fn neg(self) -> Self;
    /// `|self|` (the sign cleared, so `−0` gives `+0` and NaN stays NaN; [`f32::abs`]).
    fn abs(self) -> Self;
    /// `self · b + c` with one rounding ([`f32::mul_add`]).
    fn mul_add(self, b: Self, c: Self) -> Self;
    /// The larger of `self` and `b`; `b` where `self` is NaN ([`f32::max`]; a NaN `b` is never
    /// asked for).
    fn max(self, b: Self) -> Self;
    /// `self` limited to `lo..=hi`, NaN staying NaN ([`f32::clamp`]).
    fn clamp(self, lo: f32, hi: f32) -> Self;
    /// The largest integer at most `self` ([`f32::floor`]).
    fn floor(self) -> Self;
    /// `2^self` for an integer-valued `self` in `-127..=127`, from its bits.
    fn pow2i(self) -> Self;
    /// `b` where `self > 0`, else `0`.
    fn positive_then(self, b: Self) -> Self;
    /// The natural logarithm ([`f32::ln`]), lane by lane.
    fn ln(self) -> Self;
}

impl Lanes for f32 {
    #[inline(always)]
    fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn add(self, b: f32) -> f32 {
        self + b
    }
    #[inline(always)]
    fn sub(self, b: f32) -> f32 {
        self - b
    }
    #[inline(always)]
    fn mul(self, b: f32) -> f32 {
        self * b
    }
    #[inline(always)]
    fn div(self, b: f32) -> f32 {
        self / b
    }
    #[inline(always)]
    fn neg(self) -> f32 {
        -self
    }
    #[inline(always)]
    fn abs(self) -> f32 {
        f32::abs(self)
    }
    #[inline(always)]
    fn mul_add(self, b: f32, c: f32) -> f32 {
        f32::mul_add(self, b, c)
    }
    #[inline(always)]
    fn max(self, b: f32) -> f32 {
        f32::max(self, b)
    }
    #[inline(always)]
    fn clamp(self, lo: f32, hi: f32) -> f32 {
        f32::clamp(self, lo, hi)
    }
    #[inline(always)]
    fn floor(self) -> f32 {
        f32::floor(self)
    }
    #[inline(always)]
    fn pow2i(self) -> f32 {
        // Adding 1.5·2^23 puts the integer (|n| ≤ 127) in the low mantissa bits. (A cast to an
        // integer would saturate, which compilers do not vectorise.)
        let biased = (self + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127);
        f32::from_bits(biased << 23)
    }
    #[inline(always)]
    fn positive_then(self, b: f32) -> f32 {
        if self > 0.0 {
            b
        } else {
            0.0
        }
    }
    #[inline(always)]
    fn ln(self) -> f32 {
        f32::ln(self)
    }
}

/// A float as a C literal that reads back as the same value.
pub fn c_float(x: f32) -> String {
    if x.is_finite() {
        format!("{x:e}f")
    } else if x.is_nan() {
        "(0.0f / 0.0f)".into()
    } else if x > 0.0 {
        "(1.0f / 0.0f)".into()
    } else {
        "(-1.0f / 0.0f)".into()
    }
}

/// What a derivative is built with: the backward function autodiff is writing.
pub trait Derive {
    /// The forward value `v` of this vertex, read in the backward function.
    fn primal(&mut self, v: ValueId) -> ValueId;
    /// A new value `op(x)`.
    fn unary(&mut self, op: UnaryOp, x: ValueId) -> Result<ValueId>;
    /// A new value `op(a, b)`.
    fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId>;
}

/// An element-wise op of one input.
pub trait Unary: Copy {
    /// The name plans and errors print.
    const NAME: &'static str;
    /// Whether the op maps 0 to 0 (exactly), so a value known to be zero stays zero through it.
    const KEEPS_ZERO: bool;
    /// The op on every lane of `x`.
    fn apply<L: Lanes>(self, x: L) -> L;
    /// The op as a CUDA C expression over the expression `x` (computed as [`Unary::apply`]).
    fn cuda(self, x: &str) -> String;
    /// The gradient of the input, given the input `x` and output `y` (forward values) and the
    /// output's gradient `g` (a backward value).
    fn derivative(self, d: &mut dyn Derive, x: ValueId, y: ValueId, g: ValueId) -> Result<ValueId>;
}

/// Where the result of an element-wise op of two inputs is known to be zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Zeros {
    /// Where both inputs are (`a + b`).
    Both,
    /// Where either input is (`a · b`).
    Either,
    /// Where the first input is (`a / b`).
    First,
    /// Where the second input is (`dy · f'(y)`).
    Second,
}

impl Zeros {
    /// Whether the result is zero, given whether each input is.
    pub fn of(self, a: bool, b: bool) -> bool {
        match self {
            Zeros::Both => a && b,
            Zeros::Either => a || b,
            Zeros::First => a,
            Zeros::Second => b,
        }
    }
}

/// An element-wise op of two inputs.
pub trait Binary: Copy {
    /// The name plans and errors print.
    const NAME: &'static str;
    /// Where the result is known to be zero.
    const ZEROS: Zeros;
    /// The op on every pair of lanes.
    fn apply<L: Lanes>(self, a: L, b: L) -> L;
    /// The op as a CUDA C expression over the expressions `a` and `b`.
    fn cuda(self, a: &str, b: &str) -> String;
    /// The gradients of both inputs, given the inputs `a`, `b` and output `y` (forward values)
    /// and the output's gradient `g`; `None` (the default) for ops that appear only in backward
    /// functions.
    fn derivative(
        self,
        _d: &mut dyn Derive,
        _a: ValueId,
        _b: ValueId,
        _y: ValueId,
        _g: ValueId,
    ) -> Result<Option<(ValueId, ValueId)>> {
        Ok(None)
    }
}

/// The input gradient of an op whose derivative is `grad(y, g)` of its output `y`, as for the
/// sigmoid, tanh and relu.
pub fn from_output(d: &mut dyn Derive, grad: BinaryOp, y: ValueId, g: ValueId) -> Result<ValueId> {
    let y = d.primal(y);
    d.binary(grad, y, g)
}

/// Runs generic code for one element-wise op of one input: [`UnaryOp::visit`] calls
/// [`UnaryVisitor::visit`] with the op's definition, so the code is compiled once per op.
pub trait UnaryVisitor {
    /// What the code returns.
    type Out;
    /// The code, for the op `op`.
    fn visit<T: Unary>(self, op: T) -> Self::Out;
}

/// [`UnaryVisitor`] for ops of two inputs.
pub trait BinaryVisitor {
    /// What the code returns.
    type Out;
    /// The code, for the op `op`.
    fn visit<T: Binary>(self, op: T) -> Self::Out;
}

/// Declares [`UnaryOp`], one variant per op, and its methods, each reading the op's definition.
macro_rules! unary_ops {
    ($($(#[$doc:meta])* $variant:ident $(($arg:ident: $ty:ty))? => $def:expr;)*) => {
        /// Element-wise ops of one input.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum UnaryOp {
            $($(#[$doc])* $variant $(($ty))?,)*
        }

        impl UnaryOp {
            /// Runs `v` with this op's definition.
            #[inline(always)]
            pub fn visit<V: UnaryVisitor>(self, v: V) -> V::Out {
                match self {
                    $(UnaryOp::$variant $(($arg))? => v.visit($def),)*
                }
            }

            /// The op's name as printed in plans and errors.
            pub fn name(self) -> &'static str {
                fn of<T: Unary>(_: T) -> &'static str {
                    T::NAME
                }
                match self {
                    $(UnaryOp::$variant $(($arg))? => of($def),)*
                }
            }

            /// The op named `name` (as [`UnaryOp::name`] gives it), with `arg` for an op that
            /// takes one ([`UnaryOp::arg`]).
            pub fn from_name(name: &str, arg: f32) -> Option<UnaryOp> {
                $({
                    $(let $arg: $ty = arg;)?
                    let op = UnaryOp::$variant $(($arg))?;
                    if op.name() == name {
                        return Some(op);
                    }
                })*
                let _ = arg;
                None
            }

            /// The op's constant argument (a scale, an offset), 0 for an op without one.
            pub fn arg(self) -> f32 {
                match self {
                    $(UnaryOp::$variant $(($arg))? => 0.0 $(+ $arg)?,)*
                }
            }

            /// Whether the op maps 0 to 0.
            pub fn keeps_zero(self) -> bool {
                fn of<T: Unary>(_: T) -> bool {
                    T::KEEPS_ZERO
                }
                match self {
                    $(UnaryOp::$variant $(($arg))? => of($def),)*
                }
            }

            /// The op applied to every lane of `x`.
            #[inline(always)]
            pub fn apply<L: Lanes>(self, x: L) -> L {
                match self {
                    $(UnaryOp::$variant $(($arg))? => $def.apply(x),)*
                }
            }

            /// The op as a CUDA C expression over the expression `x`.
            pub fn cuda(self, x: &str) -> String {
                match self {
                    $(UnaryOp::$variant $(($arg))? => $def.cuda(x),)*
                }
            }

            /// The input's gradient (see [`Unary::derivative`]).
            pub fn derivative(self, d: &mut dyn Derive, x: ValueId, y: ValueId, g: ValueId) -> Result<ValueId> {
                match self {
                    $(UnaryOp::$variant $(($arg))? => $def.derivative(d, x, y, g),)*
                }
            }
        }
    };
}

/// Declares [`BinaryOp`] as `unary_ops!` declares [`UnaryOp`].
macro_rules! binary_ops {
    ($($(#[$doc:meta])* $variant:ident => $def:expr;)*) => {
        /// Element-wise ops of two inputs. The `*Grad` ops appear only in derived backward
        /// functions: they take the forward value they need and the output gradient `dy`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum BinaryOp {
            $($(#[$doc])* $variant,)*
        }

        impl BinaryOp {
            /// Runs `v` with this op's definition.
            #[inline(always)]
            pub fn visit<V: BinaryVisitor>(self, v: V) -> V::Out {
                match self {
                    $(BinaryOp::$variant => v.visit($def),)*
                }
            }

            /// The op's name as printed in plans and errors.
            pub fn name(self) -> &'static str {
                fn of<T: Binary>(_: T) -> &'static str {
                    T::NAME
                }
                match self {
                    $(BinaryOp::$variant => of($def),)*
                }
            }

            /// The op named `name` (as [`BinaryOp::name`] gives it).
            pub fn from_name(name: &str) -> Option<BinaryOp> {
                [$(BinaryOp::$variant),*].into_iter().find(|op| op.name() == name)
            }

            /// Where the result is known to be zero.
            pub fn zeros(self) -> Zeros {
                fn of<T: Binary>(_: T) -> Zeros {
                    T::ZEROS
                }
                match self {
                    $(BinaryOp::$variant => of($def),)*
                }
            }

            /// The op applied to every pair of lanes.
            #[inline(always)]
            pub fn apply<L: Lanes>(self, a: L, b: L) -> L {
                match self {
                    $(BinaryOp::$variant => $def.apply(a, b),)*
                }
            }

            /// The op as a CUDA C expression over the expressions `a` and `b`.
            pub fn cuda(self, a: &str, b: &str) -> String {
                match self {
                    $(BinaryOp::$variant => $def.cuda(a, b),)*
                }
            }

            /// Both inputs' gradients (see [`Binary::derivative`]).
            pub fn derivative(
                self,
                d: &mut dyn Derive,
                a: ValueId,
                b: ValueId,
                y: ValueId,
                g: ValueId,
            ) -> Result<Option<(ValueId, ValueId)>> {
                match self {
                    $(BinaryOp::$variant => $def.derivative(d, a, b, y, g),)*
                }
            }
        }
    };
}

unary_ops! {
    /// `-x`
    Neg => arith::Neg;
    /// `s·x`
    Scale(s: f32) => arith::Scale(s);
    /// `1 / (1 + e^-x)`
    Sigmoid => sigmoid::Sigmoid;
    /// `tanh x`
    Tanh => tanh::Tanh;
    /// `max(x, 0)`
    Relu => relu::Relu;
    /// `e^x`
    Exp => exp::Exp;
    /// `ln x`
    Log => log::Log;
    /// `x·Φ(x)` in the tanh form of Hendrycks and Gimpel
    Gelu => gelu::Gelu;
    /// `|x|`
    Abs => abs::Abs;
    /// `x + c` (a constant offset)
    Offset(c: f32) => arith::Offset(c);
    /// `x`, with no gradient (a stop-gradient)
    Detach => detach::Detach;
}

binary_ops! {
    /// `a + b`
    Add => arith::Add;
    /// `a - b`
    Sub => arith::Sub;
    /// `a · b`
    Mul => arith::Mul;
    /// `a / b`
    Div => arith::Div;
    /// `dy · y · (1 − y)`: the sigmoid's derivative from its output `a = y`, `b = dy`.
    SigmoidGrad => sigmoid::SigmoidGrad;
    /// `dy · (1 − y²)`: the tanh's derivative from its output `a = y`, `b = dy`.
    TanhGrad => tanh::TanhGrad;
    /// `dy` where `y > 0`, else 0: the relu's derivative from its output `a = y`, `b = dy`.
    ReluGrad => relu::ReluGrad;
    /// `dy · gelu'(x)`: the GELU's derivative from its input `a = x`, `b = dy`.
    GeluGrad => gelu::GeluGrad;
    /// `dy · sign(x)`: the absolute value's derivative from its input `a = x`, `b = dy`.
    AbsGrad => abs::AbsGrad;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_and_friends_are_accurate() {
        let mut worst: (f64, f64, f64) = (0.0, 0.0, 0.0);
        for i in -20_000..=20_000 {
            let x = i as f32 * 4e-3; // −80 … 80
            let want = f64::from(x).exp();
            worst.0 = worst.0.max((f64::from(exp(x)) - want).abs() / want);
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
        assert!(exp(-200.0f32) >= 0.0 && exp(200.0f32).is_finite());
        assert!(exp(f32::NAN).is_nan(), "NaN stays NaN");
    }

    /// The GELU against its definition in f64 (with the exact tanh), its derivative against
    /// central differences of it, and the ops that keep zero do.
    #[test]
    fn gelu_and_its_derivative_are_accurate() {
        let gelu = |x: f64| 0.5 * x * (1.0 + (0.797_884_560_8 * (x + 0.044_715 * x * x * x)).tanh());
        for i in -800..=800 {
            let x = i as f32 * 0.01;
            let y = f64::from(UnaryOp::Gelu.apply(x));
            assert!((y - gelu(f64::from(x))).abs() < 1e-6, "gelu({x}) = {y}");
            let h = 1e-4;
            let slope = (gelu(f64::from(x) + h) - gelu(f64::from(x) - h)) / (2.0 * h);
            let got = f64::from(BinaryOp::GeluGrad.apply(x, 1.0));
            assert!((got - slope).abs() < 1e-5, "gelu'({x}) = {got}, differences {slope}");
        }
        for op in [UnaryOp::Neg, UnaryOp::Scale(3.0), UnaryOp::Tanh, UnaryOp::Relu, UnaryOp::Gelu, UnaryOp::Abs] {
            assert!(op.keeps_zero() && op.apply(0.0f32) == 0.0, "{op:?}");
        }
        assert!(!UnaryOp::Offset(1.0).keeps_zero() && UnaryOp::Offset(1.0).apply(0.0f32) == 1.0);
        for (x, abs, slope) in [(-2.5f32, 2.5f32, -1.0f32), (0.0, 0.0, 0.0), (3.0, 3.0, 1.0)] {
            assert_eq!((UnaryOp::Abs.apply(x), BinaryOp::AbsGrad.apply(x, 1.0)), (abs, slope));
        }
        assert!(UnaryOp::Abs.apply(f32::NAN).is_nan(), "NaN stays NaN");
    }
}
