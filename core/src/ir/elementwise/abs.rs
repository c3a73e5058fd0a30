//! The absolute value and its derivative.

use super::{Binary, Derive, Lanes, Unary, Zeros};
use crate::error::Result;
use crate::ir::op::ValueId;
use crate::ir::BinaryOp;

/// `|x|`
#[derive(Clone, Copy, Debug)]
pub struct Abs;

impl Unary for Abs {
    const NAME: &'static str = "abs";
    const KEEPS_ZERO: bool = true;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        x.abs()
    }
    fn cuda(self, x: &str) -> String {
        format!("fabsf({x})")
    }
    fn derivative(self, d: &mut dyn Derive, x: ValueId, _: ValueId, g: ValueId) -> Result<ValueId> {
        let x = d.primal(x);
        d.binary(BinaryOp::AbsGrad, x, g)
    }
}

/// `dy · sign(x)` (0 at `x = 0`) from the absolute value's input `a = x` and `b = dy`.
#[derive(Clone, Copy, Debug)]
pub struct AbsGrad;

impl Binary for AbsGrad {
    const NAME: &'static str = "abs_grad";
    const ZEROS: Zeros = Zeros::Either;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        a.positive_then(b).sub(a.neg().positive_then(b))
    }
    fn cuda(self, a: &str, b: &str) -> String {
        format!("(({a} > 0.0f ? {b} : 0.0f) - (-{a} > 0.0f ? {b} : 0.0f))")
    }
}
