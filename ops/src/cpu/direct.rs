//! Products `C (+)= op(A)·B` with A and B read in place (unpacked), for the products of a
//! minibatch: a task's states times a weight matrix, its gate gradients times a transposed copy of
//! one, or a parameter gradient `Xᵀ·dY` over every vertex. The `gemm` crate packs B on every
//! call, which costs as much as the product when a task has a few dozen rows; a weight matrix of
//! a Tree-LSTM (150 × 750) fits in a core's L2 cache, so reading it in place is as fast as reading
//! a packed copy.
//!
//! The AVX-512 kernel walks column blocks of 64 (four vectors) outside and blocks of up to six
//! rows of op(A) inside, so a block of B is read from memory once and from cache for every further
//! row block; each block keeps its 6 × 4 accumulators in registers. A element `(i, p)` is read at
//! `i·rs + p·cs`: row-major A has `(lda, 1)`, a transposed one `(1, lda)`.

/// `C (+)= op(A)·B` over the columns `cols` of B and C, for `m` rows of C and an inner dimension
/// `k`, with B and C row-major (row strides `ldb`, `ldc`) and A stored row-major with row stride
/// `lda`, transposed when `ta`; `false` (nothing done) when the [active](super::isa::active) level
/// lacks AVX-512, so the caller takes the general path.
///
/// The slices must span the operands: `a` holds `m` rows of `k` (`k` rows of `m` when `ta`), `b`
/// holds `k` rows reaching column `cols.end`, `c` holds `m` rows reaching column `cols.end`
/// (checked).
pub(crate) fn product(
    (m, k): (usize, usize),
    cols: std::ops::Range<usize>,
    (a, lda, ta): (&[f32], usize, bool),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    accumulate: bool,
) -> bool {
    let spans = |rows: usize, width: usize, ld: usize, len: usize| {
        rows == 0 || (rows - 1).checked_mul(ld).and_then(|x| x.checked_add(width)).is_some_and(|end| end <= len)
    };
    let (a_rows, a_cols) = if ta { (k, m) } else { (m, k) };
    if !spans(a_rows, a_cols, lda, a.len()) || !spans(k, cols.end, ldb, b.len()) || !spans(m, cols.end, ldc, c.len()) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if super::isa::active() == super::isa::Isa::Avx512 {
        if m == 0 || cols.is_empty() {
            return true;
        }
        let ops = avx512::Operands {
            m,
            k,
            a: a.as_ptr(),
            rs: if ta { 1 } else { lda },
            cs: if ta { lda } else { 1 },
            b: b[cols.start..].as_ptr(),
            ldb,
            c: c[cols.start..].as_mut_ptr(),
            ldc,
            accumulate,
        };
        // SAFETY: the CPU has AVX-512F, and every access stays inside the spans checked above
        // (column tails are masked).
        unsafe { avx512::product(ops, cols.len()) };
        return true;
    }
    let _ = accumulate;
    false
}

/// Rows `ps` of the `k × n` transpose of the `n × k` matrix `b` (row stride `ldb`), into `out`
/// (those rows only, row stride `n`): 16 × 16 blocks transposed in registers on AVX-512 (a
/// quarter of a cycle per element instead of a load and a store each), element by element
/// elsewhere. `false` (nothing done) unless `b` spans the matrix and `out` the rows.
pub(crate) fn transpose(
    b: &[f32],
    (n, k, ldb): (usize, usize, usize),
    ps: std::ops::Range<usize>,
    out: &mut [f32],
) -> bool {
    let spans_b = n == 0 || (n - 1).checked_mul(ldb).and_then(|x| x.checked_add(k)).is_some_and(|end| end <= b.len());
    if !spans_b || ps.end > k || out.len() < ps.len() * n {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if super::isa::active() == super::isa::Isa::Avx512 {
        for j0 in (0..n).step_by(16) {
            for p0 in ps.clone().step_by(16) {
                let (jw, pw) = ((n - j0).min(16), (ps.end - p0).min(16));
                // SAFETY: the CPU has AVX-512F; rows `j0..j0 + jw`, columns `p0..p0 + pw` of b
                // and rows `p0..p0 + pw` (relative to `ps`), columns `j0..j0 + jw` of out lie
                // inside the spans checked above.
                unsafe {
                    avx512::transpose_block(
                        b.as_ptr().add(j0 * ldb + p0),
                        ldb,
                        out.as_mut_ptr().add((p0 - ps.start) * n + j0),
                        n,
                        (jw, pw),
                    )
                };
            }
        }
        return true;
    }
    for (row, p) in out.chunks_exact_mut(n.max(1)).zip(ps) {
        for (j, o) in row.iter_mut().enumerate() {
            *o = b[j * ldb + p];
        }
    }
    true
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Rows of A per block.
    const ROWS: usize = 6;
    /// Vectors of 16 columns per block.
    const VECTORS: usize = 4;

    /// A product's operands (A with row and column strides, B and C row-major and at the first
    /// column) and whether C accumulates.
    #[derive(Clone, Copy)]
    pub(super) struct Operands {
        pub(super) m: usize,
        pub(super) k: usize,
        pub(super) a: *const f32,
        pub(super) rs: usize,
        pub(super) cs: usize,
        pub(super) b: *const f32,
        pub(super) ldb: usize,
        pub(super) c: *mut f32,
        pub(super) ldc: usize,
        pub(super) accumulate: bool,
    }

    /// Column blocks outside, row blocks inside, over `width` columns.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn product(ops: Operands, width: usize) {
        let mut j = 0;
        while j < width {
            let cols = (width - j).min(16 * VECTORS);
            let vectors = cols.div_ceil(16);
            let tail = cols - 16 * (vectors - 1);
            let mask = ((1u32 << tail) - 1) as __mmask16;
            let at = Operands { b: ops.b.add(j), c: ops.c.add(j), ..ops };
            match vectors {
                4 => rows::<4>(at, mask),
                3 => rows::<3>(at, mask),
                2 => rows::<2>(at, mask),
                _ => rows::<1>(at, mask),
            }
            j += cols;
        }
    }

    /// Every row block of one column block of `V` vectors (the last one masked).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const V: usize>(ops: Operands, mask: __mmask16) {
        let mut i = 0;
        while i < ops.m {
            let at = Operands { a: ops.a.add(i * ops.rs), c: ops.c.add(i * ops.ldc), ..ops };
            match (ops.m - i).min(ROWS) {
                6 => block::<6, V>(at, mask),
                5 => block::<5, V>(at, mask),
                4 => block::<4, V>(at, mask),
                3 => block::<3, V>(at, mask),
                2 => block::<2, V>(at, mask),
                _ => block::<1, V>(at, mask),
            }
            i += ROWS;
        }
    }

    /// `R` rows by `V` vectors of C: each row of B's block is loaded once and used for all `R`
    /// rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const R: usize, const V: usize>(ops: Operands, mask: __mmask16) {
        let Operands { k, a, rs, cs, b, ldb, c, ldc, accumulate, .. } = ops;
        let load = |p: *const f32, q: usize| {
            if q + 1 < V {
                _mm512_loadu_ps(p.add(16 * q))
            } else {
                _mm512_maskz_loadu_ps(mask, p.add(16 * q))
            }
        };
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        for p in 0..k {
            let row = b.add(p * ldb);
            let bv: [__m512; V] = std::array::from_fn(|q| load(row, q));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(r * rs + p * cs));
                for q in 0..V {
                    acc[q] = _mm512_fmadd_ps(av, bv[q], acc[q]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let dst = c.add(r * ldc);
            for (q, &sum) in acc.iter().enumerate() {
                let v = if accumulate { _mm512_add_ps(sum, load(dst, q)) } else { sum };
                if q + 1 < V {
                    _mm512_storeu_ps(dst.add(16 * q), v);
                } else {
                    _mm512_mask_storeu_ps(dst.add(16 * q), mask, v);
                }
            }
        }
    }
    /// Transposes a `rows × cols` block (both at most 16) at `src` (row stride `lds`) into a
    /// `cols × rows` block at `dst` (row stride `ldd`), in registers: four rounds, each swapping
    /// the off-diagonal sub-blocks of size 8, 4, 2 and 1 (together they swap the bits of every
    /// row index with those of its column index).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose_block(
        src: *const f32,
        lds: usize,
        dst: *mut f32,
        ldd: usize,
        (rows, cols): (usize, usize),
    ) {
        let (load, store) = (((1u32 << cols) - 1) as __mmask16, ((1u32 << rows) - 1) as __mmask16);
        let mut r: [__m512; 16] = std::array::from_fn(|i| {
            if i < rows {
                _mm512_maskz_loadu_ps(load, src.add(i * lds))
            } else {
                _mm512_setzero_ps()
            }
        });
        swap::<8>(&mut r);
        swap::<4>(&mut r);
        swap::<2>(&mut r);
        swap::<1>(&mut r);
        for (q, &v) in r.iter().enumerate() {
            if q < cols {
                _mm512_mask_storeu_ps(dst.add(q * ldd), store, v);
            }
        }
    }

    /// One round of [`transpose_block`]: row i (bit `B` clear) takes row i + B's low columns
    /// into its high ones, and row i + B takes row i's high columns into its low ones.
    #[inline(always)]
    unsafe fn swap<const B: usize>(r: &mut [__m512; 16]) {
        const fn index(b: usize, high: bool) -> [i32; 16] {
            let mut x = [0; 16];
            let mut c = 0;
            while c < 16 {
                x[c] = match (c & b == 0, high) {
                    (true, false) => c,
                    (false, false) => 16 + c - b,
                    (true, true) => c + b,
                    (false, true) => 16 + c,
                } as i32;
                c += 1;
            }
            x
        }
        let low = _mm512_loadu_si512(index(B, false).as_ptr().cast());
        let high = _mm512_loadu_si512(index(B, true).as_ptr().cast());
        for i in 0..16 {
            if i & B == 0 {
                let (x, y) = (r[i], r[i + B]);
                r[i] = _mm512_permutex2var_ps(x, low, y);
                r[i + B] = _mm512_permutex2var_ps(x, high, y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `product` for every row count up to 13, A as stored and transposed, and column ranges
    /// with every tail, with and without accumulation, against the plain sum; every stride padded.
    #[test]
    fn direct_products_equal_the_plain_sum() {
        let (n, k) = (150, 9);
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        for (m, ta) in (0..=13).flat_map(|m| [(m, false), (m, true)]) {
            let (lda, ldb, ldc) = (if ta { m + 2 } else { k + 2 }, n + 3, n + 1);
            let a_at = |i: usize, p: usize| if ta { p * lda + i } else { i * lda + p };
            for cols in [0..n, 5..n, 0..17, 16..80, 3..3, 64..150] {
                for accumulate in [false, true] {
                    let a: Vec<f32> = (0..if ta { k } else { m } * lda).map(value).collect();
                    let b: Vec<f32> = (0..k * ldb).map(|i| value(i + 7)).collect();
                    let mut c: Vec<f32> = (0..m * ldc).map(|i| value(i + 3)).collect();
                    let mut want = c.clone();
                    for i in 0..m {
                        for j in cols.clone() {
                            let s: f32 = (0..k).map(|p| a[a_at(i, p)] * b[p * ldb + j]).sum();
                            want[i * ldc + j] = if accumulate { want[i * ldc + j] + s } else { s };
                        }
                    }
                    if !product((m, k), cols.clone(), (&a, lda, ta), (&b, ldb), (&mut c, ldc), accumulate) {
                        return; // no AVX-512 here: the general path covers these products
                    }
                    for (x, y) in c.iter().zip(&want) {
                        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "m {m}, cols {cols:?}: {x} vs {y}");
                    }
                }
            }
        }
    }

    /// `transpose` of matrices with every edge width, over all rows and over a part, against
    /// element-by-element reads; spans too short are refused.
    #[test]
    fn transposes_equal_element_reads() {
        for (n, k) in [(1usize, 1usize), (5, 14), (16, 16), (17, 31), (150, 47), (33, 750)] {
            let ldb = k + 3;
            let b: Vec<f32> = (0..n * ldb).map(|i| i as f32 * 0.5 - 7.0).collect();
            for ps in [0..k, k / 3..k, 0..k.div_ceil(2)] {
                let mut out = vec![f32::NAN; ps.len() * n];
                assert!(transpose(&b, (n, k, ldb), ps.clone(), &mut out));
                for (q, p) in ps.clone().enumerate() {
                    for j in 0..n {
                        assert_eq!(out[q * n + j], b[j * ldb + p], "n {n}, k {k}, rows {ps:?}: ({p}, {j})");
                    }
                }
            }
            assert!(!transpose(&b[..b.len() - 4], (n, k, ldb), 0..k, &mut vec![0.0; k * n]));
            assert!(!transpose(&b, (n, k, ldb), 0..k, &mut vec![0.0; k * n - 1]));
        }
    }

    #[test]
    fn operands_too_short_are_left_to_the_general_path() {
        let mut c = vec![0.0; 4];
        assert!(!product((2, 2), 0..2, (&[1.0; 3], 2, false), (&[1.0; 4], 2), (&mut c, 2), false));
        assert!(!product((2, 2), 0..3, (&[1.0; 4], 2, false), (&[1.0; 4], 2), (&mut c, 2), false));
        assert!(!product((3, 2), 0..2, (&[1.0; 5], 3, true), (&[1.0; 4], 2), (&mut [0.0; 6], 2), false));
    }
}
