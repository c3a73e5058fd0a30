//! Products `C (+)= A·Bᵀ` of a few rows with a parameter `B` stored `n × k` row-major, as dot
//! products of A's rows with B's rows as stored: the backward pass's `dG·Uᵀ` of a small task
//! (batch 1's tree levels). The [direct](super::direct) kernel needs `Bᵀ` row-major, a copy made
//! again after every parameter update, which at batch 1 costs as much as the step's products;
//! here B is read in place, a row at a time, once per group of rows of A.
//!
//! Each element is the sum of 16 chains of fused multiply-adds, chain `l` over the inner indices
//! `p ≡ l (mod 16)` in order (past `k`, multiply-adds of zeros), and the 16 sums are added in a
//! fixed tree — lanes `l` and `l + 8`, then `l + 4`, `l + 2`, `l + 1` — so the bits do not depend
//! on the instruction set (one 16-lane vector, two of 8 or four of 4 per step) or on how columns
//! are shared between threads. They differ from the direct kernel's single chain, so whether a
//! product runs here depends only on its shape ([`suits`]).

use super::isa::Isa;
use super::simd::Vector;

/// Rows of A up to which a product with a transposed parameter runs here.
const MAX_ROWS: usize = 16;

/// [`MAX_ROWS`] on AVX-512: up to 32 rows, dot products cost less than the transposed copy the
/// direct kernel needs there once a step (batch 1's word-vector gradient `(Σ dy)·Wᵀ` over a
/// sentence's 17–32 distinct words: training 1.04×), and little more than the direct kernel
/// where a step's other products share the copy (batch 64: 0.99). Below AVX-512 such products
/// run on the `gemm` crate, which packs B as stored (AVX2: batch-1 training 0.96 at 32 here).
const MAX_ROWS_AVX512: usize = 32;

/// Lanes per step of the inner dimension (the chains per element).
const CHAINS: usize = 16;

/// Rows of A per group: each row of B is read once per group.
const GROUP: usize = 4;

/// Whether a product of `m` rows with a transposed parameter runs here at `level`.
pub(crate) fn suits(level: Isa, m: usize) -> bool {
    let most = if level == Isa::Avx512 { MAX_ROWS_AVX512 } else { MAX_ROWS };
    m <= most && super::direct::has_kernel(level)
}

/// `C (+)= A·Bᵀ` over the columns `cols` of C (rows of B), for `m` rows of A and an inner
/// dimension `k`, with A (`m × k`), B (`n × k`) and C row-major (row strides `lda`, `ldb`,
/// `ldc`), at the instruction-set level `level` (at most what the CPU has); `false` (nothing
/// done) where the level has no kernel or a slice does not span its operand.
pub(crate) fn product(
    level: Isa,
    (m, k): (usize, usize),
    cols: std::ops::Range<usize>,
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    accumulate: bool,
) -> bool {
    use super::direct::spans;
    if !spans(m, k, lda, a.len()) || !spans(cols.end, k, ldb, b.len()) || !spans(m, cols.end, ldc, c.len()) {
        return false;
    }
    if !super::direct::has_kernel(level) {
        return false;
    }
    let ops = Dots { m, k, a: a.as_ptr(), lda, b: b.as_ptr(), ldb, c: c.as_mut_ptr(), ldc, accumulate };
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: each kernel runs only at a level the CPU has, and every access stays inside the
        // spans checked above (the last step of the inner dimension is a partial load).
        Isa::Avx512 => unsafe { x86::dots_avx512(ops, cols) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::dots_avx2(ops, cols) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above (NEON is part of every AArch64 CPU).
        _ => unsafe { columns::<super::simd::neon::V4, 4, 1>(ops, cols) },
        #[cfg(not(target_arch = "aarch64"))]
        _ => return false,
    }
    true
}

/// The operands: A, B and C row-major at their first element, and whether C accumulates.
#[derive(Clone, Copy)]
struct Dots {
    m: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
}

/// Every column in `cols` (`J` at a time, then one at a time), every group of rows, with `V`
/// vectors of `W` per step of [`CHAINS`].
///
/// # Safety
/// The CPU runs `W`'s instructions (the caller is compiled for them); the operands span `m` rows,
/// `k` columns and the columns `cols`; `V · W::LANES = CHAINS`.
#[inline(always)]
unsafe fn columns<W: Vector, const V: usize, const J: usize>(ops: Dots, cols: std::ops::Range<usize>) {
    let mut j = cols.start;
    while j < cols.end {
        let wide = cols.end - j >= J;
        let mut i = 0;
        while i < ops.m {
            // SAFETY: as for this function; rows `i..` of A and C, rows `j..` of B lie inside them.
            unsafe {
                match ((ops.m - i).min(GROUP), wide) {
                    (4, true) => group::<W, V, 4, J>(ops, i, j),
                    (3, true) => group::<W, V, 3, J>(ops, i, j),
                    (2, true) => group::<W, V, 2, J>(ops, i, j),
                    (_, true) => group::<W, V, 1, J>(ops, i, j),
                    (4, false) => group::<W, V, 4, 1>(ops, i, j),
                    (3, false) => group::<W, V, 3, 1>(ops, i, j),
                    (2, false) => group::<W, V, 2, 1>(ops, i, j),
                    (_, false) => group::<W, V, 1, 1>(ops, i, j),
                }
            }
            i += GROUP;
        }
        j += if wide { J } else { 1 };
    }
}

/// Elements `(i..i + R, j..j + C)` of C: each vector of A's rows is loaded once for the `C`
/// columns, each of B's once for the `R` rows.
///
/// # Safety
/// As [`columns`]; rows `i..i + R` lie inside A and C, rows `j..j + C` inside B.
#[inline(always)]
unsafe fn group<W: Vector, const V: usize, const R: usize, const C: usize>(ops: Dots, i: usize, j: usize) {
    let Dots { k, a, lda, b, ldb, c, ldc, accumulate, .. } = ops;
    let mut acc = [[[W::splat(0.0); V]; C]; R];
    let mut p = 0;
    while p < k {
        for q in 0..V {
            let at = p + q * W::LANES;
            let mut bv = [W::splat(0.0); C];
            for (x, v) in bv.iter_mut().enumerate() {
                // SAFETY: row `j + x` of B holds `k` elements.
                *v = unsafe { load::<W>(b.add((j + x) * ldb), at, k) };
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row `i + r` of A holds `k` elements.
                let av = unsafe { load::<W>(a.add((i + r) * lda), at, k) };
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    acc[q] = av.mul_add(bv, acc[q]);
                }
            }
        }
        p += CHAINS;
    }
    for (r, acc) in acc.iter().enumerate() {
        for (x, acc) in acc.iter().enumerate() {
            let mut lanes = [0.0f32; CHAINS];
            for (q, v) in acc.iter().enumerate() {
                // SAFETY: `lanes` holds `V · LANES = CHAINS` values.
                unsafe { v.store(lanes.as_mut_ptr().add(q * W::LANES)) };
            }
            let sum = reduce(lanes);
            // SAFETY: element `(i + r, j + x)` lies inside C.
            let dst = unsafe { &mut *c.add((i + r) * ldc + j + x) };
            *dst = if accumulate { sum + *dst } else { sum };
        }
    }
}

/// The vector of a row's elements from `at`: those before `k`, zeros after. (No closure: it would
/// be compiled without the caller's instructions.)
///
/// # Safety
/// The row holds `k` elements.
#[inline(always)]
unsafe fn load<W: Vector>(row: *const f32, at: usize, k: usize) -> W {
    let n = k.saturating_sub(at).min(W::LANES);
    // SAFETY: the `n` elements from `at` lie inside the row.
    unsafe {
        if n == W::LANES {
            W::load(row.add(at))
        } else if n == 0 {
            W::splat(0.0)
        } else {
            W::load_part(row.add(at), n)
        }
    }
}

/// The 16 chains' sums added in the fixed tree: `l` and `l + 8`, then `l + 4`, `l + 2`, `l + 1`.
#[inline(always)]
fn reduce(mut x: [f32; CHAINS]) -> f32 {
    let mut half = CHAINS / 2;
    while half > 0 {
        for l in 0..half {
            x[l] += x[l + half];
        }
        half /= 2;
    }
    x[0]
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{columns, Dots};
    use crate::cpu::simd::x86::{V16, V8};

    /// [`columns`] over one 16-lane vector per step, four columns at a time (16 accumulators).
    ///
    /// # Safety
    /// The CPU has AVX-512F and FMA; as [`columns`].
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn dots_avx512(ops: Dots, cols: std::ops::Range<usize>) {
        // SAFETY: this function is compiled for V16's instructions; the rest is its contract.
        unsafe { columns::<V16, 1, 4>(ops, cols) }
    }

    /// [`columns`] over two 8-lane vectors per step: four columns at a time for one row of A,
    /// two for two rows (each vector of A loaded once for them; ~2× and ~1.5× for batch 1's
    /// `dG·Uᵀ`), one for more rows (whose accumulators fill the registers).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; as [`columns`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots_avx2(ops: Dots, cols: std::ops::Range<usize>) {
        // SAFETY: this function is compiled for V8's instructions; the rest is its contract.
        unsafe {
            match ops.m {
                1 => columns::<V8, 2, 4>(ops, cols),
                2 => columns::<V8, 2, 2>(ops, cols),
                _ => columns::<V8, 2, 1>(ops, cols),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::direct::checks::{levels, same_bits, value};
    use super::*;

    /// At every level this CPU has, for every row count up to the most, inner dimensions short of,
    /// equal to and past a step, every column range, with and without accumulation, strides
    /// padded: bit for bit the 16 chains and the fixed tree of the module's definition.
    #[test]
    fn dot_products_are_sixteen_chains_added_in_a_fixed_tree() {
        let n = 21;
        for level in levels() {
            for (m, k) in (0..=MAX_ROWS_AVX512).flat_map(|m| [(m, 1), (m, 7), (m, 16), (m, 45)]) {
                let (lda, ldb, ldc) = (k + 2, k + 3, n + 1);
                for cols in [0..n, 5..n, 3..3, 20..21] {
                    for accumulate in [false, true] {
                        let a: Vec<f32> = (0..m * lda).map(value).collect();
                        let b: Vec<f32> = (0..n * ldb).map(|i| value(i + 7)).collect();
                        let mut c: Vec<f32> = (0..m * ldc).map(|i| value(i + 3)).collect();
                        let mut want = c.clone();
                        for i in 0..m {
                            for j in cols.clone() {
                                let mut lanes = [0.0f32; CHAINS];
                                for p in 0..k.div_ceil(CHAINS) * CHAINS {
                                    let (x, y) = if p < k { (a[i * lda + p], b[j * ldb + p]) } else { (0.0, 0.0) };
                                    lanes[p % CHAINS] = x.mul_add(y, lanes[p % CHAINS]);
                                }
                                let s = reduce(lanes);
                                want[i * ldc + j] = if accumulate { s + want[i * ldc + j] } else { s };
                            }
                        }
                        let done =
                            product(level, (m, k), cols.clone(), (&a, lda), (&b, ldb), (&mut c, ldc), accumulate);
                        assert!(done, "{level}: no kernel");
                        same_bits(&c, &want, &format!("{level}: m {m}, k {k}, cols {cols:?}"));
                    }
                }
            }
        }
    }

    /// Operands too short for the shape are left to the general path.
    #[test]
    fn operands_too_short_are_refused() {
        let (a, b, mut c) = (vec![1.0; 8], vec![1.0; 8], vec![0.0; 4]);
        let level = Isa::detected();
        assert!(!product(level, (2, 4), 0..2, (&a, 4), (&b[..7], 4), (&mut c, 2), false));
        assert!(!product(level, (2, 4), 0..2, (&a[..7], 4), (&b, 4), (&mut c, 2), false));
        assert!(!product(level, (2, 4), 0..2, (&a, 4), (&b, 4), (&mut c[..3], 2), false));
    }
}
