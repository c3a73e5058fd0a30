//! Products whose left operand has a few rows (`C = A·B` or `C = A·Bᵀ` with B row-major: a
//! task's states times a weight matrix, or its gate gradients times the transposed weights, at
//! small batch sizes). The `gemm` crate packs B on every call, which costs as much as the product
//! itself when A has a handful of rows; here B is read in place into AVX-512 accumulators for
//! four rows of A at once: 64 columns of B at a time, or (transposed) four rows of B at a time,
//! as dot products.

/// Products with at most this many rows take the unpacked path (when the CPU has AVX-512): at
/// hidden 150 it is 2–3× faster than packing up to 8 rows, 1.1× at 32, even at 60
/// (`cargo bench --bench kernels -- gemm_tree_lstm`).
pub(crate) const FEW_ROWS: usize = 32;

/// Rows for which the transposed form (`A·Bᵀ`) takes the unpacked path: from 2 to 16 it is up to
/// 3× faster than packing; the `gemm` crate is faster for one row (its own vector path) and from
/// 32 rows (`cargo bench --bench kernels -- gemm_tree_lstm_backward`).
const FEW_ROWS_TRANSPOSED: std::ops::RangeInclusive<usize> = 2..=16;

/// `C (+)= A·B`, or `A·Bᵀ` when `tb`, for `m ≤ FEW_ROWS` rows, row-major with row strides
/// `lda`, `ldb`, `ldc`; `false` (nothing done) when the CPU lacks AVX-512, so the caller takes
/// the general path.
///
/// The slices must span the operands: `a` holds `m` rows of `k`, `b` holds `k` rows of `n` (`n`
/// rows of `k` when `tb`), `c` holds `m` rows of `n` (checked).
pub(crate) fn product(
    (m, n, k): (usize, usize, usize),
    (a, lda): (&[f32], usize),
    (b, ldb, tb): (&[f32], usize, bool),
    (c, ldc): (&mut [f32], usize),
    accumulate: bool,
) -> bool {
    let spans = |rows: usize, cols: usize, ld: usize, len: usize| {
        (rows - 1).checked_mul(ld).and_then(|x| x.checked_add(cols)).is_some_and(|end| end <= len)
    };
    let (b_rows, b_cols) = if tb { (n, k) } else { (k, n) };
    if m == 0
        || n == 0
        || k == 0
        || m > FEW_ROWS
        || tb && !FEW_ROWS_TRANSPOSED.contains(&m)
        || !spans(m, k, lda, a.len())
        || !spans(b_rows, b_cols, ldb, b.len())
        || !spans(m, n, ldc, c.len())
    {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        let ops =
            avx512::Operands { m, n, k, a: a.as_ptr(), lda, b: b.as_ptr(), ldb, c: c.as_mut_ptr(), ldc, accumulate };
        // SAFETY: the CPU has AVX-512F, and every access stays inside the spans checked above
        // (tails are masked or clamped to the last row).
        unsafe {
            if tb {
                avx512::product_nt(ops);
            } else {
                avx512::product(ops);
            }
        }
        return true;
    }
    let _ = (accumulate, tb);
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Columns per block: four 16-lane vectors.
    const COLS: usize = 64;

    /// A product's shape, operands (row-major, with row strides) and whether C accumulates.
    #[derive(Clone, Copy)]
    pub(super) struct Operands {
        pub(super) m: usize,
        pub(super) n: usize,
        pub(super) k: usize,
        pub(super) a: *const f32,
        pub(super) lda: usize,
        pub(super) b: *const f32,
        pub(super) ldb: usize,
        pub(super) c: *mut f32,
        pub(super) ldc: usize,
        pub(super) accumulate: bool,
    }

    /// Column blocks outside, blocks of four rows inside: a block's slice of B (k × 64) is read
    /// from memory once and from cache for every further row block.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn product(ops: Operands) {
        let Operands { m, n, a, lda, b, c, ldc, .. } = ops;
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
                let at = Operands { a, b, c, ..ops };
                match rows {
                    4 => block::<4>(at, mask),
                    3 => block::<3>(at, mask),
                    2 => block::<2>(at, mask),
                    _ => block::<1>(at, mask),
                }
                i += rows;
            }
            j += COLS;
        }
    }

    /// `R` rows by (up to) 64 columns of C from the rows and columns `ops` starts at, the
    /// columns `mask` selects: each row of B is loaded once and used for all `R` rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const R: usize>(ops: Operands, mask: [__mmask16; 4]) {
        let Operands { k, a, lda, b, ldb, c, ldc, accumulate, .. } = ops;
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for p in 0..k {
            let row = b.add(p * ldb);
            // A vector whose lanes are all past the last column is neither loaded nor stored.
            let bv: [__m512; 4] = std::array::from_fn(|q| {
                if mask[q] == 0 {
                    _mm512_setzero_ps()
                } else {
                    _mm512_maskz_loadu_ps(mask[q], row.add(16 * q))
                }
            });
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(r * lda + p));
                for q in 0..4 {
                    acc[q] = _mm512_fmadd_ps(av, bv[q], acc[q]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for q in (0..4).filter(|&q| mask[q] != 0) {
                let dst = c.add(r * ldc + 16 * q);
                let v = if accumulate { _mm512_add_ps(acc[q], _mm512_maskz_loadu_ps(mask[q], dst)) } else { acc[q] };
                _mm512_mask_storeu_ps(dst, mask[q], v);
            }
        }
    }

    /// `C (+)= A·Bᵀ` (B holds `n` rows of `k`) as dot products: blocks of four rows of A by four
    /// rows of B, 16 lanes of `k` at a time, reduced at the end. Rows past `m` or `n` in the
    /// last block repeat the last row and are not stored.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn product_nt(ops: Operands) {
        let Operands { m, n, k, a, lda, b, ldb, c, ldc, accumulate } = ops;
        if m == 0 || n == 0 {
            return;
        }
        for j in (0..n).step_by(4) {
            let b_rows: [*const f32; 4] = std::array::from_fn(|q| b.add((j + q).min(n - 1) * ldb));
            for i in (0..m).step_by(4) {
                let a_rows: [*const f32; 4] = std::array::from_fn(|r| a.add((i + r).min(m - 1) * lda));
                let mut acc = [[_mm512_setzero_ps(); 4]; 4];
                for p in (0..k).step_by(16) {
                    let mask = if k - p >= 16 { 0xffff } else { ((1u32 << (k - p)) - 1) as __mmask16 };
                    let bv: [__m512; 4] = std::array::from_fn(|q| _mm512_maskz_loadu_ps(mask, b_rows[q].add(p)));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let av = _mm512_maskz_loadu_ps(mask, a_rows[r].add(p));
                        for q in 0..4 {
                            acc[q] = _mm512_fmadd_ps(av, bv[q], acc[q]);
                        }
                    }
                }
                for (r, acc) in acc.iter().enumerate().take(m - i) {
                    for (q, &sum) in acc.iter().enumerate().take(n - j) {
                        let dst = c.add((i + r) * ldc + j + q);
                        let s = _mm512_reduce_add_ps(sum);
                        *dst = if accumulate { *dst + s } else { s };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `product` for every row count in `rows`, with and without accumulation, against the plain
    /// sum; B is `k × n` (or `n × k` when `tb`), every stride padded.
    fn check(rows: std::ops::RangeInclusive<usize>, (n, k): (usize, usize), tb: bool) {
        let (lda, ldb, ldc) = (k + 2, if tb { k + 3 } else { n + 3 }, n + 1);
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        for m in rows {
            for accumulate in [false, true] {
                let a: Vec<f32> = (0..m * lda).map(value).collect();
                let b: Vec<f32> = (0..if tb { n } else { k } * ldb).map(|i| value(i + 7)).collect();
                let mut c: Vec<f32> = (0..m * ldc).map(|i| value(i + 3)).collect();
                let mut want = c.clone();
                for i in 0..m {
                    for j in 0..n {
                        let b_at = |p: usize| if tb { b[j * ldb + p] } else { b[p * ldb + j] };
                        let s: f32 = (0..k).map(|p| a[i * lda + p] * b_at(p)).sum();
                        want[i * ldc + j] = if accumulate { want[i * ldc + j] + s } else { s };
                    }
                }
                if !product((m, n, k), (&a, lda), (&b, ldb, tb), (&mut c, ldc), accumulate) {
                    return; // no AVX-512 here: the general path covers these products
                }
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "m {m}, tb {tb}: {x} vs {y}");
                }
            }
        }
    }

    /// Every row count, column tails (n = 75: a partly and a wholly masked vector).
    #[test]
    fn few_row_products_equal_the_plain_sum() {
        check(1..=FEW_ROWS, (75, 9), false);
    }

    /// The transposed form: row and lane tails (n = 7, k = 37).
    #[test]
    fn few_row_products_with_b_transposed_equal_the_plain_sum() {
        check(FEW_ROWS_TRANSPOSED, (7, 37), true);
    }

    #[test]
    fn operands_too_short_are_left_to_the_general_path() {
        let mut c = vec![0.0; 4];
        assert!(!product((2, 2, 2), (&[1.0; 3], 2), (&[1.0; 4], 2, false), (&mut c, 2), false));
        assert!(!product((2, 3, 2), (&[1.0; 4], 2), (&[1.0; 4], 2, true), (&mut [0.0; 6], 3), false));
        assert!(!product((FEW_ROWS + 1, 1, 1), (&[1.0; 64], 1), (&[1.0], 1, false), (&mut [0.0; 64], 1), false));
    }
}
