//! The GELU of Hendrycks and Gimpel (2016), in its tanh form, and its derivative: the op added
//! by following `CONTRIBUTING.md`, as the proof that an op is one file.

use super::{tanh::Tanh, Binary, Derive, Lanes, Unary, Zeros};
use crate::error::Result;
use crate::ir::op::ValueId;
use crate::ir::BinaryOp;

/// `√(2/π)`.
const K: f32 = 0.797_884_6;
/// The cubic term's weight.
const C: f32 = 0.044_715;

/// `u = √(2/π)·(x + C·x³)` and `tanh u`, as both the op and its derivative compute them.
#[inline(always)]
fn inner<L: Lanes>(x: L) -> (L, L) {
    let x2 = x.mul(x);
    let u = x.mul(L::splat(C).mul_add(x2, L::splat(1.0))).mul(L::splat(K));
    (x2, Tanh.apply(u))
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`
#[derive(Clone, Copy, Debug)]
pub struct Gelu;

impl Unary for Gelu {
    const NAME: &'static str = "gelu";
    const KEEPS_ZERO: bool = true;
    #[inline(always)]
    fn apply<L: Lanes>(self, x: L) -> L {
        let (_, t) = inner(x);
        L::splat(0.5).mul(x).mul(L::splat(1.0).add(t))
    }
    fn cuda(self, x: &str) -> String {
        let u = format!("({x} * fmaf({C:e}f, {x} * {x}, 1.0f)) * {K:e}f");
        format!("0.5f * {x} * (1.0f + {})", Tanh.cuda(&format!("({u})")))
    }
    fn derivative(self, d: &mut dyn Derive, x: ValueId, _: ValueId, g: ValueId) -> Result<ValueId> {
        let x = d.primal(x);
        d.binary(BinaryOp::GeluGrad, x, g)
    }
}

/// `dy · gelu'(x)` from the GELU's input `a = x` and `b = dy`, where
/// `gelu'(x) = 0.5·(1 + t) + 0.5·x·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²)`, `t = tanh u`.
#[derive(Clone, Copy, Debug)]
pub struct GeluGrad;

impl Binary for GeluGrad {
    const NAME: &'static str = "gelu_grad";
    const ZEROS: Zeros = Zeros::Second;
    #[inline(always)]
    fn apply<L: Lanes>(self, a: L, b: L) -> L {
        let (x2, t) = inner(a);
        let (half, one) = (L::splat(0.5), L::splat(1.0));
        let du = L::splat(3.0 * C).mul_add(x2, one).mul(L::splat(K));
        let slope = half.mul(one.add(t)).add(half.mul(a).mul(one.sub(t.mul(t))).mul(du));
        b.mul(slope)
    }
    fn cuda(self, a: &str, b: &str) -> String {
        let u = format!("({a} * fmaf({C:e}f, {a} * {a}, 1.0f)) * {K:e}f");
        let t = format!("({})", Tanh.cuda(&format!("({u})")));
        let du = format!("fmaf({:e}f, {a} * {a}, 1.0f) * {K:e}f", 3.0 * C);
        format!("{b} * (0.5f * (1.0f + {t}) + 0.5f * {a} * (1.0f - {t} * {t}) * ({du}))")
    }
}
