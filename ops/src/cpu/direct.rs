//! Products `C (+)= op(A)·B` with A and B read in place (unpacked), for the products of a
//! minibatch: a task's states times a weight matrix, its gate gradients times a transposed copy of
//! one, or a parameter gradient `Xᵀ·dY` over every vertex. The `gemm` crate packs B on every
//! call, which costs as much as the product when a task has a few dozen rows; a weight matrix of
//! a Tree-LSTM (150 × 750) fits in a core's L2 cache, so reading it in place is as fast as reading
//! a packed copy.
//!
//! The kernel is written once over [`Vector`] and compiled for AVX-512 (column blocks of four
//! 16-lane vectors), AVX2 + FMA (two 8-lane vectors, three or four for up to three rows: 16
//! registers) and NEON (four 4-lane vectors). It walks column blocks outside and blocks of up to
//! six rows of op(A) inside, so a block of B is read from memory once and from cache for every
//! further row block; each block keeps its accumulators in registers. Every element of C is one
//! chain of fused multiply-adds over `p = 0..k` from zero (then added to C when accumulating), so
//! its bits do not depend on the instruction set, on the block it falls in, or on how columns are
//! shared between threads.
//! A element `(i, p)` is read at `i·rs + p·cs`: row-major A has `(lda, 1)`, a transposed one
//! `(1, lda)`.

use super::isa::Isa;
use super::simd::Vector;

/// `C (+)= op(A)·B` over the columns `cols` of B and C, for `m` rows of C and an inner dimension
/// `k`, with B and C row-major (row strides `ldb`, `ldc`) and A stored row-major with row stride
/// `lda`, transposed when `ta`; `false` (nothing done) where the [active](super::isa::active) level
/// has no kernel (x86-64 below AVX2), so the caller takes the general path.
///
/// The slices must span the operands: `a` holds `m` rows of `k` (`k` rows of `m` when `ta`), `b`
/// holds `k` rows reaching column `cols.end`, `c` holds `m` rows reaching column `cols.end`
/// (checked).
pub(crate) fn product(
    shape: (usize, usize),
    cols: std::ops::Range<usize>,
    a: (&[f32], usize, bool),
    b: (&[f32], usize),
    c: (&mut [f32], usize),
    accumulate: bool,
) -> bool {
    product_at(super::isa::active(), shape, cols, a, b, c, accumulate)
}

/// [`product`] at the instruction-set level `level` (at most what the CPU has).
fn product_at(
    level: Isa,
    (m, k): (usize, usize),
    cols: std::ops::Range<usize>,
    (a, lda, ta): (&[f32], usize, bool),
    (b, ldb): (&[f32], usize),
    (c, ldc): (&mut [f32], usize),
    accumulate: bool,
) -> bool {
    let (a_rows, a_cols) = if ta { (k, m) } else { (m, k) };
    if !spans(a_rows, a_cols, lda, a.len()) || !spans(k, cols.end, ldb, b.len()) || !spans(m, cols.end, ldc, c.len()) {
        return false;
    }
    if m == 0 || cols.is_empty() {
        return has_kernel(level);
    }
    let ops = Operands {
        m,
        k,
        a: a.as_ptr(),
        rs: if ta { 1 } else { lda },
        cs: if ta { lda } else { 1 },
        b: b.as_ptr().wrapping_add(cols.start),
        ldb,
        c: c.as_mut_ptr().wrapping_add(cols.start),
        ldc,
        accumulate,
        sums: std::ptr::null_mut(),
        fetch: true,
    };
    if k <= KC + KC / 2 {
        return kernel(level, ops, cols.len());
    }
    PARTIAL.with(|cell| {
        let mut sums = cell.borrow_mut();
        if sums.len() < m * SUMS_PER_ROW {
            sums.resize(m * SUMS_PER_ROW, 0.0);
        }
        kernel(level, Operands { sums: sums.as_mut_ptr(), ..ops }, cols.len())
    })
}

/// Runs the kernel of `level` over `width` columns; `false` where it has none.
fn kernel(level: Isa, ops: Operands, width: usize) -> bool {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: each kernel runs only at a level the CPU has, and every access stays inside the
        // spans checked above (column tails are partial vectors).
        Isa::Avx512 => unsafe { x86::product_avx512(ops, width) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::product_avx2(ops, width) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above (NEON is part of every AArch64 CPU).
        _ => unsafe { columns::<super::simd::neon::V4, 4>(ops, width) },
        #[cfg(not(target_arch = "aarch64"))]
        _ => {
            let _ = (ops, width);
            return false;
        }
    }
    true
}

/// Whether `rows` rows of `width` elements, `ld` apart, fit in `len` elements.
pub(super) fn spans(rows: usize, width: usize, ld: usize, len: usize) -> bool {
    rows == 0 || (rows - 1).checked_mul(ld).and_then(|x| x.checked_add(width)).is_some_and(|end| end <= len)
}

/// Whether the direct kernel runs at `level` (everywhere but x86-64 without AVX2).
pub(crate) fn has_kernel(level: Isa) -> bool {
    cfg!(target_arch = "aarch64") || level >= Isa::Avx2
}

/// Rows of C up to which the direct kernel beats the `gemm` crate below AVX-512, where packing B
/// costs more than the product; with more rows the crate's packed kernel is faster.
const FEW_ROWS: usize = 48;

/// Whether a product of `m` rows runs faster on the direct kernel than on the `gemm` crate at
/// `level`: with AVX-512 (but see [`packed_wins`]), for few rows below it.
pub(crate) fn suits(level: Isa, m: usize) -> bool {
    has_kernel(level) && (level == Isa::Avx512 || m <= FEW_ROWS)
}

/// Rows of op(A) and steps of the inner dimension from which the `gemm` crate's packed kernel
/// beats the direct one where AVX-512 runs at [full width](super::isa::full_width): a row block
/// of the direct kernel reads its B block from L1 at every step, which two 512-bit units a core
/// outrun (Intel Xeon, hidden 150: `96 × 150 · 150 × 750` and larger 1.1–1.2× faster on the
/// crate, parameter gradients `Xᵀ·dY` over 128 vertices and more 1.2–1.35×; at 60 rows, or 64
/// vertices, the direct kernel is as fast or faster). Zen 4 runs AVX-512 in two halves, and there
/// the direct kernel is the faster at every size.
const PACKED_FROM: usize = 96;

/// Whether a product of `m` rows of op(A) (B not transposed) and inner dimension `k` runs
/// faster on the `gemm` crate than on the direct kernel at `level`, on a CPU whose AVX-512
/// runs at full width (`full_width`).
pub(crate) fn packed_wins(level: Isa, full_width: bool, (m, k): (usize, usize)) -> bool {
    level == Isa::Avx512 && full_width && m >= PACKED_FROM && k >= PACKED_FROM
}

/// A product's operands (A with row and column strides, B and C row-major and at the first
/// column) and whether C accumulates.
#[derive(Clone, Copy)]
struct Operands {
    m: usize,
    k: usize,
    a: *const f32,
    rs: usize,
    cs: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    /// Room for [`SUMS_PER_ROW`] running sums per row of C where the inner dimension is longer
    /// than one pass (else null).
    sums: *mut f32,
    /// The block asks the cache for B's rows [`AHEAD`] steps ahead: the first row block of a
    /// pass, which reads them from L2 (the later ones find them in L1).
    fetch: bool,
}

/// Steps of the inner dimension ahead at which a block asks for B's rows: each row of a block
/// is a short run (up to 512 bytes) a full row of B apart, which the hardware prefetchers do
/// not follow, so a product of a few rows otherwise waits on L2 at every step (a
/// `1 × 150 · 150 × 750` product from L2: 1.15–1.3× faster with it, 3–12 ahead alike).
const AHEAD: usize = 4;

/// Elements a row of a block must span (more than two cache lines: the pair the adjacent-line
/// prefetcher brings) for the block to ask for B's rows itself; the AVX2 kernel's runs of one
/// or two lines ran slower with it (batch-1 inference 0.96).
const FETCHED_RUN: usize = 32;

/// Rows of A per block.
const ROWS: usize = 6;

/// Column blocks of up to `V` vectors outside, over `width` columns (the last block's last
/// vector partial).
///
/// # Safety
/// The CPU runs `W`'s instructions (the caller is compiled for them); the operands span `m` rows
/// and `width` columns.
#[inline(always)]
unsafe fn columns<W: Vector, const V: usize>(ops: Operands, width: usize) {
    let mut j = 0;
    while j < width {
        let cols = (width - j).min(W::LANES * V);
        let vectors = cols.div_ceil(W::LANES);
        let tail = cols - W::LANES * (vectors - 1);
        // SAFETY: column `j` lies inside B and C.
        let at = unsafe { Operands { b: ops.b.add(j), c: ops.c.add(j), ..ops } };
        // SAFETY: as for this function; `vectors ≤ V`.
        unsafe {
            match vectors {
                8 => rows::<W, 8>(at, tail),
                7 => rows::<W, 7>(at, tail),
                6 => rows::<W, 6>(at, tail),
                5 => rows::<W, 5>(at, tail),
                4 => rows::<W, 4>(at, tail),
                3 => rows::<W, 3>(at, tail),
                2 => rows::<W, 2>(at, tail),
                _ => rows::<W, 1>(at, tail),
            }
        }
        j += cols;
    }
}

/// Steps of the inner dimension per pass over a column block's rows: the block's rows of B
/// for one pass (up to four 16-lane vectors each: 32 KiB) stay in L1 while every row block of A
/// uses them, instead of coming from L2 for each row block.
const KC: usize = 128;

/// Running sums kept per row of C between passes: the widest column block of any kernel.
const SUMS_PER_ROW: usize = 128;

thread_local! {
    /// Each thread's running sums of a column block between passes over the inner dimension
    /// (grown to the most rows a product had; no allocation per product after that).
    static PARTIAL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Every row block of one column block of `V` vectors, the last with `tail` lanes: in passes
/// of [`KC`] steps of the inner dimension where the operands have room for running sums, kept
/// between passes (each element is still one chain of multiply-adds over `p = 0..k`).
///
/// # Safety
/// As [`columns`].
#[inline(always)]
unsafe fn rows<W: Vector, const V: usize>(ops: Operands, tail: usize) {
    // Without room for running sums, one pass over the whole inner dimension.
    let kc = if ops.sums.is_null() { ops.k } else { KC };
    let mut p0 = 0;
    while p0 < ops.k {
        let kc = (ops.k - p0).min(kc);
        let sums = Sums { at: ops.sums, first: p0 == 0, last: p0 + kc == ops.k };
        // SAFETY: steps `p0..p0 + kc` of the inner dimension lie inside A and B.
        let at = unsafe { Operands { k: kc, a: ops.a.add(p0 * ops.cs), b: ops.b.add(p0 * ops.ldb), ..ops } };
        // SAFETY: as for this function; the sums, where a pass is not both first and last, hold
        // `SUMS_PER_ROW ≥ V·LANES` for each row.
        unsafe { row_blocks::<W, V>(at, tail, sums) };
        p0 += kc;
    }
}

/// One pass over part of the inner dimension: the first starts from zero, the last writes C;
/// between passes the running sums are kept at `at`, `V` vectors per row of C, row after row
/// (a pass that is both first and last keeps none: `at` may be null).
#[derive(Clone, Copy)]
struct Sums {
    at: *mut f32,
    first: bool,
    last: bool,
}

/// Every row block of one column block of `V` vectors over `ops.k` steps, the last vector with
/// `tail` lanes.
///
/// # Safety
/// As [`columns`]; unless the pass is both first and last, the sums hold `V` vectors for each of
/// the `m` rows.
#[inline(always)]
unsafe fn row_blocks<W: Vector, const V: usize>(ops: Operands, tail: usize, sums: Sums) {
    let mut i = 0;
    while i < ops.m {
        // SAFETY: row `i` lies inside A and C; the sums' address is only followed where they
        // are kept (it may be null otherwise, hence `wrapping_add`).
        let (at, sums) = unsafe {
            let at = Operands { a: ops.a.add(i * ops.rs), c: ops.c.add(i * ops.ldc), fetch: i == 0, ..ops };
            (at, Sums { at: sums.at.wrapping_add(i * V * W::LANES), ..sums })
        };
        // SAFETY: as for this function; the block's rows lie inside A and C.
        unsafe {
            match (ops.m - i).min(ROWS) {
                6 => block::<W, 6, V>(at, tail, sums),
                5 => block::<W, 5, V>(at, tail, sums),
                4 => block::<W, 4, V>(at, tail, sums),
                3 => block::<W, 3, V>(at, tail, sums),
                2 => block::<W, 2, V>(at, tail, sums),
                _ => block::<W, 1, V>(at, tail, sums),
            }
        }
        i += ROWS;
    }
}

/// Vector `q` of `V` at `p`: whole, or the first `tail` lanes for the last.
///
/// # Safety
/// The lanes read lie inside the operand.
#[inline(always)]
unsafe fn load<W: Vector, const V: usize>(p: *const f32, q: usize, tail: usize) -> W {
    // SAFETY: as for this function.
    unsafe {
        if q + 1 < V || tail == W::LANES {
            W::load(p.add(W::LANES * q))
        } else {
            W::load_part(p.add(W::LANES * q), tail)
        }
    }
}

/// `R` rows by `V` vectors of C: each vector of a row of B is loaded once and used for all `R`
/// rows. (No closures here: a closure would be compiled without the caller's instructions.)
///
/// # Safety
/// As [`row_blocks`].
#[inline(always)]
unsafe fn block<W: Vector, const R: usize, const V: usize>(ops: Operands, tail: usize, sums: Sums) {
    let Operands { k, a, rs, cs, b, ldb, c, ldc, accumulate, fetch, .. } = ops;
    let mut acc = [[W::splat(0.0); V]; R];
    if !sums.first {
        let at = sums.at;
        for (r, acc) in acc.iter_mut().enumerate() {
            for (q, v) in acc.iter_mut().enumerate() {
                // SAFETY: the running sums hold `V` whole vectors for each row.
                *v = unsafe { W::load(at.add((r * V + q) * W::LANES)) };
            }
        }
    }
    let mut bv = [W::splat(0.0); V];
    for p in 0..k {
        // SAFETY: row `p` of B lies inside B.
        let row = unsafe { b.add(p * ldb) };
        if fetch && V * W::LANES > FETCHED_RUN && p + AHEAD < k {
            let ahead = row.wrapping_add(AHEAD * ldb);
            for line in (0..V * W::LANES).step_by(16) {
                super::simd::prefetch_line(ahead.wrapping_add(line));
            }
        }
        for (q, v) in bv.iter_mut().enumerate() {
            // SAFETY: the block's columns of that row lie inside B (the last vector partial).
            *v = unsafe { load::<W, V>(row, q, tail) };
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: element `(r, p)` of the block's rows of op(A) lies inside A.
            let av = W::splat(unsafe { *a.add(r * rs + p * cs) });
            for q in 0..V {
                acc[q] = av.mul_add(bv[q], acc[q]);
            }
        }
    }
    if !sums.last {
        let at = sums.at;
        for (r, acc) in acc.iter().enumerate() {
            for (q, v) in acc.iter().enumerate() {
                // SAFETY: as above.
                unsafe { v.store(at.add((r * V + q) * W::LANES)) };
            }
        }
        return;
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row `r` of the block lies inside C.
        let dst = unsafe { c.add(r * ldc) };
        for (q, &sum) in acc.iter().enumerate() {
            // SAFETY: the block's columns of that row lie inside C (the last vector partial).
            let v = if accumulate { sum.add(unsafe { load::<W, V>(dst, q, tail) }) } else { sum };
            // SAFETY: as above.
            unsafe {
                if q + 1 < V || tail == W::LANES {
                    v.store(dst.add(W::LANES * q));
                } else {
                    v.store_part(dst.add(W::LANES * q), tail);
                }
            }
        }
    }
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
    if !spans(n, k, ldb, b.len()) || ps.end > k || out.len() < ps.len() * n {
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
                    x86::transpose_block(
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
mod x86 {
    use super::{columns, Operands};
    use crate::cpu::simd::x86::{V16, V8};
    use std::arch::x86_64::*;

    /// [`columns`] over four 16-lane vectors; over eight for one or two rows of A, whose four
    /// accumulators a row would otherwise wait on each multiply-add's latency, reading B's rows
    /// in runs of 512 bytes (batch 1's `h·U`).
    ///
    /// # Safety
    /// The CPU has AVX-512F and FMA; as [`columns`].
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn product_avx512(ops: Operands, width: usize) {
        // SAFETY: this function is compiled for V16's instructions; the rest is its contract.
        unsafe {
            match ops.m {
                0..=2 => columns::<V16, 8>(ops, width),
                _ => columns::<V16, 4>(ops, width),
            }
        }
    }

    /// [`columns`] over two 8-lane vectors (12 accumulators, 2 rows of B and a broadcast in
    /// AVX2's 16 registers); over four for one or two rows of A and three for three, whose two
    /// accumulators a row would otherwise wait on each multiply-add's latency (~2×, ~1.5× and
    /// ~1.3× for batch 1's `h·U`).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; as [`columns`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product_avx2(ops: Operands, width: usize) {
        // SAFETY: this function is compiled for V8's instructions; the rest is its contract.
        unsafe {
            match ops.m {
                0..=2 => columns::<V8, 4>(ops, width),
                3 => columns::<V8, 3>(ops, width),
                _ => columns::<V8, 2>(ops, width),
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
                // SAFETY: row `i < rows` of the block, `cols` lanes of it (the mask), lies
                // inside the source (the caller's contract).
                unsafe { _mm512_maskz_loadu_ps(load, src.add(i * lds)) }
            } else {
                _mm512_setzero_ps()
            }
        });
        // SAFETY: this function is compiled for AVX-512F, which `swap` needs.
        unsafe {
            swap::<8>(&mut r);
            swap::<4>(&mut r);
            swap::<2>(&mut r);
            swap::<1>(&mut r);
        }
        for (q, &v) in r.iter().enumerate() {
            if q < cols {
                // SAFETY: row `q < cols` of the transposed block, `rows` lanes of it, lies inside
                // the destination (the caller's contract).
                unsafe { _mm512_mask_storeu_ps(dst.add(q * ldd), store, v) };
            }
        }
    }

    /// One round of [`transpose_block`]: row i (bit `B` clear) takes row i + B's low columns
    /// into its high ones, and row i + B takes row i's high columns into its low ones.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
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
        // SAFETY: the CPU has AVX-512F (the caller's contract); the index tables are 16 lanes.
        unsafe {
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
}

/// What the product kernels' tests share.
#[cfg(test)]
pub(super) mod checks {
    use super::{has_kernel, Isa};

    /// Every level this CPU has that has a kernel.
    pub fn levels() -> impl Iterator<Item = Isa> {
        Isa::ALL.into_iter().filter(|&l| l <= Isa::detected() && has_kernel(l))
    }

    /// A fixed, varied test value for index `i`.
    pub fn value(i: usize) -> f32 {
        ((i * 37 % 101) as f32 - 50.0) / 25.0
    }

    /// Asserts `got` equals `want` bit for bit, naming the case and the element.
    pub fn same_bits(got: &[f32], want: &[f32], case: &str) {
        for (e, (x, y)) in got.iter().zip(want).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "{case}, [{e}]: {x} vs {y}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::checks::{levels, same_bits, value};
    use super::*;

    /// Large products leave the direct kernel only at AVX-512 on a full-width CPU, and only
    /// with both many rows and a long inner dimension.
    #[test]
    fn only_large_products_at_full_width_avx512_are_packed() {
        let sizes = [1, 60, PACKED_FROM - 1, PACKED_FROM, 1300];
        for level in Isa::ALL {
            for wide in [false, true] {
                for (m, k) in sizes.iter().flat_map(|&m| sizes.map(|k| (m, k))) {
                    let expected = level == Isa::Avx512 && wide && m >= PACKED_FROM && k >= PACKED_FROM;
                    assert_eq!(packed_wins(level, wide, (m, k)), expected, "{level} wide {wide}: {m} rows, inner {k}");
                }
            }
        }
        // Batch 1's word-vector gradient (300 × ~19 · ~19 × 450) and a batch-64 level of 60
        // vertices stay on the direct kernel; the lowest levels and the parameter gradients of
        // a batch-64 minibatch do not.
        assert!(!packed_wins(Isa::Avx512, true, (300, 19)) && !packed_wins(Isa::Avx512, true, (60, 150)));
        assert!(packed_wins(Isa::Avx512, true, (400, 150)) && packed_wins(Isa::Avx512, true, (150, 1240)));
    }

    /// `product` at every level this CPU has, for every row count up to 13, an inner dimension
    /// of one pass and of three, A as stored and transposed, column ranges with every tail, with
    /// and without accumulation, every stride padded: bit for bit one chain of fused
    /// multiply-adds per element, from zero, then added to C (so every level, block and thread
    /// split gives the same bits).
    #[test]
    fn direct_products_are_one_multiply_add_chain_per_element() {
        let n = 150;
        // One pass over the inner dimension, and several (the last shorter than the others).
        for (level, k) in levels().flat_map(|l| [(l, 9), (l, 2 * KC + 5)]) {
            for (m, ta) in (0..=13).flat_map(|m| [(m, false), (m, true)]) {
                let (lda, ldb, ldc) = (if ta { m + 2 } else { k + 2 }, n + 3, n + 1);
                let a_at = |i: usize, p: usize| if ta { p * lda + i } else { i * lda + p };
                for cols in [0..n, 5..n, 0..17, 16..80, 3..3, 64..150, 7..12, 1..113, 30..110] {
                    for accumulate in [false, true] {
                        let a: Vec<f32> = (0..if ta { k } else { m } * lda).map(value).collect();
                        let b: Vec<f32> = (0..k * ldb).map(|i| value(i + 7)).collect();
                        let mut c: Vec<f32> = (0..m * ldc).map(|i| value(i + 3)).collect();
                        let mut want = c.clone();
                        for i in 0..m {
                            for j in cols.clone() {
                                let s = (0..k).fold(0.0f32, |s, p| a[a_at(i, p)].mul_add(b[p * ldb + j], s));
                                want[i * ldc + j] = if accumulate { s + want[i * ldc + j] } else { s };
                            }
                        }
                        let done = product_at(
                            level,
                            (m, k),
                            cols.clone(),
                            (&a, lda, ta),
                            (&b, ldb),
                            (&mut c, ldc),
                            accumulate,
                        );
                        assert!(done, "{level}: no kernel");
                        same_bits(&c, &want, &format!("{level}: m {m}, ta {ta}, cols {cols:?}"));
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
