//! Element-wise loops: each op's formula (from [`arbor_core::ir::elementwise`], written once over
//! [`Lanes`]) run over whole vectors and then one partial vector, on AVX-512 (16 lanes), AVX2 +
//! FMA (8 lanes) or NEON (4 lanes), as the [active](super::isa::active) level allows, and one
//! element at a time elsewhere. Every [`Lanes`] primitive rounds as its `f32` counterpart does,
//! so every path computes each element with the bits of [`UnaryOp::apply`] and
//! [`BinaryOp::apply`].

use super::isa::{self, Isa};
use arbor_core::ir::elementwise::{Binary, BinaryVisitor, Lanes, Unary, UnaryVisitor};
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

/// A vector of `f32` lanes that loads and stores.
trait Vector: Lanes {
    /// Lanes per vector.
    const LANES: usize;
    /// # Safety
    /// `LANES` values are readable at `p`.
    unsafe fn load(p: *const f32) -> Self;
    /// # Safety
    /// `LANES` values are writable at `p`.
    unsafe fn store(self, p: *mut f32);
    /// The first `n < LANES` lanes from `p`, the rest zero.
    ///
    /// # Safety
    /// `n` values are readable at `p`.
    unsafe fn load_part(p: *const f32, n: usize) -> Self;
    /// Stores the first `n < LANES` lanes at `p`.
    ///
    /// # Safety
    /// `n` values are writable at `p`.
    unsafe fn store_part(self, p: *mut f32, n: usize);
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
    // SAFETY (all accesses): `i + LANES ≤ n` for whole vectors, `n − i` lanes for the last.
    while i + V::LANES <= n {
        unsafe { f(V::load(a.add(i)), V::load(b.add(i))).store(o.add(i)) };
        i += V::LANES;
    }
    if i < n {
        unsafe { f(V::load_part(a.add(i), n - i), V::load_part(b.add(i), n - i)).store_part(o.add(i), n - i) };
    }
}

/// The loop without vectors: NEON on AArch64, one element at a time elsewhere.
#[inline(always)]
fn baseline(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(Lanes4, Lanes4) -> Lanes4 + Copy) {
    #[cfg(target_arch = "aarch64")]
    // SAFETY: NEON is part of every AArch64 CPU.
    unsafe {
        each::<neon::V4>(a, b, out, f)
    }
    #[cfg(not(target_arch = "aarch64"))]
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

/// The lanes of [`baseline`]: four NEON lanes on AArch64, one `f32` elsewhere.
#[cfg(target_arch = "aarch64")]
type Lanes4 = neon::V4;
#[cfg(not(target_arch = "aarch64"))]
type Lanes4 = f32;

/// Implements [`Lanes`] and [`Vector`] for an x86 or NEON vector type from its intrinsics:
/// `max(x, b)` must give `b` where `x` is NaN (as `f32::max` does), `min` and the `max` of
/// `clamp` must keep a NaN second operand.
macro_rules! lanes {
    ($v:ident, $raw:ty, splat: $splat:expr, add: $add:expr, sub: $sub:expr, mul: $mul:expr, div: $div:expr,
     fma: $fma:expr, max: $max:expr, clamp: $clamp:expr, floor: $floor:expr, pow2i: $pow2i:expr,
     positive: $pos:expr, load: $load:expr, store: $store:expr, load_part: $load_part:expr,
     store_part: $store_part:expr, lanes: $lanes:expr) => {
        #[derive(Clone, Copy)]
        pub(super) struct $v($raw);

        // SAFETY (every method): only ever built and used inside functions compiled for the
        // instructions these intrinsics need.
        impl Lanes for $v {
            #[inline(always)]
            fn splat(x: f32) -> Self {
                $v(unsafe { $splat(x) })
            }
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                $v(unsafe { $add(self.0, b.0) })
            }
            #[inline(always)]
            fn sub(self, b: Self) -> Self {
                $v(unsafe { $sub(self.0, b.0) })
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                $v(unsafe { $mul(self.0, b.0) })
            }
            #[inline(always)]
            fn div(self, b: Self) -> Self {
                $v(unsafe { $div(self.0, b.0) })
            }
            #[inline(always)]
            fn neg(self) -> Self {
                // −0 − x flips the sign of every number, zeros included, as `-x` does.
                $v(unsafe { $sub($splat(-0.0), self.0) })
            }
            #[inline(always)]
            fn mul_add(self, b: Self, c: Self) -> Self {
                $v(unsafe { $fma(self.0, b.0, c.0) })
            }
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                $v(unsafe { $max(self.0, b.0) })
            }
            #[inline(always)]
            fn clamp(self, lo: f32, hi: f32) -> Self {
                $v(unsafe { $clamp(self.0, $splat(lo), $splat(hi)) })
            }
            #[inline(always)]
            fn floor(self) -> Self {
                $v(unsafe { $floor(self.0) })
            }
            #[inline(always)]
            fn pow2i(self) -> Self {
                $v(unsafe { $pow2i(self.0) })
            }
            #[inline(always)]
            fn positive_then(self, b: Self) -> Self {
                $v(unsafe { $pos(self.0, b.0) })
            }
            #[inline(always)]
            fn ln(self) -> Self {
                let mut v = [0.0f32; 16];
                unsafe { $store(v.as_mut_ptr(), self.0) };
                v = v.map(f32::ln);
                $v(unsafe { $load(v.as_ptr()) })
            }
        }

        impl Vector for $v {
            const LANES: usize = $lanes;
            #[inline(always)]
            unsafe fn load(p: *const f32) -> Self {
                $v(unsafe { $load(p) })
            }
            #[inline(always)]
            unsafe fn store(self, p: *mut f32) {
                unsafe { $store(p, self.0) }
            }
            #[inline(always)]
            unsafe fn load_part(p: *const f32, n: usize) -> Self {
                $v(unsafe { $load_part(p, n) })
            }
            #[inline(always)]
            unsafe fn store_part(self, p: *mut f32, n: usize) {
                unsafe { $store_part(p, n, self.0) }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{each, periods, Binary, Lanes, Unary, Vector};
    use std::arch::x86_64::*;

    lanes!(V16, __m512,
        splat: _mm512_set1_ps, add: _mm512_add_ps, sub: _mm512_sub_ps, mul: _mm512_mul_ps, div: _mm512_div_ps,
        fma: _mm512_fmadd_ps,
        // `max_ps(x, y)` is `y` where either is NaN.
        max: _mm512_max_ps, clamp: |x, lo, hi| _mm512_min_ps(hi, _mm512_max_ps(lo, x)),
        floor: _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>,
        pow2i: |n| {
            let bits = _mm512_castps_si512(_mm512_add_ps(n, _mm512_set1_ps(12_582_912.0)));
            let biased = _mm512_add_epi32(_mm512_sub_epi32(bits, _mm512_set1_epi32(0x4B40_0000)), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased))
        },
        positive: |a, b| _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, _mm512_setzero_ps()), b),
        load: _mm512_loadu_ps, store: _mm512_storeu_ps,
        load_part: |p, n| _mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, p),
        store_part: |p, n, v| _mm512_mask_storeu_ps(p, ((1u32 << n) - 1) as __mmask16, v),
        lanes: 16);

    lanes!(V8, __m256,
        splat: _mm256_set1_ps, add: _mm256_add_ps, sub: _mm256_sub_ps, mul: _mm256_mul_ps, div: _mm256_div_ps,
        fma: _mm256_fmadd_ps,
        max: _mm256_max_ps, clamp: |x, lo, hi| _mm256_min_ps(hi, _mm256_max_ps(lo, x)),
        floor: _mm256_floor_ps,
        pow2i: |n| {
            let bits = _mm256_castps_si256(_mm256_add_ps(n, _mm256_set1_ps(12_582_912.0)));
            let biased = _mm256_add_epi32(_mm256_sub_epi32(bits, _mm256_set1_epi32(0x4B40_0000)), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased))
        },
        positive: |a, b| _mm256_and_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_setzero_ps()), b),
        load: _mm256_loadu_ps, store: _mm256_storeu_ps,
        load_part: |p, n| _mm256_maskload_ps(p, first(n)),
        store_part: |p, n, v| _mm256_maskstore_ps(p, first(n), v),
        lanes: 8);

    /// The mask of the first `n` of 8 lanes.
    #[inline(always)]
    unsafe fn first(n: usize) -> __m256i {
        unsafe { _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)) }
    }

    // The closures that apply an op are made inside these functions so that they, and the
    // intrinsics inlined into them, are compiled for the functions' instructions.

    /// `out[e] = op(x[e])` over 16 lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn unary_avx512<T: Unary>(op: T, x: &[f32], out: &mut [f32]) {
        unsafe { each::<V16>(x, x, out, |v, _| op.apply(v)) }
    }

    /// `out[e] = op(a[e], b[e])` over 16 lanes, a shorter operand repeating.
    ///
    /// # Safety
    /// The CPU has AVX-512F and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn binary_avx512<T: Binary>(op: T, a: &[f32], b: &[f32], out: &mut [f32]) {
        periods(a, b, out, |a, b, out| unsafe { each::<V16>(a, b, out, |x, y| op.apply(x, y)) })
    }

    /// `out[e] = op(x[e])` over 8 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn unary_avx2<T: Unary>(op: T, x: &[f32], out: &mut [f32]) {
        unsafe { each::<V8>(x, x, out, |v, _| op.apply(v)) }
    }

    /// `out[e] = op(a[e], b[e])` over 8 lanes, a shorter operand repeating.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn binary_avx2<T: Binary>(op: T, a: &[f32], b: &[f32], out: &mut [f32]) {
        periods(a, b, out, |a, b, out| unsafe { each::<V8>(a, b, out, |x, y| op.apply(x, y)) })
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{Lanes, Vector};
    use std::arch::aarch64::*;

    lanes!(V4, float32x4_t,
        splat: vdupq_n_f32, add: vaddq_f32, sub: vsubq_f32, mul: vmulq_f32, div: vdivq_f32,
        fma: |a, b, c| vfmaq_f32(c, a, b),
        // `maxnm` takes the number where one is NaN, as `f32::max` does; `min`/`max` keep NaN.
        max: vmaxnmq_f32, clamp: |x, lo, hi| vminq_f32(hi, vmaxq_f32(lo, x)),
        floor: vrndmq_f32,
        pow2i: |n| {
            let bits = vreinterpretq_u32_f32(vaddq_f32(n, vdupq_n_f32(12_582_912.0)));
            let biased = vaddq_u32(vsubq_u32(bits, vdupq_n_u32(0x4B40_0000)), vdupq_n_u32(127));
            vreinterpretq_f32_u32(vshlq_n_u32::<23>(biased))
        },
        positive: |a, b| vreinterpretq_f32_u32(vandq_u32(vcgtq_f32(a, vdupq_n_f32(0.0)), vreinterpretq_u32_f32(b))),
        load: vld1q_f32, store: vst1q_f32,
        load_part: |p: *const f32, n| {
            let mut v = [0.0f32; 4];
            std::ptr::copy_nonoverlapping(p, v.as_mut_ptr(), n);
            vld1q_f32(v.as_ptr())
        },
        store_part: |p: *mut f32, n, x| {
            let mut v = [0.0f32; 4];
            vst1q_f32(v.as_mut_ptr(), x);
            std::ptr::copy_nonoverlapping(v.as_ptr(), p, n);
        },
        lanes: 4);
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
