//! Whether values are finite: the test that training steps, loss scaling and checkpoints use
//! before they keep a value.

/// Whether every value is finite. A float is not when its exponent bits are all ones; a block's
/// test of every value, or-ed together, has no branch and vectorises on any x86-64 (a scan that
/// stops at the first bad value does not).
pub fn all_finite(values: &[f32]) -> bool {
    const EXPONENT: u32 = 0x7f80_0000;
    values
        .chunks(4096)
        .all(|block| block.iter().fold(0, |bad, v| bad | u32::from(v.to_bits() & EXPONENT == EXPONENT)) == 0)
}
