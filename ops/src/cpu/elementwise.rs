//! Element-wise loops. On x86-64 with AVX-512 they run as intrinsics over whole vectors and one
//! masked vector for the rest (no padding, no copies); with AVX2 + FMA, or elsewhere, as one
//! monomorphised loop per op that the compiler vectorises (checked at run time). Both compute
//! each element with the same operations as [`UnaryOp::apply`] and [`BinaryOp::apply`].

use arbor_core::ir::{BinaryOp, UnaryOp};

/// Defines `$name` dispatching to the AVX-512 kernel, to a copy of `$generic` compiled for
/// AVX2 + FMA when the [active](super::isa::active) level has them, and to the baseline copy
/// otherwise.
macro_rules! dispatch {
    ($name:ident, $wide:path, $fast:ident, $generic:ident, ($($arg:ident: $ty:ty),*)) => {
        pub(crate) fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            match super::isa::active() {
                // SAFETY: the active level is at most what the CPU has.
                super::isa::Isa::Avx512 => return unsafe { $wide($($arg),*) },
                // SAFETY: as above.
                super::isa::Isa::Avx2 => return unsafe { $fast($($arg),*) },
                super::isa::Isa::Baseline => {}
            }
            $generic($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $fast($($arg: $ty),*) {
            $generic($($arg),*)
        }
    };
}

dispatch!(unary, avx512::unary, unary_avx2, unary_generic, (op: UnaryOp, x: &[f32], out: &mut [f32]));
dispatch!(binary, avx512::binary, binary_avx2, binary_generic, (op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]));

/// Elements per pass of a generic vectorised loop (eight AVX2 vectors). Each loop runs over whole
/// blocks, then over one block padded with zeros holding the rest, so a row of 150 values has no
/// scalar tail (a tail of exponentials costs as much as the vectorised rest of the row).
const BLOCK: usize = 64;

/// `out[e] = f(a[e], b[e])`, one plain loop (the compiler vectorises it).
#[inline(always)]
fn each2(a: &[f32], b: &[f32], out: &mut [f32], f: &impl Fn(f32, f32) -> f32) {
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

/// `out[e] = f(a[e], b[e])` over the common length, whole blocks then a padded one.
#[inline(always)]
fn map2(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32) {
    let n = a.len().min(b.len()).min(out.len());
    let body = n / BLOCK * BLOCK;
    each2(&a[..body], &b[..body], &mut out[..body], &f);
    if body < n {
        let (mut p, mut q, mut r) = ([0.0; BLOCK], [0.0; BLOCK], [0.0; BLOCK]);
        p[..n - body].copy_from_slice(&a[body..n]);
        q[..n - body].copy_from_slice(&b[body..n]);
        let len = std::hint::black_box(BLOCK);
        each2(&p[..len], &q[..len], &mut r[..len], &f);
        out[body..n].copy_from_slice(&r[..n - body]);
    }
}

/// `out[e] = f(x[e])`: the two-operand loop reading `x` for both.
#[inline(always)]
fn map1(x: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32) {
    map2(x, x, out, |v, _| f(v));
}

/// `out[e] = op(x[e])`.
#[inline(always)]
fn unary_generic(op: UnaryOp, x: &[f32], out: &mut [f32]) {
    match op {
        UnaryOp::Neg => map1(x, out, |v: f32| -v),
        UnaryOp::Scale(s) => map1(x, out, |v: f32| s * v),
        UnaryOp::Sigmoid => map1(x, out, |v| UnaryOp::Sigmoid.apply(v)),
        UnaryOp::Tanh => map1(x, out, |v| UnaryOp::Tanh.apply(v)),
        UnaryOp::Relu => map1(x, out, |v| UnaryOp::Relu.apply(v)),
        UnaryOp::Exp => map1(x, out, |v| UnaryOp::Exp.apply(v)),
        UnaryOp::Log => map1(x, out, |v| UnaryOp::Log.apply(v)),
    }
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

/// `out[e] = op(a[e], b[e])`, where an operand shorter than `out` repeats with its own period
/// (a broadcast parameter).
#[inline(always)]
fn binary_generic(op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]) {
    macro_rules! each {
        ($f:expr) => {
            periods(a, b, out, |a, b, out| map2(a, b, out, $f))
        };
    }
    match op {
        BinaryOp::Add => each!(|x: f32, y: f32| x + y),
        BinaryOp::Sub => each!(|x: f32, y: f32| x - y),
        BinaryOp::Mul => each!(|x: f32, y: f32| x * y),
        BinaryOp::Div => each!(|x: f32, y: f32| x / y),
        BinaryOp::SigmoidGrad => each!(|x, y| BinaryOp::SigmoidGrad.apply(x, y)),
        BinaryOp::TanhGrad => each!(|x, y| BinaryOp::TanhGrad.apply(x, y)),
        BinaryOp::ReluGrad => each!(|x, y| BinaryOp::ReluGrad.apply(x, y)),
    }
}

/// The AVX-512 kernels: whole vectors, then one masked vector.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::periods;
    use arbor_core::ir::{BinaryOp, UnaryOp};
    use std::arch::x86_64::*;

    const LANES: usize = 16;

    /// `out[e] = f(a[e], b[e])` over the common length.
    #[inline(always)]
    unsafe fn map2(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(__m512, __m512) -> __m512) {
        let n = a.len().min(b.len()).min(out.len());
        let (a, b, o) = (a.as_ptr(), b.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i + LANES <= n {
            _mm512_storeu_ps(o.add(i), f(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i))));
            i += LANES;
        }
        if i < n {
            let m = ((1u32 << (n - i)) - 1) as __mmask16;
            _mm512_mask_storeu_ps(
                o.add(i),
                m,
                f(_mm512_maskz_loadu_ps(m, a.add(i)), _mm512_maskz_loadu_ps(m, b.add(i))),
            );
        }
    }

    /// `e^x` as [`arbor_core::ir::exp_f32`] computes it, lane by lane.
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        let set = _mm512_set1_ps;
        let x = _mm512_min_ps(set(88.0), _mm512_max_ps(set(-87.0), x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(_mm512_fmadd_ps(
            x,
            set(std::f32::consts::LOG2_E),
            set(0.5),
        ));
        let r = _mm512_fmadd_ps(n, set(2.121_944_4e-4), _mm512_fmadd_ps(n, set(-0.693_359_4), x));
        let mut p = set(1.987_569_2e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm512_fmadd_ps(p, r, set(c));
        }
        let e = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, set(1.0)));
        let bits = _mm512_castps_si512(_mm512_add_ps(n, set(12_582_912.0)));
        let biased = _mm512_add_epi32(_mm512_sub_epi32(bits, _mm512_set1_epi32(0x4B40_0000)), _mm512_set1_epi32(127));
        _mm512_mul_ps(e, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
    }

    /// `op` lane by lane, as [`UnaryOp::apply`] computes it.
    #[inline(always)]
    unsafe fn unary_lanes(op: UnaryOp, x: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        match op {
            UnaryOp::Neg => _mm512_mul_ps(_mm512_set1_ps(-1.0), x),
            UnaryOp::Scale(s) => _mm512_mul_ps(_mm512_set1_ps(s), x),
            UnaryOp::Sigmoid => _mm512_div_ps(one, _mm512_add_ps(one, exp(_mm512_mul_ps(_mm512_set1_ps(-1.0), x)))),
            UnaryOp::Tanh => {
                let e = exp(_mm512_mul_ps(_mm512_set1_ps(2.0), x));
                _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0), _mm512_add_ps(e, one)))
            }
            UnaryOp::Relu => _mm512_max_ps(x, _mm512_setzero_ps()),
            UnaryOp::Exp => exp(x),
            UnaryOp::Log => {
                let mut v = [0.0f32; LANES];
                _mm512_storeu_ps(v.as_mut_ptr(), x);
                _mm512_loadu_ps(v.map(f32::ln).as_ptr())
            }
        }
    }

    /// `op` lane by lane, as [`BinaryOp::apply`] computes it.
    #[inline(always)]
    unsafe fn binary_lanes(op: BinaryOp, a: __m512, b: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        match op {
            BinaryOp::Add => _mm512_add_ps(a, b),
            BinaryOp::Sub => _mm512_sub_ps(a, b),
            BinaryOp::Mul => _mm512_mul_ps(a, b),
            BinaryOp::Div => _mm512_div_ps(a, b),
            BinaryOp::SigmoidGrad => _mm512_mul_ps(_mm512_mul_ps(b, a), _mm512_sub_ps(one, a)),
            BinaryOp::TanhGrad => _mm512_mul_ps(b, _mm512_sub_ps(one, _mm512_mul_ps(a, a))),
            BinaryOp::ReluGrad => _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, _mm512_setzero_ps()), b),
        }
    }

    /// `out[e] = op(x[e])`.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn unary(op: UnaryOp, x: &[f32], out: &mut [f32]) {
        macro_rules! each {
            ($op:expr) => {
                map2(x, x, out, |v, _| unary_lanes($op, v))
            };
        }
        // One loop per op (the op a constant in each), as in the generic copy.
        match op {
            UnaryOp::Neg => each!(UnaryOp::Neg),
            UnaryOp::Scale(s) => each!(UnaryOp::Scale(s)),
            UnaryOp::Sigmoid => each!(UnaryOp::Sigmoid),
            UnaryOp::Tanh => each!(UnaryOp::Tanh),
            UnaryOp::Relu => each!(UnaryOp::Relu),
            UnaryOp::Exp => each!(UnaryOp::Exp),
            UnaryOp::Log => each!(UnaryOp::Log),
        }
    }

    /// `out[e] = op(a[e], b[e])`, a shorter operand repeating with its own period.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn binary(op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]) {
        macro_rules! each {
            ($op:expr) => {
                periods(a, b, out, |a, b, out| map2(a, b, out, |x, y| binary_lanes($op, x, y)))
            };
        }
        match op {
            BinaryOp::Add => each!(BinaryOp::Add),
            BinaryOp::Sub => each!(BinaryOp::Sub),
            BinaryOp::Mul => each!(BinaryOp::Mul),
            BinaryOp::Div => each!(BinaryOp::Div),
            BinaryOp::SigmoidGrad => each!(BinaryOp::SigmoidGrad),
            BinaryOp::TanhGrad => each!(BinaryOp::TanhGrad),
            BinaryOp::ReluGrad => each!(BinaryOp::ReluGrad),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op over lengths with every tail (and broadcast operands), against `apply` element
    /// by element: the same operations, so the same bits.
    #[test]
    fn every_op_equals_apply() {
        let value = |i: usize, s: f32| ((i * 37 % 101) as f32 - 50.0) / 10.0 * s;
        let unaries = [UnaryOp::Neg, UnaryOp::Scale(0.3), UnaryOp::Sigmoid, UnaryOp::Tanh, UnaryOp::Relu, UnaryOp::Exp];
        let binaries = [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::SigmoidGrad,
            BinaryOp::TanhGrad,
            BinaryOp::ReluGrad,
        ];
        for n in [0, 1, 15, 16, 17, 150, 161] {
            let x: Vec<f32> = (0..n).map(|i| value(i, 1.0)).collect();
            let y: Vec<f32> = (0..n).map(|i| value(i + 5, 0.7) + 0.05).collect();
            for op in unaries {
                let mut out = vec![f32::NAN; n];
                unary(op, &x, &mut out);
                for (e, (&o, &v)) in out.iter().zip(&x).enumerate() {
                    assert_eq!(
                        o.to_bits(),
                        op.apply(v).to_bits(),
                        "{op:?}, n {n}, element {e}: {o} vs {}",
                        op.apply(v)
                    );
                }
            }
            let mut out = vec![f32::NAN; n];
            let pos: Vec<f32> = x.iter().map(|v| v.abs() + 0.5).collect();
            unary(UnaryOp::Log, &pos, &mut out);
            assert!(out.iter().zip(&pos).all(|(o, v)| o.to_bits() == v.ln().to_bits()), "log, n {n}");
            for op in binaries {
                let mut out = vec![f32::NAN; n];
                binary(op, &x, &y, &mut out);
                for (e, ((&o, &a), &b)) in out.iter().zip(&x).zip(&y).enumerate() {
                    assert_eq!(o.to_bits(), op.apply(a, b).to_bits(), "{op:?}, n {n}, element {e}");
                }
            }
        }
        // A broadcast operand of 17 against 3 periods, on either side.
        let (short, long): (Vec<f32>, Vec<f32>) =
            ((0..17).map(|i| value(i, 2.0)).collect(), (0..51).map(|i| value(i, 1.0)).collect());
        for swap in [false, true] {
            let mut out = vec![f32::NAN; 51];
            let (a, b) = if swap { (&long, &short) } else { (&short, &long) };
            binary(BinaryOp::Sub, a, b, &mut out);
            for (e, o) in out.iter().enumerate() {
                let (p, q) = if swap { (long[e], short[e % 17]) } else { (short[e % 17], long[e]) };
                assert_eq!(o.to_bits(), (p - q).to_bits(), "broadcast, swapped {swap}, element {e}");
            }
        }
    }
}
