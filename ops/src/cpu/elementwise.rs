//! Element-wise loops: each op's formula (from [`arbor_core::ir::elementwise`], written once over
//! [`Lanes`]) run over whole vectors and then one partial vector, on AVX-512 (16 lanes), AVX2 +
//! FMA (8 lanes) or NEON (4 lanes), as the [active](super::isa::active) level allows, and one
//! element at a time elsewhere. Every [`Lanes`] primitive rounds as its `f32` counterpart does,
//! so every path computes each element with the bits of [`UnaryOp::apply`] and
//! [`BinaryOp::apply`].
//!
//! [`Lanes`]: arbor_core::ir::elementwise::Lanes

use super::isa::{self, Isa};
use super::simd::Vector;
use arbor_core::ir::elementwise::{Binary, BinaryVisitor, Unary, UnaryVisitor};
use arbor_core::ir::{BinaryOp, UnaryOp};

/// `out[e] = op(x[e])`.
pub(crate) fn unary(op: UnaryOp, x: &[f32], out: &mut [f32]) {
    unary_on(isa::active(), op, x, out);
}

/// `out[e] = op(a[e], b[e])`, where an operand shorter than `out` repeats with its own period
/// (a broadcast parameter).
pub(crate) fn binary(op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]) {
    binary_on(isa::active(), op, a, b, out);
}

/// [`unary`] with the vectors of `level` (at most what the CPU has).
fn unary_on(level: Isa, op: UnaryOp, x: &[f32], out: &mut [f32]) {
    struct Run<'a>(Isa, &'a [f32], &'a mut [f32]);
    impl UnaryVisitor for Run<'_> {
        type Out = ();
        #[inline(always)]
        fn visit<T: Unary>(self, op: T) {
            let Run(level, x, out) = self;
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the level is at most what the CPU has.
                Isa::Avx512 => unsafe { x86::unary_avx512(op, x, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Isa::Avx2 => unsafe { x86::unary_avx2(op, x, out) },
                _ => baseline(x, x, out, |v, _| op.apply(v)),
            }
        }
    }
    op.visit(Run(level, x, out));
}

/// [`binary`] with the vectors of `level` (at most what the CPU has).
fn binary_on(level: Isa, op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]) {
    struct Run<'a>(Isa, &'a [f32], &'a [f32], &'a mut [f32]);
    impl BinaryVisitor for Run<'_> {
        type Out = ();
        #[inline(always)]
        fn visit<T: Binary>(self, op: T) {
            let Run(level, a, b, out) = self;
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the level is at most what the CPU has.
                Isa::Avx512 => unsafe { x86::binary_avx512(op, a, b, out) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Isa::Avx2 => unsafe { x86::binary_avx2(op, a, b, out) },
                _ => periods(a, b, out, |a, b, out| baseline(a, b, out, |x, y| op.apply(x, y))),
            }
        }
    }
    op.visit(Run(level, a, b, out));
}

/// Runs `f` over equal-length parts: all of `out` when both operands are as long, else each
/// period of the shorter operand (a broadcast parameter) against the matching parts of the
/// others.
#[inline(always)]
fn periods(a: &[f32], b: &[f32], out: &mut [f32], mut f: impl FnMut(&[f32], &[f32], &mut [f32])) {
    let p = a.len().min(b.len()).max(1);
    if a.len() == out.len() && b.len() == out.len() {
        f(a, b, out);
    } else if a.len() < out.len() {
        for (o, cb) in out.chunks_mut(p).zip(b.chunks(p)) {
            f(a, cb, o);
        }
    } else {
        for (o, ca) in out.chunks_mut(p).zip(a.chunks(p)) {
            f(ca, b, o);
        }
    }
}

/// `out[e] = f(a[e], b[e])` over the common length: whole vectors, then one partial vector.
///
/// # Safety
/// The CPU runs `V`'s instructions.
#[inline(always)]
unsafe fn each<V: Vector>(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(V, V) -> V) {
    let n = a.len().min(b.len()).min(out.len());
    let (a, b, o) = (a.as_ptr(), b.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + V::LANES <= n {
        // SAFETY: the instructions are the caller's contract; lanes `i..i + LANES` lie inside
        // all three slices.
        unsafe { f(V::load(a.add(i)), V::load(b.add(i))).store(o.add(i)) };
        i += V::LANES;
    }
    if i < n {
        // SAFETY: as above, for the `n − i` lanes left.
        unsafe { f(V::load_part(a.add(i), n - i), V::load_part(b.add(i), n - i)).store_part(o.add(i), n - i) };
    }
}

/// The loop without vectors: NEON on AArch64, one element at a time elsewhere.
#[inline(always)]
fn baseline(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(Lanes4, Lanes4) -> Lanes4 + Copy) {
    #[cfg(target_arch = "aarch64")]
    // SAFETY: NEON is part of every AArch64 CPU.
    unsafe {
        each::<super::simd::neon::V4>(a, b, out, f)
    }
    #[cfg(not(target_arch = "aarch64"))]
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

/// The lanes of [`baseline`]: four NEON lanes on AArch64, one `f32` elsewhere.
#[cfg(target_arch = "aarch64")]
type Lanes4 = super::simd::neon::V4;
#[cfg(not(target_arch = "aarch64"))]
type Lanes4 = f32;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{each, periods, Binary, Unary};
    use crate::cpu::simd::x86::{V16, V8};

    // The closures that apply an op are made inside these functions so that they, and the
    // intrinsics inlined into them, are compiled for the functions' instructions.

    /// `out[e] = op(x[e])` over 16 lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn unary_avx512<T: Unary>(op: T, x: &[f32], out: &mut [f32]) {
        // SAFETY: this function is compiled for V16's instructions.
        unsafe { each::<V16>(x, x, out, |v, _| op.apply(v)) }
    }

    /// `out[e] = op(a[e], b[e])` over 16 lanes, a shorter operand repeating.
    ///
    /// # Safety
    /// The CPU has AVX-512F and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn binary_avx512<T: Binary>(op: T, a: &[f32], b: &[f32], out: &mut [f32]) {
        // SAFETY: this function, and so the closure, is compiled for V16's instructions.
        periods(a, b, out, |a, b, out| unsafe { each::<V16>(a, b, out, |x, y| op.apply(x, y)) })
    }

    /// `out[e] = op(x[e])` over 8 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn unary_avx2<T: Unary>(op: T, x: &[f32], out: &mut [f32]) {
        // SAFETY: this function is compiled for V8's instructions.
        unsafe { each::<V8>(x, x, out, |v, _| op.apply(v)) }
    }

    /// `out[e] = op(a[e], b[e])` over 8 lanes, a shorter operand repeating.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn binary_avx2<T: Binary>(op: T, a: &[f32], b: &[f32], out: &mut [f32]) {
        // SAFETY: this function, and so the closure, is compiled for V8's instructions.
        periods(a, b, out, |a, b, out| unsafe { each::<V8>(a, b, out, |x, y| op.apply(x, y)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op over lengths with every tail (and broadcast operands), at every level this CPU
    /// has, against `apply` on one `f32` element by element: the same operations, so the same
    /// bits.
    #[test]
    fn every_op_at_every_level_equals_apply() {
        let value = |i: usize, s: f32| ((i * 37 % 101) as f32 - 50.0) / 10.0 * s;
        let unaries = [
            UnaryOp::Neg,
            UnaryOp::Scale(0.3),
            UnaryOp::Sigmoid,
            UnaryOp::Tanh,
            UnaryOp::Relu,
            UnaryOp::Exp,
            UnaryOp::Log,
            UnaryOp::Gelu,
            UnaryOp::Abs,
            UnaryOp::Offset(-1.5),
            UnaryOp::Detach,
        ];
        let binaries = [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::SigmoidGrad,
            BinaryOp::TanhGrad,
            BinaryOp::ReluGrad,
            BinaryOp::GeluGrad,
            BinaryOp::AbsGrad,
        ];
        for level in Isa::ALL.into_iter().filter(|&l| l <= Isa::detected()) {
            for n in [0, 1, 3, 7, 8, 9, 15, 16, 17, 150, 161] {
                let mut x: Vec<f32> = (0..n).map(|i| value(i, 1.0)).collect();
                if n > 4 {
                    x[1] = 0.0;
                    x[2] = -0.0;
                    x[3] = 200.0;
                    x[4] = -200.0;
                }
                let y: Vec<f32> = (0..n).map(|i| value(i + 5, 0.7) + 0.05).collect();
                let pos: Vec<f32> = x.iter().map(|v| v.abs() + 0.5).collect();
                for op in unaries {
                    let x = if op == UnaryOp::Log { &pos } else { &x };
                    let mut out = vec![f32::NAN; n];
                    unary_on(level, op, x, &mut out);
                    for (e, (&o, &v)) in out.iter().zip(x).enumerate() {
                        let want = op.apply(v);
                        assert_eq!(o.to_bits(), want.to_bits(), "{level}: {op:?}, n {n}, element {e}: {o} vs {want}");
                    }
                }
                for op in binaries {
                    let mut out = vec![f32::NAN; n];
                    binary_on(level, op, &x, &y, &mut out);
                    for (e, ((&o, &a), &b)) in out.iter().zip(&x).zip(&y).enumerate() {
                        assert_eq!(o.to_bits(), op.apply(a, b).to_bits(), "{level}: {op:?}, n {n}, element {e}");
                    }
                }
            }
            // A broadcast operand of 17 against 3 periods, on either side.
            let (short, long): (Vec<f32>, Vec<f32>) =
                ((0..17).map(|i| value(i, 2.0)).collect(), (0..51).map(|i| value(i, 1.0)).collect());
            for swap in [false, true] {
                let mut out = vec![f32::NAN; 51];
                let (a, b) = if swap { (&long, &short) } else { (&short, &long) };
                binary_on(level, BinaryOp::Sub, a, b, &mut out);
                for (e, o) in out.iter().enumerate() {
                    let (p, q) = if swap { (long[e], short[e % 17]) } else { (short[e % 17], long[e]) };
                    assert_eq!(o.to_bits(), (p - q).to_bits(), "{level}: broadcast, swapped {swap}, element {e}");
                }
            }
        }
    }
}
