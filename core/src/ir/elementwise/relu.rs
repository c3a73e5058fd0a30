//! The rectifier and its derivative.

use super::{from_output, Binary, Derive, Lanes, Unary, Zeros};
use crate::error::Result;
use crate::ir::op::ValueId;
use crate::ir::BinaryOp;

/// `max(x, 0)`
#[derive(Clone, Copy, Debug)]
pub struct Relu;

impl Unary for Relu {
    const NAME: &'static str = "relu";
    const KEEPS_ZERO: bool = true;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        x.max(L::splat(0.0))
    }
    fn cuda(self, x: &str) -> String {
        format!("fmaxf({x}, 0.0f)")
    }
    fn derivative(self, d: &mut dyn Derive, _: ValueId, y: ValueId, g: ValueId) -> Result<ValueId> {
        from_output(d, BinaryOp::ReluGrad, y, g)
    }
}

/// `dy` where `y > 0`, else 0, from the rectifier's output `a = y` and `b = dy`.
#[derive(Clone, Copy, Debug)]
pub struct ReluGrad;

impl Binary for ReluGrad {
    const NAME: &'static str = "relu_grad";
    const ZEROS: Zeros = Zeros::Either;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        a.positive_then(b)
    }
    fn cuda(self, a: &str, b: &str) -> String {
        format!("({a} > 0.0f ? {b} : 0.0f)")
    }
}
