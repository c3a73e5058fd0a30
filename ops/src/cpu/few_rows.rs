//! Products whose left operand has a few rows (`C = A·B` with B row-major: a task's states times
//! a weight matrix at small batch sizes). The `gemm` crate packs B on every call, which costs as
//! much as the product itself when A has a handful of rows; here B is read in place, 64 columns
//! at a time, into AVX-512 accumulators for four rows of A at once.

/// Products with at most this many rows take the unpacked path (when the CPU has AVX-512): at
/// hidden 150 it is 2–3× faster than packing up to 8 rows, 1.1× at 32, even at 60
/// (`cargo bench --bench kernels -- gemm_tree_lstm`).
pub(crate) const FEW_ROWS: usize = 32;

/// `C (+)= A·B` for `m ≤ FEW_ROWS` rows, row-major with row strides `lda`, `ldb`, `ldc`; `false`
/// (nothing done) when the CPU lacks AVX-512, so the caller takes the general path.
///
/// The slices must span the operands: `a` holds `m` rows of `k`, `b` holds `k` rows of `n`, `c`
/// holds `m` rows of `n` (checked).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    (m, n, k): (usize, usize, usize),
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    accumulate: bool,
) -> bool {
    let spans = |rows: usize, cols: usize, ld: usize, len: usize| rows == 0 || (rows - 1) * ld + cols <= len;
    if m > FEW_ROWS || !spans(m, k, lda, a.len()) || !spans(k, n, ldb, b.len()) || !spans(m, n, ldc, c.len()) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, and every access stays inside the spans checked above
        // (column tails are masked).
        unsafe { avx512::product(m, n, k, a.as_ptr(), lda, b.as_ptr(), ldb, c.as_mut_ptr(), ldc, accumulate) };
        return true;
    }
    let _ = accumulate;
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Columns per block: four 16-lane vectors.
    const COLS: usize = 64;

    /// Column blocks outside, blocks of four rows inside: a block's slice of B (k × 64) is read
    /// from memory once and from cache for every further row block.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn product(
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        let mut j = 0;
        while j < n {
            let width = (n - j).min(COLS);
            let mask: [__mmask16; 4] = std::array::from_fn(|q| {
                let lanes = width.saturating_sub(16 * q).min(16);
                ((1u32 << lanes) - 1) as __mmask16
            });
            let (b, c) = (b.add(j), c.add(j));
            let mut i = 0;
            while i < m {
                let (a, c) = (a.add(i * lda), c.add(i * ldc));
                let rows = (m - i).min(4);
                match rows {
                    4 => block::<4>(k, a, lda, b, ldb, c, ldc, mask, accumulate),
                    3 => block::<3>(k, a, lda, b, ldb, c, ldc, mask, accumulate),
                    2 => block::<2>(k, a, lda, b, ldb, c, ldc, mask, accumulate),
                    _ => block::<1>(k, a, lda, b, ldb, c, ldc, mask, accumulate),
                }
                i += rows;
            }
            j += COLS;
        }
    }

    /// `R` rows by (up to) 64 columns of C, the columns `mask` selects: each row of B is loaded
    /// once and used for all `R` rows.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const R: usize>(
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        mask: [__mmask16; 4],
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for p in 0..k {
            let row = b.add(p * ldb);
            let bv: [__m512; 4] = std::array::from_fn(|q| _mm512_maskz_loadu_ps(mask[q], row.add(16 * q)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(r * lda + p));
                for q in 0..4 {
                    acc[q] = _mm512_fmadd_ps(av, bv[q], acc[q]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for q in 0..4 {
                let dst = c.add(r * ldc + 16 * q);
                let v = if accumulate { _mm512_add_ps(acc[q], _mm512_maskz_loadu_ps(mask[q], dst)) } else { acc[q] };
                _mm512_mask_storeu_ps(dst, mask[q], v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row count, a column tail, padded strides and accumulation, against the plain sum.
    #[test]
    fn few_row_products_equal_the_plain_sum() {
        let (n, k) = (75, 9);
        let (lda, ldb, ldc) = (k + 2, n + 3, n + 1);
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        for m in 1..=FEW_ROWS {
            for accumulate in [false, true] {
                let a: Vec<f32> = (0..m * lda).map(value).collect();
                let b: Vec<f32> = (0..k * ldb).map(|i| value(i + 7)).collect();
                let mut c: Vec<f32> = (0..m * ldc).map(|i| value(i + 3)).collect();
                let mut want = c.clone();
                for i in 0..m {
                    for j in 0..n {
                        let s: f32 = (0..k).map(|p| a[i * lda + p] * b[p * ldb + j]).sum();
                        want[i * ldc + j] = if accumulate { want[i * ldc + j] + s } else { s };
                    }
                }
                if !product((m, n, k), (&a, lda), (&b, ldb), (&mut c, ldc), accumulate) {
                    return; // no AVX-512 here: the general path covers these products
                }
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "m {m}: {x} vs {y}");
                }
            }
        }
    }

    #[test]
    fn operands_too_short_are_left_to_the_general_path() {
        let mut c = vec![0.0; 4];
        assert!(!product((2, 2, 2), (&[1.0; 3], 2), (&[1.0; 4], 2), (&mut c, 2), false));
        assert!(!product((FEW_ROWS + 1, 1, 1), (&[1.0; 64], 1), (&[1.0], 1), (&mut [0.0; 64], 1), false));
    }
}
