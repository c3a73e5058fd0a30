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

/// `out[e] = op(x[e])`.
#[inline(always)]
fn unary_generic(op: UnaryOp, x: &[f32], out: &mut [f32]) {
    macro_rules! each {
        ($f:expr) => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = $f(v);
            }
        };
    }
    match op {
        UnaryOp::Neg => each!(|v: f32| -v),
        UnaryOp::Scale(s) => each!(|v: f32| s * v),
        UnaryOp::Sigmoid => each!(|v| UnaryOp::Sigmoid.apply(v)),
        UnaryOp::Tanh => each!(|v| UnaryOp::Tanh.apply(v)),
        UnaryOp::Relu => each!(|v| UnaryOp::Relu.apply(v)),
        UnaryOp::Exp => each!(|v| UnaryOp::Exp.apply(v)),
        UnaryOp::Log => each!(|v| UnaryOp::Log.apply(v)),
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
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    *o = f(x, y);
                }
            } else if a.len() < out.len() {
                for (o, cb) in out.chunks_mut(p).zip(b.chunks(p)) {
                    for ((o, &x), &y) in o.iter_mut().zip(a).zip(cb) {
                        *o = f(x, y);
                    }
                }
            } else {
                for (o, ca) in out.chunks_mut(p).zip(a.chunks(p)) {
                    for ((o, &x), &y) in o.iter_mut().zip(ca).zip(b) {
                        *o = f(x, y);
                    }
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
