//! Dynamic loss scaling for half-precision products: the loss gradient is multiplied by a scale
//! before the backward pass, so that small gradients survive f16's narrow range, and the
//! parameter gradients are divided by it afterwards. A step whose gradients overflowed is
//! skipped and the scale halved; after a run of good steps the scale doubles.

/// The largest scale is `2^MAX_EXPONENT`.
const MAX_EXPONENT: i32 = 100;

/// A dynamic loss scale (powers of two, so scaling and unscaling are exact in f32).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    scale: f32,
    growth_interval: u32,
    good_steps: u32,
    skipped: u64,
}

impl LossScaler {
    /// A scale of `2^16` that doubles after every 2000 steps without overflow.
    pub fn dynamic() -> LossScaler {
        LossScaler::new(65536.0, 2000)
    }

    /// A scale starting at `initial` (rounded to a power of two between 1 and 2^100) that
    /// doubles after `growth_interval` good steps in a row (0: never), up to 2^100.
    pub fn new(initial: f32, growth_interval: u32) -> LossScaler {
        let scale = if initial.is_finite() && initial > 1.0 {
            2f32.powi((initial.log2().round() as i32).min(MAX_EXPONENT))
        } else {
            1.0
        };
        LossScaler { scale, growth_interval, good_steps: 0, skipped: 0 }
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Steps skipped because their gradients overflowed.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Records a step whose unscaled gradients are `finite` or not; returns whether the step
    /// should be applied. Overflow halves the scale (never below 1).
    pub fn update(&mut self, finite: bool) -> bool {
        if finite {
            self.good_steps += 1;
            if self.growth_interval > 0
                && self.good_steps >= self.growth_interval
                && self.scale < 2f32.powi(MAX_EXPONENT)
            {
                self.scale *= 2.0;
                self.good_steps = 0;
            }
        } else {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
            self.skipped += 1;
        }
        finite
    }
}

/// Multiplies every value of `tensors` by `factor`.
pub(crate) fn scale_all<'a>(tensors: impl IntoIterator<Item = &'a mut Vec<f32>>, factor: f32) {
    for t in tensors {
        for x in t.iter_mut() {
            *x *= factor;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_halves_and_a_good_run_doubles() {
        let mut s = LossScaler::new(1000.0, 3);
        assert_eq!(s.scale(), 1024.0, "rounded to a power of two");
        assert!(!s.update(false));
        assert_eq!((s.scale(), s.skipped()), (512.0, 1));
        assert!(s.update(true) && s.update(true));
        assert_eq!(s.scale(), 512.0);
        assert!(s.update(true));
        assert_eq!(s.scale(), 1024.0);
        assert_eq!(LossScaler::new(f32::MAX, 0).scale(), 2f32.powi(100), "capped, never infinite");
        let mut low = LossScaler::new(1.0, 0);
        low.update(false);
        assert_eq!(low.scale(), 1.0, "never below 1");
        for _ in 0..10 {
            low.update(true);
        }
        assert_eq!(low.scale(), 1.0, "interval 0 never grows");
    }
}
