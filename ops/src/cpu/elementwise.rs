//! Element-wise loops, one monomorphised loop per op so each vectorises; on x86-64 they run as
//! AVX-512 or AVX2 + FMA code when the CPU has it (checked at run time).

use arbor_core::ir::{BinaryOp, UnaryOp};

/// Defines `$name` dispatching to a copy of `$generic` compiled for AVX-512 or for AVX2 + FMA when
/// the CPU has them, and to the baseline copy otherwise.
macro_rules! dispatch {
    ($name:ident, $wide:ident, $fast:ident, $generic:ident, ($($arg:ident: $ty:ty),*)) => {
        pub(crate) fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports the features the wide copy is compiled for.
                    return unsafe { $wide($($arg),*) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports the features the fast copy is compiled for.
                    return unsafe { $fast($($arg),*) };
                }
            }
            $generic($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn $wide($($arg: $ty),*) {
            $generic($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $fast($($arg: $ty),*) {
            $generic($($arg),*)
        }
    };
}

dispatch!(unary, unary_avx512, unary_avx2, unary_generic, (op: UnaryOp, x: &[f32], out: &mut [f32]));
dispatch!(binary, binary_avx512, binary_avx2, binary_generic, (op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]));

/// Elements per pass of a vectorised loop (four AVX-512 vectors). Each loop runs over whole
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

/// `out[e] = op(a[e], b[e])`, where an operand shorter than `out` repeats with its own period
/// (a broadcast parameter).
#[inline(always)]
fn binary_generic(op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]) {
    macro_rules! each {
        ($f:expr) => {{
            let f = $f;
            let p = a.len().min(b.len()).max(1);
            if a.len() == out.len() && b.len() == out.len() {
                map2(a, b, out, f);
            } else if a.len() < out.len() {
                for (o, cb) in out.chunks_mut(p).zip(b.chunks(p)) {
                    map2(a, cb, o, f);
                }
            } else {
                for (o, ca) in out.chunks_mut(p).zip(a.chunks(p)) {
                    map2(ca, b, o, f);
                }
            }
        }};
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
