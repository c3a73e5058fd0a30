//! The logistic sigmoid and its derivative.

use super::{exp, from_output, Binary, Derive, Lanes, Unary, Zeros};
use crate::error::Result;
use crate::ir::op::ValueId;
use crate::ir::BinaryOp;

/// `1 / (1 + e^-x)`
#[derive(Clone, Copy, Debug)]
pub struct Sigmoid;

impl Unary for Sigmoid {
    const NAME: &'static str = "sigmoid";
    const KEEPS_ZERO: bool = false;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        L::splat(1.0).div(L::splat(1.0).add(exp(x.neg())))
    }
    fn cuda(self, x: &str) -> String {
        format!("1.0f / (1.0f + expf(-{x}))")
    }
    fn derivative(self, d: &mut dyn Derive, _: ValueId, y: ValueId, g: ValueId) -> Result<ValueId> {
        from_output(d, BinaryOp::SigmoidGrad, y, g)
    }
}

/// `dy · y · (1 − y)` from the sigmoid's output `a = y` and `b = dy`.
#[derive(Clone, Copy, Debug)]
pub struct SigmoidGrad;

impl Binary for SigmoidGrad {
    const NAME: &'static str = "sigmoid_grad";
    const ZEROS: Zeros = Zeros::Either;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        b.mul(a).mul(L::splat(1.0).sub(a))
    }
    fn cuda(self, a: &str, b: &str) -> String {
        format!("{b} * {a} * (1.0f - {a})")
    }
}
