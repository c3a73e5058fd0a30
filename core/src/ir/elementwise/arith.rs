//! Negation, scaling, constant offsets and the four arithmetic operations.

use super::{c_float, Binary, Derive, Lanes, Unary, UnaryOp, Zeros};
use crate::error::Result;
use crate::ir::op::ValueId;
use crate::ir::BinaryOp;

/// `-x`
#[derive(Clone, Copy, Debug)]
pub struct Neg;

impl Unary for Neg {
    const NAME: &'static str = "neg";
    const KEEPS_ZERO: bool = true;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        x.neg()
    }
    fn cuda(self, x: &str) -> String {
        format!("-{x}")
    }
    fn derivative(self, d: &mut dyn Derive, _: ValueId, _: ValueId, g: ValueId) -> Result<ValueId> {
        d.unary(UnaryOp::Neg, g)
    }
}

/// `s·x`
#[derive(Clone, Copy, Debug)]
pub struct Scale(pub f32);

impl Unary for Scale {
    const NAME: &'static str = "scale";
    const KEEPS_ZERO: bool = true;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        L::splat(self.0).mul(x)
    }
    fn cuda(self, x: &str) -> String {
        format!("{} * {x}", c_float(self.0))
    }
    fn derivative(self, d: &mut dyn Derive, _: ValueId, _: ValueId, g: ValueId) -> Result<ValueId> {
        d.unary(UnaryOp::Scale(self.0), g)
    }
}

/// `x + c`: a constant, not a parameter (`1 − z` is `z.neg().offset(1.0)`, or `1.0 - z`).
#[derive(Clone, Copy, Debug)]
pub struct Offset(pub f32);

impl Unary for Offset {
    const NAME: &'static str = "offset";
    const KEEPS_ZERO: bool = false;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        x.add(L::splat(self.0))
    }
    fn cuda(self, x: &str) -> String {
        format!("{x} + {}", c_float(self.0))
    }
    fn derivative(self, _: &mut dyn Derive, _: ValueId, _: ValueId, g: ValueId) -> Result<ValueId> {
        Ok(g)
    }
}

/// `a + b`
#[derive(Clone, Copy, Debug)]
pub struct Add;

impl Binary for Add {
    const NAME: &'static str = "add";
    const ZEROS: Zeros = Zeros::Both;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        a.add(b)
    }
    fn cuda(self, a: &str, b: &str) -> String {
        format!("{a} + {b}")
    }
    fn derivative(
        self,
        _: &mut dyn Derive,
        _: ValueId,
        _: ValueId,
        _: ValueId,
        g: ValueId,
    ) -> Result<Option<(ValueId, ValueId)>> {
        Ok(Some((g, g)))
    }
}

/// `a − b`
#[derive(Clone, Copy, Debug)]
pub struct Sub;

impl Binary for Sub {
    const NAME: &'static str = "sub";
    const ZEROS: Zeros = Zeros::Both;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        a.sub(b)
    }
    fn cuda(self, a: &str, b: &str) -> String {
        format!("{a} - {b}")
    }
    fn derivative(
        self,
        d: &mut dyn Derive,
        _: ValueId,
        _: ValueId,
        _: ValueId,
        g: ValueId,
    ) -> Result<Option<(ValueId, ValueId)>> {
        Ok(Some((g, d.unary(UnaryOp::Neg, g)?)))
    }
}

/// `a · b`
#[derive(Clone, Copy, Debug)]
pub struct Mul;

impl Binary for Mul {
    const NAME: &'static str = "mul";
    const ZEROS: Zeros = Zeros::Either;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        a.mul(b)
    }
    fn cuda(self, a: &str, b: &str) -> String {
        format!("{a} * {b}")
    }
    fn derivative(
        self,
        d: &mut dyn Derive,
        a: ValueId,
        b: ValueId,
        _: ValueId,
        g: ValueId,
    ) -> Result<Option<(ValueId, ValueId)>> {
        let (ap, bp) = (d.primal(a), d.primal(b));
        Ok(Some((d.binary(BinaryOp::Mul, g, bp)?, d.binary(BinaryOp::Mul, g, ap)?)))
    }
}

/// `a / b`
#[derive(Clone, Copy, Debug)]
pub struct Div;

impl Binary for Div {
    const NAME: &'static str = "div";
    const ZEROS: Zeros = Zeros::First;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        a.div(b)
    }
    fn cuda(self, a: &str, b: &str) -> String {
        format!("{a} / {b}")
    }
    fn derivative(
        self,
        d: &mut dyn Derive,
        _: ValueId,
        b: ValueId,
        y: ValueId,
        g: ValueId,
    ) -> Result<Option<(ValueId, ValueId)>> {
        let (bp, yp) = (d.primal(b), d.primal(y));
        let da = d.binary(BinaryOp::Div, g, bp)?;
        let gy = d.binary(BinaryOp::Mul, g, yp)?;
        let q = d.binary(BinaryOp::Div, gy, bp)?;
        Ok(Some((da, d.unary(UnaryOp::Neg, q)?)))
    }
}
