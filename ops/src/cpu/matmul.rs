//! Matrix products. A call's products on the direct kernel and dot products are split by output
//! columns between the threads of the [team] (batched products by entries), so each core reads
//! only its share of B and keeps it in its own cache from one task to the next — or, where every
//! product of a call is on the direct kernel with enough rows (AVX-512), by output rows as the
//! fused kernels around them split their vertices ([`ROWS_APART`]); products on the
//! `gemm` crate are cut into units of rows and columns that the threads claim as they come free,
//! so an uneven cut (150 columns in blocks of 64) leaves no core waiting. Products run on the
//! [direct] kernel, reading B in place or, when B is a transposed parameter (AVX-512 and NEON),
//! a row-major copy of its transpose made once between parameter writes — except products of a
//! few rows with a transposed parameter, which run as [dots] over its rows as stored (making the
//! copy would cost more than they do). Transposed products of other values, other products with
//! a transposed parameter at AVX2, products of many rows below AVX-512 ([`direct::suits`]) or on
//! a CPU whose AVX-512 runs at full width ([`direct::packed_wins`]), and
//! every product on an x86-64 CPU (or [level](super::isa::active)) without AVX2 run on the
//! `gemm` crate.

use super::isa::Isa;
use super::memory::{Raw, Span};
use super::team::{self, Claims};
use super::{bad, direct, dots};
use arbor_core::backend::{Gemm, Loc};
use arbor_core::error::Result;
use gemm::Parallelism;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Calls with fewer multiply-adds than this (over all their products) run on one thread: handing
/// a part to another core costs about as much as the work.
const PARALLEL_MACS: usize = 1 << 16;

/// Output columns per unit of work split between threads (one vector).
const UNIT: usize = 16;

/// Rows from which a call's direct products are split by rows between threads on AVX-512, as
/// fused kernels split their vertices: each core then writes the rows its next fused kernel reads
/// (and reads the rows one wrote) instead of half of every row (SST Tree-LSTM, two threads:
/// training at batch 64 1.01, 256 1.02, batch 1 1.03–1.04, inference at batch 64 1.06). Below
/// AVX-512 the direct kernel takes products of up to 48 rows only, and their columns stay split.
const ROWS_APART: usize = 24;

/// Products of a transposed A (a parameter's gradient, `Xᵀ·dY` over a minibatch's vertices) are
/// split by rows only up to this inner dimension: over more (batch 256's thousands of vertices)
/// each core reading all of dY costs more than the rows' locality saves.
const INNER_APART: usize = 2048;

/// Output columns per call of the `gemm` crate. The crate picks its algorithm from each call's
/// shape (dot products below 256 outputs, a matrix-vector loop for one column), and with it the
/// order of every sum; so its calls cover the same columns however many threads share a product,
/// and a product's bits never depend on how many ran it (a call made while another thread holds
/// the team runs on one).
const CRATE_COLS: usize = 64;

/// Elements spanned by a stored `rows × cols` matrix with row stride `ld` (saturating: a span
/// that overflows is larger than any buffer, so the range check refuses it).
fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1).saturating_mul(ld).saturating_add(cols)
    }
}

/// Row-major copies of transposed parameters, made on first use, by the source's buffer (its id,
/// which is never reused), place and shape, and kept with the version of the buffer they were
/// made from: a buffer changes only through the backend, which moves its version on, so a copy
/// of another version is stale. The next use rewrites it in place, so a training step makes no
/// new allocation (a fresh one costs page faults every step).
#[derive(Debug, Default)]
pub(crate) struct Transposes(Mutex<Vec<Transposed>>);

/// Which matrix a copy is of: its buffer's id, offset, rows (`n`), columns (`k`), row stride.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Source {
    buffer: u64,
    offset: usize,
    shape: (usize, usize, usize),
}

#[derive(Debug)]
struct Transposed {
    source: Source,
    /// The version of the source's buffer the copy was made from.
    version: u64,
    /// The `k × n` transpose, row stride `n`.
    data: Arc<Vec<f32>>,
}

impl Transposes {
    /// Forgets every copy (a new buffer may replace the one a copy was made from; copies still
    /// in use are made again).
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Transposed>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The transpose of the `n × k` matrix `b` (row stride `ldb`) at `offset` of the buffer with
    /// stamp `(buffer, version)`, as `k × n` row-major.
    fn of(
        &self,
        b: &[f32],
        ((buffer, version), offset): ((u64, u64), usize),
        (n, k, ldb): (usize, usize, usize),
    ) -> Result<Arc<Vec<f32>>> {
        let source = Source { buffer, offset, shape: (n, k, ldb) };
        let mut copies = self.lock();
        let at = copies.iter().position(|t| t.source == source);
        if let Some(t) = at.map(|i| &mut copies[i]) {
            if t.version == version {
                return Ok(Arc::clone(&t.data));
            }
        }
        // A stale copy no product still holds is rewritten in place.
        let mut data = match at.map(|i| copies.swap_remove(i)) {
            Some(t) => Arc::try_unwrap(t.data).unwrap_or_else(|_| vec![0.0; k * n]),
            None => vec![0.0; k * n],
        };
        let out = Out(data.as_mut_ptr());
        let max = if k * n >= TRANSPOSE_PARALLEL { usize::MAX } else { 1 };
        team::split(max, |part, parts| {
            let blocks = team::share(k.div_ceil(16), part, parts);
            let rows = blocks.start * 16..(blocks.end * 16).min(k);
            if rows.is_empty() {
                return Ok(());
            }
            // SAFETY: rows `rows` of the `k × n` copy, which no other part writes.
            let mine = unsafe { std::slice::from_raw_parts_mut(out.at(rows.start * n), rows.len() * n) };
            match direct::transpose(b, (n, k, ldb), rows, mine) {
                true => Ok(()),
                false => Err(bad("gemm", format!("a {n} × {k} parameter (row stride {ldb}) outside its buffer"))),
            }
        })?;
        let data = Arc::new(data);
        copies.push(Transposed { source, version, data: Arc::clone(&data) });
        Ok(data)
    }
}

/// Transposes of at least this many elements are split between the team's threads.
const TRANSPOSE_PARALLEL: usize = 1 << 15;

/// The output of a transpose, written by several threads at disjoint rows.
struct Out(*mut f32);

// SAFETY: each thread writes only its own rows of the output.
unsafe impl Sync for Out {}

impl Out {
    /// # Safety
    /// `i` lies inside the output.
    unsafe fn at(&self, i: usize) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(i) }
    }
}

/// How one product runs.
enum Path {
    /// The direct kernel on B as stored (`None`) or on a transposed copy.
    Direct(Option<Arc<Vec<f32>>>),
    /// Dot products with a transposed parameter's rows as stored ([`dots`]).
    Dots,
    /// The `gemm` crate.
    Crate,
}

/// Runs independent products (none writes what another reads or writes), each split between
/// the team's threads.
pub(crate) fn gemm_batch(raw: &Raw<'_>, gs: &[Gemm], transposes: &Transposes) -> Result<()> {
    products(raw, gs, transposes, false)
}

/// Runs products summed into one output, in order (`Backend::gemm_sum`: the first writes C as
/// its `accumulate` says, each later one adds to it): where each runs on the direct kernel or
/// dot products, all in one share-out of C's columns, each part adding its columns' products in
/// the chain's order (the sums of running them one after another, one hand-off to the team
/// instead of one a product); else one after another.
pub(crate) fn gemm_sum(raw: &Raw<'_>, gs: &[Gemm], transposes: &Transposes) -> Result<()> {
    products(raw, gs, transposes, true)
}

/// [`gemm_batch`], or [`gemm_sum`] where `chain`.
fn products(raw: &Raw<'_>, gs: &[Gemm], transposes: &Transposes, chain: bool) -> Result<()> {
    for g in gs {
        check(raw, g)?;
    }
    // Each C is written: it shares no element with any operand of the call but itself (and, in
    // a chain, the others' C, which is the same).
    let stored: SmallOperands = gs.iter().map(operands).collect();
    for (i, ops) in stored.iter().enumerate() {
        let c = &ops[2];
        for (j, other) in stored.iter().enumerate() {
            for (o, x) in other.iter().enumerate() {
                if (i != j && !(chain && o == 2) || o < 2) && c.meets(x) {
                    return Err(bad("gemm", format!("the product written ({c:?}) overlaps an operand ({x:?})")));
                }
            }
        }
    }
    let same = |g: &Gemm| (g.c, g.m, g.n, g.ldc, g.batch) == (gs[0].c, gs[0].m, gs[0].n, gs[0].ldc, 1);
    if chain && !gs.iter().all(same) {
        return Err(bad("gemm_sum", "the products of a chain write one output of one shape, one batch entry"));
    }
    let mut paths = Vec::with_capacity(gs.len());
    let level = super::isa::active();
    let full_width = super::isa::full_width();
    for g in gs {
        let packed = !g.tb && direct::packed_wins(level, full_width, (g.m, g.k));
        paths.push(if !direct::suits(level, g.m) || (g.tb && !g.b_fixed) || packed {
            Path::Crate
        } else if g.tb && !g.ta && dots::suits(level, g.m) {
            Path::Dots
        } else if g.tb && level == Isa::Avx2 {
            // With AVX2 the crate's packing of B as stored costs less than a transposed copy
            // made again after every update (1.1–1.6× for batch 1's input gradients).
            Path::Crate
        } else if g.tb {
            // SAFETY: range checked above; parameters are not written by compute calls.
            let b = unsafe { raw.get("gemm", g.b, extent(g.n, g.k, g.ldb))? };
            Path::Direct(Some(transposes.of(b, (raw.stamp(g.b.buf), g.b.offset), (g.n, g.k, g.ldb))?))
        } else {
            Path::Direct(None)
        });
    }
    if chain && paths.iter().any(|p| matches!(p, Path::Crate)) {
        // The crate's units are claimed in any order: one product after another.
        return (0..gs.len()).try_for_each(|i| share_out(raw, &gs[i..=i], &paths[i..=i]));
    }
    share_out(raw, gs, &paths)
}

/// Runs checked products on the paths chosen for them, shared out between the team's threads
/// ([`run_part`]).
fn share_out(raw: &Raw<'_>, gs: &[Gemm], paths: &[Path]) -> Result<()> {
    let macs: usize = gs.iter().map(|g| g.m * g.n * g.k * g.batch).sum();
    let claims = Claims::new(team::size());
    let max = if macs < PARALLEL_MACS { 1 } else { usize::MAX };
    let by_rows = super::isa::active() == Isa::Avx512
        && gs.iter().zip(paths).all(|(g, p)| {
            g.batch == 1 && g.m >= ROWS_APART && (!g.ta || g.k <= INNER_APART) && matches!(p, Path::Direct(_))
        });
    team::split(max, |part, parts| run_part(raw, gs, paths, (part, parts), by_rows, &claims))
}

/// Part `part` of `parts` of [`gemm_batch`]: its share of the columns of every product on the
/// direct kernel or dot products (of the rows, `by_rows`, as [`share_out`] decides for the call;
/// of its batch entries, for batched products, each run whole),
/// then units of the products on the `gemm` crate ([`CrateGrid`]) as they are left ([`Claims`]).
fn run_part(
    raw: &Raw<'_>,
    gs: &[Gemm],
    paths: &[Path],
    (part, parts): (usize, usize),
    by_rows: bool,
    claims: &Claims,
) -> Result<()> {
    for (g, path) in gs.iter().zip(paths) {
        if by_rows {
            run(raw, g, path, 0, (team::share(g.m, part, parts), 0..g.n))?;
        } else if g.batch != 1 {
            for i in team::share(g.batch, part, parts) {
                run(raw, g, path, i, (0..g.m, 0..g.n))?;
            }
        } else if let Path::Direct(_) | Path::Dots = path {
            // Every element of the direct kernel is one chain of multiply-adds, wherever the
            // columns are cut: one call over the part's units.
            let units = team::share(g.n.div_ceil(UNIT), part, parts);
            run(raw, g, path, 0, (0..g.m, units.start * UNIT..(units.end * UNIT).min(g.n)))?;
        }
    }
    // Each product on the crate with its grid, once; a unit numbers the products' units in turn.
    let grids: smallvec::SmallVec<[(&Gemm, &Path, CrateGrid); 4]> = gs
        .iter()
        .zip(paths)
        .filter(|(g, p)| g.batch == 1 && matches!(p, Path::Crate))
        .map(|(g, p)| (g, p, CrateGrid::of(g.m, g.n)))
        .collect();
    let units = grids.iter().map(|(.., grid)| grid.units()).sum();
    while let Some(mut unit) = claims.next(units, part, parts) {
        for (g, path, grid) in &grids {
            if unit < grid.units() {
                run(raw, g, path, 0, grid.unit(unit))?;
                break;
            }
            unit -= grid.units();
        }
    }
    Ok(())
}

/// How a product on the `gemm` crate is cut into units of work: blocks of [`CRATE_COLS`]
/// columns, and of rows too where a product has too few column blocks to share well. The cut
/// depends on the shape alone, so a product's bits never depend on how many threads ran it.
#[derive(Clone, Copy, Debug, PartialEq)]
struct CrateGrid {
    m: usize,
    n: usize,
    /// Rows per unit.
    rows: usize,
    /// Column blocks.
    across: usize,
}

impl CrateGrid {
    /// Units a product is cut into at least, where it has the rows.
    const UNITS: usize = 8;
    /// Rows a unit has at least when rows are cut (each unit packs B again).
    const MIN_ROWS: usize = 64;

    fn of(m: usize, n: usize) -> Self {
        let across = n.div_ceil(CRATE_COLS);
        let down = Self::UNITS.div_ceil(across.max(1)).min(m / Self::MIN_ROWS).max(1);
        CrateGrid { m, n, rows: m.div_ceil(down).next_multiple_of(8).max(1), across }
    }

    fn units(&self) -> usize {
        self.m.div_ceil(self.rows) * self.across
    }

    /// The rows and columns of unit `u` (row blocks by column blocks, row-major).
    fn unit(&self, u: usize) -> (Range<usize>, Range<usize>) {
        let (r, c) = (u / self.across, u % self.across);
        (r * self.rows..((r + 1) * self.rows).min(self.m), c * CRATE_COLS..((c + 1) * CRATE_COLS).min(self.n))
    }
}

/// The operands of a call's products (a call has a few).
type SmallOperands = smallvec::SmallVec<[[Stored; 3]; 4]>;

/// A matrix as stored: `rows` rows of `cols` elements, `ld` apart, from `at`.
#[derive(Clone, Copy, Debug)]
struct Stored {
    at: Loc,
    rows: usize,
    cols: usize,
    ld: usize,
}

impl Stored {
    /// Whether the two share an element: exactly when both have one row stride (column slices
    /// of one matrix, the engine's case), else by the elements between their first and last
    /// (which may say yes where they only interleave).
    fn meets(&self, o: &Stored) -> bool {
        let span = |m: &Stored| Span::at(m.at, extent(m.rows, m.cols, m.ld));
        if !span(self).meets(span(o)) {
            return false;
        }
        // Buffers hold far fewer than 2^62 elements (their spans were checked), so i64 is exact.
        let l = self.ld as i64;
        if self.ld != o.ld || l == 0 || self.cols > self.ld || o.cols > o.ld {
            return true;
        }
        // Element (r, c) of self is (s, d) of o where c − d = δ + t·L, t = s − r: some integer t
        // with −o.cols < δ + t·L < self.cols, −(self.rows − 1) ≤ t ≤ o.rows − 1.
        let delta = o.at.offset as i64 - self.at.offset as i64;
        let (cx, cy) = (self.cols as i64, o.cols as i64);
        let lo = (-cy - delta + l).div_euclid(l); // ⌈(−cy − δ + 1) / L⌉
        let hi = (cx - delta - 1).div_euclid(l); // ⌊(cx − δ − 1) / L⌋
        lo.max(1 - self.rows as i64) <= hi.min(o.rows as i64 - 1)
    }
}

/// A, B and C of a product as stored, a batch as one matrix of all its entries' rows (its
/// entries lie one after another), else as the elements between the first and last.
fn operands(g: &Gemm) -> [Stored; 3] {
    let (a_rows, a_cols) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
    let (b_rows, b_cols) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
    let stored = |at: Loc, (rows, cols): (usize, usize), ld: usize, stride: usize| {
        if g.batch <= 1 || stride == rows * ld {
            Stored { at, rows: rows * g.batch.max(1), cols, ld }
        } else {
            let len = (g.batch - 1).saturating_mul(stride).saturating_add(extent(rows, cols, ld));
            Stored { at, rows: 1, cols: len, ld: len }
        }
    };
    [
        stored(g.a, (a_rows, a_cols), g.lda, g.stride_a),
        stored(g.b, (b_rows, b_cols), g.ldb, g.stride_b),
        stored(g.c, (g.m, g.n), g.ldc, g.stride_c),
    ]
}

/// An error unless every operand of every batch entry lies in its buffer and the leading
/// dimensions fit.
fn check(raw: &Raw<'_>, g: &Gemm) -> Result<()> {
    let (a_rows, a_cols) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
    let (b_rows, b_cols) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
    if a_cols > g.lda.max(1) && a_rows > 1 || b_cols > g.ldb.max(1) && b_rows > 1 || g.n > g.ldc.max(1) && g.m > 1 {
        return Err(bad("gemm", format!("a leading dimension is smaller than its row: {g:?}")));
    }
    if let Some(last) = g.batch.checked_sub(1) {
        for i in [0, last] {
            // SAFETY: only the ranges are checked here; nothing is read or written.
            unsafe {
                raw.get("gemm", g.a.offset_by(i.saturating_mul(g.stride_a)), extent(a_rows, a_cols, g.lda))?;
                raw.get("gemm", g.b.offset_by(i.saturating_mul(g.stride_b)), extent(b_rows, b_cols, g.ldb))?;
                raw.get("gemm", g.c.offset_by(i.saturating_mul(g.stride_c)), extent(g.m, g.n, g.ldc))?;
            }
        }
    }
    Ok(())
}

/// Rows `rows` and columns `cols` of batch entry `i` of a product (every row, on the direct
/// kernel and dot products).
fn run(raw: &Raw<'_>, g: &Gemm, path: &Path, i: usize, (rows, cols): (Range<usize>, Range<usize>)) -> Result<()> {
    if cols.is_empty() || rows.is_empty() {
        return Ok(());
    }
    let (a_rows, a_cols) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
    let (b_rows, b_cols) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
    // SAFETY: ranges checked by `get`; the parts of a call write disjoint columns (or rows) of
    // C, and C never overlaps A or B in the engine's plans.
    let c = unsafe { raw.get_mut("gemm", g.c.offset_by(i.saturating_mul(g.stride_c)), extent(g.m, g.n, g.ldc))? };
    if g.k == 0 {
        if !g.accumulate {
            for r in rows {
                c[r * g.ldc + cols.start..r * g.ldc + cols.end].fill(0.0);
            }
        }
        return Ok(());
    }
    // SAFETY: as above: C is written, A and B are read, and they never overlap.
    let a = unsafe { raw.get("gemm", g.a.offset_by(i.saturating_mul(g.stride_a)), extent(a_rows, a_cols, g.lda))? };
    // SAFETY: as above.
    let b = unsafe { raw.get("gemm", g.b.offset_by(i.saturating_mul(g.stride_b)), extent(b_rows, b_cols, g.ldb))? };
    // Where row `rows.start` of op(A) starts.
    let a_at = if g.ta { rows.start } else { rows.start * g.lda };
    if let Path::Dots = path {
        if dots::product(
            super::isa::active(),
            (g.m, g.k),
            cols.clone(),
            (a, g.lda),
            (b, g.ldb),
            (c, g.ldc),
            g.accumulate,
        ) {
            return Ok(());
        }
    }
    if let Path::Direct(t) = path {
        let (b, ldb) = t.as_ref().map_or((b, g.ldb), |t| (t.as_slice(), g.n));
        // The rows `rows` of op(A) and of C.
        let a_rows = a.get(a_at..).unwrap_or_default();
        let c_rows = c.get_mut(rows.start * g.ldc..).unwrap_or_default();
        let (a, c) = ((a_rows, g.lda, g.ta), (c_rows, g.ldc));
        if direct::product((rows.len(), g.k), cols.clone(), a, (b, ldb), c, g.accumulate) {
            return Ok(());
        }
    }
    let (a_rs, a_cs) = if g.ta { (1, g.lda as isize) } else { (g.lda as isize, 1) };
    let (b_rs, b_cs) = if g.tb { (1, g.ldb as isize) } else { (g.ldb as isize, 1) };
    let b_at = if g.tb { cols.start * g.ldb } else { cols.start };
    // SAFETY: every element the product touches lies in the checked slices above.
    unsafe {
        gemm::gemm(
            rows.len(),
            cols.len(),
            g.k,
            c.as_mut_ptr().add(rows.start * g.ldc + cols.start),
            1,
            g.ldc as isize,
            g.accumulate,
            a.as_ptr().add(a_at),
            a_cs,
            a_rs,
            b.as_ptr().add(b_at),
            b_cs,
            b_rs,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Loc as At, Stored};

    /// The strided overlap test against element sets, for column slices of one matrix in every
    /// relative position, and for other strides.
    #[test]
    fn stored_matrices_meet_exactly_when_they_share_an_element() {
        let elements = |m: &Stored| -> std::collections::HashSet<usize> {
            (0..m.rows).flat_map(|r| (0..m.cols).map(move |c| m.at.offset + r * m.ld + c)).collect()
        };
        let at = |offset| At { buf: 0, offset };
        for ld in [1, 4, 7] {
            for (x0, y0) in (0..20).flat_map(|x| (0..20).map(move |y| (x, y))) {
                for (rx, cx, ry, cy) in [(2, 3, 3, 1), (1, ld, 2, ld), (3, 1, 1, 2), (4, ld, 1, 1)] {
                    let (x, y) = (
                        Stored { at: at(x0), rows: rx, cols: cx.min(ld), ld },
                        Stored { at: at(y0), rows: ry, cols: cy.min(ld), ld },
                    );
                    let want = !elements(&x).is_disjoint(&elements(&y));
                    assert_eq!(x.meets(&y), want, "{x:?} {y:?}");
                }
            }
        }
        let (x, y) = (Stored { at: at(0), rows: 3, cols: 2, ld: 5 }, Stored { at: at(2), rows: 2, cols: 2, ld: 6 });
        assert!(x.meets(&y), "other strides: by the elements between first and last");
    }
    use super::{run_part, Claims, CrateGrid, Path, Raw, INNER_APART};
    use crate::cpu::{CpuBackend, HostBuffer};
    use arbor_core::backend::{Backend, Gemm, Loc, Mem};

    /// Each unit of a product on the `gemm` crate is its own rows and columns: together they
    /// cover every element once; rows are cut only where columns are too few to share.
    #[test]
    fn crate_units_cover_every_element_once() {
        for (m, n) in [(1, 1), (1, 300), (63, 150), (64, 150), (338, 150), (1200, 300), (150, 750), (700, 64)] {
            let grid = CrateGrid::of(m, n);
            let mut hits = vec![0u8; m * n];
            for u in 0..grid.units() {
                let (rows, cols) = grid.unit(u);
                assert!(!rows.is_empty() && !cols.is_empty(), "{m} × {n}: unit {u} is empty");
                for (i, j) in rows.flat_map(|i| cols.clone().map(move |j| (i, j))) {
                    hits[i * n + j] += 1;
                }
            }
            assert!(hits.iter().all(|&h| h == 1), "{m} × {n}: {grid:?}");
            let across = n.div_ceil(super::CRATE_COLS);
            assert_eq!(grid.rows < m, across < CrateGrid::UNITS && m >= 2 * CrateGrid::MIN_ROWS, "{m} × {n}");
        }
    }

    /// A product's bits do not depend on how many parts compute it, on the `gemm` crate (whose
    /// algorithm changes with a call's shape: dot products below 256 outputs, a matrix-vector loop
    /// for one column) and on the direct kernel: every shape, transposition and accumulation, cut
    /// into 1 to 4 parts, each equal to the product summed in order to rounding.
    #[test]
    fn products_do_not_depend_on_the_number_of_parts() {
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        let mut paths = vec![Path::Crate];
        if crate::cpu::direct::has_kernel(crate::cpu::isa::active()) {
            paths.push(Path::Direct(None));
        }
        let shapes = [
            (1, 17, 150),
            (3, 33, 9),
            (12, 40, 150),
            (7, 130, 5),
            (40, 750, 150),
            (2, 65, 300),
            (300, 150, 20),
            (131, 70, 9),
        ];
        for (m, n, k) in shapes {
            for (ta, tb, accumulate) in (0..8).map(|b| (b & 1 != 0, b & 2 != 0, b & 4 != 0)) {
                let (lda, ldb) = (if ta { m } else { k }, if tb { k } else { n });
                let a: Vec<f32> = (0..m * k).map(value).collect();
                let b: Vec<f32> = (0..k * n).map(|i| value(i + 5)).collect();
                let c: Vec<f32> = (0..m * n).map(|i| value(i + 11)).collect();
                let mut g = Gemm::single(
                    (m, n, k),
                    (Loc { buf: 0, offset: 0 }, lda, ta),
                    (Loc { buf: 1, offset: 0 }, ldb, tb, false),
                    (Loc { buf: 2, offset: 0 }, n),
                );
                g.accumulate = accumulate;
                for path in paths.iter().filter(|p| !(tb && matches!(p, Path::Direct(_)))) {
                    let product = |parts: usize| {
                        let mut data: Vec<HostBuffer> =
                            [&a, &b, &c].into_iter().map(|x| HostBuffer::from(x.clone())).collect();
                        let mut mem = Mem { data: &mut data, index: &[] };
                        let raw = Raw::new(&mut mem, [2]).unwrap();
                        let (claims, gs, paths) =
                            (Claims::new(parts), std::slice::from_ref(&g), std::slice::from_ref(path));
                        for part in 0..parts {
                            run_part(&raw, gs, paths, (part, parts), false, &claims).unwrap();
                        }
                        data.pop().unwrap().into_vec()
                    };
                    let whole = product(1);
                    for (i, j) in (0..m).flat_map(|i| (0..n).map(move |j| (i, j))) {
                        let at = |x: &[f32], ld: usize, t: bool, (r, c): (usize, usize)| {
                            x[if t { c * ld + r } else { r * ld + c }]
                        };
                        let dot: f32 = (0..k).map(|p| at(&a, lda, ta, (i, p)) * at(&b, ldb, tb, (p, j))).sum();
                        let want = dot + if accumulate { c[i * n + j] } else { 0.0 };
                        assert!(
                            (whole[i * n + j] - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "C[{i}][{j}] of {m} × {n} × {k}"
                        );
                    }
                    for parts in 2..=4 {
                        let kind = if matches!(path, Path::Crate) { "crate" } else { "direct" };
                        assert!(
                            product(parts) == whole,
                            "{kind}: {m} × {n} × {k} (ta {ta}, tb {tb}, accumulate {accumulate}) in {parts} parts"
                        );
                    }
                }
            }
        }
    }

    /// `C = A·Bᵀ` with B a parameter (its transpose kept between writes): the product follows B
    /// through a write, through a change in place, and to a new buffer at another address.
    #[test]
    fn transposed_parameter_products_follow_every_change() {
        let (m, n, k) = (3, 20, 18);
        let cpu = CpuBackend::new();
        let value = |i: usize, s: f32| ((i * 37 % 101) as f32 - 50.0) / 25.0 * s;
        let a: Vec<f32> = (0..m * k).map(|i| value(i, 1.0)).collect();
        let mut bufs = vec![cpu.alloc(m * k).unwrap(), cpu.alloc(n * k).unwrap(), cpu.alloc(m * n).unwrap()];
        cpu.write(&mut bufs[0], 0, &a).unwrap();
        let g = Gemm::single(
            (m, n, k),
            (Loc { buf: 0, offset: 0 }, k, false),
            (Loc { buf: 1, offset: 0 }, k, true, true),
            (Loc { buf: 2, offset: 0 }, n),
        );
        let check = |bufs: &mut Vec<HostBuffer>, b: &[f32]| {
            cpu.gemm(&mut Mem { data: bufs, index: &[] }, &g).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|p| a[i * k + p] * b[j * k + p]).sum();
                    let got = bufs[2][i * n + j];
                    assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "C[{i}][{j}]: {got} vs {want}");
                }
            }
        };
        for (step, scale) in [1.0, -2.0, 0.5].into_iter().enumerate() {
            let b: Vec<f32> = (0..n * k).map(|i| value(i + 7, scale)).collect();
            if step == 1 {
                // In place, as the optimizer updates parameters on the CPU.
                cpu.host_mut(&mut bufs[1]).unwrap().copy_from_slice(&b);
            } else {
                cpu.write(&mut bufs[1], 0, &b).unwrap();
            }
            check(&mut bufs, &b);
            check(&mut bufs, &b);
        }
        // Changed by a compute call (a fill), not a write.
        cpu.fill(&mut Mem { data: &mut bufs, index: &[] }, Loc { buf: 1, offset: 0 }, n * k, 0.5).unwrap();
        check(&mut bufs, &vec![0.5; n * k]);
        // A new buffer holding other values (its address may be the old one's).
        let b: Vec<f32> = (0..n * k).map(|i| value(i + 3, 1.5)).collect();
        bufs[1] = HostBuffer::from(b.clone());
        check(&mut bufs, &b);
    }

    /// Products split by rows (many rows; a parameter's gradient over a short inner dimension)
    /// and by columns (few rows; a parameter's gradient over a long one) give the bits of one
    /// thread, and the values of the product.
    #[test]
    fn products_split_by_rows_or_columns_give_the_bits_of_one_thread() {
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        for (m, k, n, ta) in
            [(40, 150, 750, false), (300, 18, 750, true), (300, INNER_APART + 50, 16, true), (10, 150, 750, false)]
        {
            let (lda, ldb) = (if ta { m } else { k }, n);
            let data: Vec<f32> = (0..m * k + k * n + m * n).map(value).collect();
            let at = |offset: usize| Loc { buf: 0, offset };
            let g = Gemm::single((m, n, k), (at(0), lda, ta), (at(m * k), ldb, false, true), (at(m * k + k * n), n));
            let product = |threads: usize| {
                let mut bufs = vec![HostBuffer::from(data.clone())];
                CpuBackend::with_threads(threads).gemm(&mut Mem { data: &mut bufs, index: &[] }, &g).unwrap();
                bufs[0][m * k + k * n..].to_vec()
            };
            let one = product(1);
            assert!(product(2) == one, "{m} × {k} × {n}, ta {ta}: two threads differ from one");
            let a_at = |i: usize, p: usize| if ta { p * lda + i } else { i * lda + p };
            for (e, got) in one.iter().enumerate() {
                let (i, j) = (e / n, e % n);
                let want: f32 = (0..k).map(|p| data[a_at(i, p)] * data[m * k + p * n + j]).sum();
                assert!(
                    (got - want).abs() <= 1e-3 * (1.0 + want.abs()),
                    "{m} × {k} × {n}: C[{i}][{j}] {got} vs {want}"
                );
            }
        }
    }

    /// A chain (`h₀·U₀ + h₁·U₁`, the first writing or adding as it says) gives the bits of its
    /// products run one after another — in one share-out of the columns on the direct kernel and
    /// dot products, one product after another where one takes the crate — on 1 and 2 threads;
    /// a chain whose products write different outputs is refused.
    #[test]
    fn a_chain_gives_the_bits_of_its_products_in_turn() {
        let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 25.0;
        // Rows 1 and 3 (direct kernel, dot products with a transposed parameter), 200 (the crate).
        for (m, n, k, tb) in [(1, 750, 150, false), (3, 150, 750, true), (200, 70, 30, false)] {
            for (first_adds, threads) in [(false, 1), (true, 2), (false, 2)] {
                let cpu = CpuBackend::with_threads(threads);
                let ldb = if tb { k } else { n };
                let data: Vec<f32> = (0..3 * m * k + 2 * k * n + m * n).map(value).collect();
                let at = |offset: usize| Loc { buf: 0, offset };
                let (c, b0) = (3 * m * k, 3 * m * k + m * n);
                let product = |a: usize, b: usize, accumulate: bool| Gemm {
                    accumulate,
                    ..Gemm::single((m, n, k), (at(a), k, false), (at(b), ldb, tb, true), (at(c), n))
                };
                let chain =
                    [product(0, b0, first_adds), product(m * k, b0 + k * n, true), product(2 * m * k, b0, true)];
                let run = |sum: bool| {
                    let mut bufs = vec![HostBuffer::from(data.clone())];
                    let mut mem = Mem { data: &mut bufs, index: &[] };
                    if sum {
                        cpu.gemm_sum(&mut mem, &chain).unwrap();
                    } else {
                        chain.iter().for_each(|g| cpu.gemm(&mut mem, g).unwrap());
                    }
                    bufs[0][c..c + m * n].to_vec()
                };
                assert!(run(true) == run(false), "{m} × {n} × {k}, tb {tb}, {threads} threads");
                let mut other = chain;
                other[1].c = at(c + 1);
                let e = cpu.gemm_sum(&mut Mem { data: &mut [HostBuffer::from(data.clone())], index: &[] }, &other);
                assert!(e.is_err(), "a chain of two outputs runs");
            }
        }
    }
}
