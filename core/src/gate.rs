//! A training step decided where its gradients are: the sums of the squares of the gradients
//! ([`Backend::sum_squares`](crate::backend::Backend::sum_squares)) are written as partial sums
//! into a small block on the backend, [`Backend::decide`](crate::backend::Backend::decide)
//! turns them into the step's **gate** — the factor that clips every gradient to a global norm
//! and whether the step is applied (every gradient finite) — and the optimizer's updates read
//! the gate there ([`OptimAt::gate`](crate::backend::OptimAt::gate)). On a device nothing of
//! this crosses to the host until the step's one read; the arithmetic is defined here once.
//!
//! f64 values live in the backends' f32 buffers as two f32 words each: the low half of the
//! bits, then the high half — the bytes of an f64 in little-endian memory, so a device kernel
//! reads them as a `double` at an even offset.

use crate::backend::Loc;
use crate::error::{Error, Result};

/// The partial sums a sum of squares writes per region: f64 slots (two f32 words each),
/// added in order to give the region's sum (a device spreads its atomic adds over them).
pub const SUM_SLOTS: usize = 64;

/// The f32 words of one region's partial sums.
pub const SUM_WORDS: usize = 2 * SUM_SLOTS;

/// The words of a gate: the factor every gradient is multiplied by (clipping; 1 without), then
/// 1 where the step is applied or 0 where it is skipped (a gradient is not finite).
pub const GATE_LEN: usize = 2;

/// An error naming `backend` and `op` unless `at` is at an even offset, where f64 words start
/// (a device reads them as a `double`).
pub fn check_even(backend: &'static str, op: &str, at: Loc) -> Result<()> {
    if at.offset % 2 == 1 {
        let msg = format!("f64 words at the odd offset {}", at.offset);
        return Err(Error::Backend { backend, op: op.into(), msg });
    }
    Ok(())
}

/// Writes `x` into `dst[0..2]` as two f32 words (see the module's layout).
pub fn put_f64(dst: &mut [f32], x: f64) {
    let bits = x.to_bits();
    dst[0] = f32::from_bits(bits as u32);
    dst[1] = f32::from_bits((bits >> 32) as u32);
}

/// The f64 written by [`put_f64`] at `src[0..2]`.
pub fn get_f64(src: &[f32]) -> f64 {
    f64::from_bits(u64::from(src[0].to_bits()) | (u64::from(src[1].to_bits()) << 32))
}

/// The gate of a step from the partial sums `words` ([`SUM_WORDS`] a region, `regions` of
/// them): each region's slots are added in order, then the regions in order, from 0; the
/// factor is `clip / norm` where the norm (the total's square root, as f32) exceeds `clip`
/// (∞: no clipping), else 1; the step is applied where every region's sum is finite. Every
/// backend's [`decide`](crate::backend::Backend::decide) gives these bits.
pub fn decide(words: &[f32], regions: usize, clip: f32) -> [f32; GATE_LEN] {
    let (mut total, mut finite) = (0.0f64, true);
    for sum in region_sums(words, regions) {
        finite &= sum.is_finite();
        total += sum;
    }
    let norm = total.sqrt() as f32;
    let factor = if norm > clip && norm > 0.0 { clip / norm } else { 1.0 };
    [factor, if finite { 1.0 } else { 0.0 }]
}

/// The sums of the first `regions` regions of partial sums `words`, each its slots added in
/// order from 0.
pub fn region_sums(words: &[f32], regions: usize) -> Vec<f64> {
    let sum = |region: &[f32]| region.chunks_exact(2).fold(0.0f64, |s, slot| s + get_f64(slot));
    words.chunks_exact(SUM_WORDS).take(regions).map(sum).collect()
}

/// Whether the gate `gate` applies its step.
pub fn applies(gate: &[f32]) -> bool {
    gate.get(1).is_some_and(|&a| a != 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f64_words_round_trip_every_value() {
        let mut w = [0.0f32; 2];
        for x in [0.0, -0.0, 1.5e300, f64::INFINITY, f64::MIN_POSITIVE / 3.0, 123.456] {
            put_f64(&mut w, x);
            assert_eq!(get_f64(&w).to_bits(), x.to_bits());
        }
        put_f64(&mut w, f64::NAN);
        assert!(get_f64(&w).is_nan());
    }

    #[test]
    fn the_gate_clips_to_the_norm_and_skips_what_is_not_finite() {
        let mut words = vec![0.0f32; 2 * SUM_WORDS];
        put_f64(&mut words[0..2], 9.0);
        put_f64(&mut words[10..12], 7.0);
        put_f64(&mut words[SUM_WORDS..SUM_WORDS + 2], 9.0);
        // |g|² = 25: norm 5.
        assert_eq!(decide(&words, 2, 2.5), [0.5, 1.0]);
        assert_eq!(decide(&words, 2, f32::INFINITY), [1.0, 1.0]);
        assert_eq!(decide(&words, 1, 2.0), [0.5, 1.0]);
        put_f64(&mut words[SUM_WORDS + 4..SUM_WORDS + 6], f64::INFINITY);
        assert_eq!(decide(&words, 1, 2.0)[1], 1.0, "the second region is not asked about");
        assert!(!applies(&decide(&words, 2, 2.0)));
        assert!(applies(&decide(&[], 0, 1.0)));
    }
}
