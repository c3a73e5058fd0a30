//! Vectors of `f32` lanes for the CPU kernels: [`Lanes`] (the arithmetic element-wise formulas
//! are written in) plus loads and stores, for AVX-512 (16 lanes), AVX2 + FMA (8) and NEON (4).
//! Code generic over [`Vector`] is written once and compiled per instruction set; it must run
//! inside a function compiled for that set (`#[target_feature]`), with any closures it takes
//! made there too, or the intrinsics stay calls.

use arbor_core::ir::elementwise::Lanes;

/// A vector of `f32` lanes that loads and stores.
pub(crate) trait Vector: Lanes {
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

/// Implements [`Lanes`] and [`Vector`] for an x86 or NEON vector type from its intrinsics:
/// `max(x, b)` must give `b` where `x` is NaN (as `f32::max` does), `min` and the `max` of
/// `clamp` must keep a NaN second operand.
macro_rules! lanes {
    ($v:ident, $raw:ty, splat: $splat:expr, add: $add:expr, sub: $sub:expr, mul: $mul:expr, div: $div:expr,
     fma: $fma:expr, abs: $abs:expr, max: $max:expr, clamp: $clamp:expr, floor: $floor:expr, pow2i: $pow2i:expr,
     positive: $pos:expr, load: $load:expr, store: $store:expr, load_part: $load_part:expr,
     store_part: $store_part:expr, lanes: $lanes:expr) => {
        #[derive(Clone, Copy)]
        pub(crate) struct $v($raw);

        impl Lanes for $v {
            #[inline(always)]
            fn splat(x: f32) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $splat(x) })
            }
            #[inline(always)]
            fn add(self, b: Self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $add(self.0, b.0) })
            }
            #[inline(always)]
            fn sub(self, b: Self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $sub(self.0, b.0) })
            }
            #[inline(always)]
            fn mul(self, b: Self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $mul(self.0, b.0) })
            }
            #[inline(always)]
            fn div(self, b: Self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $div(self.0, b.0) })
            }
            #[inline(always)]
            fn neg(self) -> Self {
                // −0 − x flips the sign of every number, zeros included, as `-x` does.
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $sub($splat(-0.0), self.0) })
            }
            #[inline(always)]
            fn mul_add(self, b: Self, c: Self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $fma(self.0, b.0, c.0) })
            }
            #[inline(always)]
            fn abs(self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $abs(self.0) })
            }
            #[inline(always)]
            fn max(self, b: Self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $max(self.0, b.0) })
            }
            #[inline(always)]
            fn clamp(self, lo: f32, hi: f32) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $clamp(self.0, $splat(lo), $splat(hi)) })
            }
            #[inline(always)]
            fn floor(self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $floor(self.0) })
            }
            #[inline(always)]
            fn pow2i(self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $pow2i(self.0) })
            }
            #[inline(always)]
            fn positive_then(self, b: Self) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $pos(self.0, b.0) })
            }
            #[inline(always)]
            fn ln(self) -> Self {
                let mut v = [0.0f32; 16];
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                unsafe { $store(v.as_mut_ptr(), self.0) };
                v = v.map(f32::ln);
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $load(v.as_ptr()) })
            }
        }

        impl Vector for $v {
            const LANES: usize = $lanes;
            #[inline(always)]
            unsafe fn load(p: *const f32) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $load(p) })
            }
            #[inline(always)]
            unsafe fn store(self, p: *mut f32) {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                unsafe { $store(p, self.0) }
            }
            #[inline(always)]
            unsafe fn load_part(p: *const f32, n: usize) -> Self {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                $v(unsafe { $load_part(p, n) })
            }
            #[inline(always)]
            unsafe fn store_part(self, p: *mut f32, n: usize) {
                // SAFETY: values of this type exist only in code compiled for its instructions;
                // pointers are the caller's contract.
                unsafe { $store_part(p, n, self.0) }
            }
        }
    };
}

/// Asks the cache for the cache lines of `x`, to be read or written soon (a row of the arena,
/// which lies anywhere and would otherwise wait on memory); nothing on other architectures.
#[inline]
pub(crate) fn prefetch(x: &[f32]) {
    for line in x.chunks(16) {
        prefetch_line(line.as_ptr());
    }
}

/// Asks the cache for the cache line holding the element at `p` (any address: a prefetch reads
/// nothing and cannot fault); nothing on other architectures.
#[inline(always)]
pub(crate) fn prefetch_line(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Lanes, Vector};
    use std::arch::x86_64::*;

    lanes!(V16, __m512,
        splat: _mm512_set1_ps, add: _mm512_add_ps, sub: _mm512_sub_ps, mul: _mm512_mul_ps, div: _mm512_div_ps,
        fma: _mm512_fmadd_ps, abs: _mm512_abs_ps,
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
        fma: _mm256_fmadd_ps, abs: |x| _mm256_andnot_ps(_mm256_set1_ps(-0.0), x),
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
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    unsafe fn first(n: usize) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)) }
    }
}

#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    use super::{Lanes, Vector};
    use std::arch::aarch64::*;

    lanes!(V4, float32x4_t,
        splat: vdupq_n_f32, add: vaddq_f32, sub: vsubq_f32, mul: vmulq_f32, div: vdivq_f32,
        fma: |a, b, c| vfmaq_f32(c, a, b), abs: vabsq_f32,
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
