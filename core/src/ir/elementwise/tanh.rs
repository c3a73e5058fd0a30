//! The hyperbolic tangent and its derivative.

use super::{exp, from_output, Binary, Derive, Lanes, Unary, Zeros};
use crate::error::Result;
use crate::ir::op::ValueId;
use crate::ir::BinaryOp;

/// `tanh x`, as `1 − 2/(e^{2x} + 1)`: exact at 0 and saturating to ±1.
#[derive(Clone, Copy, Debug)]
pub struct Tanh;

impl Unary for Tanh {
    const NAME: &'static str = "tanh";
    const KEEPS_ZERO: bool = true;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        L::splat(1.0).sub(L::splat(2.0).div(exp(L::splat(2.0).mul(x)).add(L::splat(1.0))))
    }
    fn cuda(self, x: &str) -> String {
        format!("1.0f - 2.0f / (expf(2.0f * {x}) + 1.0f)")
    }
    fn derivative(self, d: &mut dyn Derive, _: ValueId, y: ValueId, g: ValueId) -> Result<ValueId> {
        from_output(d, BinaryOp::TanhGrad, y, g)
    }
}

/// `dy · (1 − y²)` from the tanh's output `a = y` and `b = dy`.
#[derive(Clone, Copy, Debug)]
pub struct TanhGrad;

impl Binary for TanhGrad {
    const NAME: &'static str = "tanh_grad";
    const ZEROS: Zeros = Zeros::Second;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        b.mul(L::splat(1.0).sub(a.mul(a)))
    }
    fn cuda(self, a: &str, b: &str) -> String {
        format!("{b} * (1.0f - {a} * {a})")
    }
}
