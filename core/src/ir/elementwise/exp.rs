//! The exponential, and `e^x` itself, which the sigmoid, tanh and GELU build on.

use super::{Derive, Lanes, Unary};
use crate::error::Result;
use crate::ir::op::ValueId;
use crate::ir::BinaryOp;

/// `e^x` by range reduction and a degree-6 polynomial (Cephes `expf`, about 1 ulp), branch-free,
/// in fused multiply-adds. Inputs are clamped to [-87, 88].
#[inline(always)]
pub fn exp<L: Lanes>(x: L) -> L {
    let x = x.clamp(-87.0, 88.0);
    let n = x.mul_add(L::splat(std::f32::consts::LOG2_E), L::splat(0.5)).floor();
    let r = n.mul_add(L::splat(2.121_944_4e-4), n.mul_add(L::splat(-0.693_359_4), x));
    // A loop, not a closure: a closure would be compiled without the vector instructions of
    // the function it runs in, and the intrinsics in it would stay calls.
    let mut p = L::splat(1.987_569_2e-4);
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = p.mul_add(r, L::splat(c));
    }
    let e = p.mul(r).mul_add(r, r.add(L::splat(1.0)));
    e.mul(n.pow2i())
}

/// `e^x`
#[derive(Clone, Copy, Debug)]
pub struct Exp;

impl Unary for Exp {
    const NAME: &'static str = "exp";
    const KEEPS_ZERO: bool = false;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        exp(x)
    }
    fn cuda(self, x: &str) -> String {
        format!("expf({x})")
    }
    fn derivative(self, d: &mut dyn Derive, _: ValueId, y: ValueId, g: ValueId) -> Result<ValueId> {
        let y = d.primal(y);
        d.binary(BinaryOp::Mul, g, y)
    }
}
