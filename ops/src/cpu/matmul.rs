//! Matrix products through the `gemm` crate, and products with a few rows through
//! [`few_rows`](super::few_rows).

use super::memory::Raw;
use super::{bad, few_rows};
use arbor_core::backend::Gemm;
use arbor_core::error::Result;
use gemm::Parallelism;

/// Products with fewer multiply-adds than this run on one thread.
const PARALLEL_FLOPS: usize = 1 << 24;

/// Elements spanned by a stored `rows × cols` matrix with row stride `ld` (saturating: a span
/// that overflows is larger than any buffer, so the range check refuses it).
fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1).saturating_mul(ld).saturating_add(cols)
    }
}

/// Products with fewer multiply-adds than this are not worth handing to another thread.
const CONCURRENT_FLOPS: usize = 1 << 20;

/// Runs independent products, concurrently when there are several mid-sized ones (each too small
/// to split across threads by itself, but large enough to pay for a thread hand-off).
pub(crate) fn gemm_batch(raw: &Raw<'_>, gs: &[Gemm]) -> Result<()> {
    let size = |g: &Gemm| g.m * g.n * g.k * g.batch;
    let mid_sized = gs.iter().all(|g| (CONCURRENT_FLOPS..PARALLEL_FLOPS).contains(&size(g)));
    if gs.len() < 2 || !mid_sized || rayon::current_num_threads() < 2 {
        return gs.iter().try_for_each(|g| gemm(raw, g));
    }
    use rayon::prelude::*;
    gs.par_iter().try_for_each(|g| gemm(raw, g))
}

/// Runs a (batched) product, checking every operand's range first.
pub(crate) fn gemm(raw: &Raw<'_>, g: &Gemm) -> Result<()> {
    let (a_rows, a_cols) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
    let (b_rows, b_cols) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
    if a_cols > g.lda.max(1) && a_rows > 1 || b_cols > g.ldb.max(1) && b_rows > 1 || g.n > g.ldc.max(1) && g.m > 1 {
        return Err(bad("gemm", format!("a leading dimension is smaller than its row: {g:?}")));
    }
    let par = if g.m * g.n * g.k * g.batch >= PARALLEL_FLOPS { Parallelism::Rayon(0) } else { Parallelism::None };
    // Products small enough for one thread, with A not transposed, may take the unpacked path.
    let few_rows = matches!(par, Parallelism::None) && !g.ta;
    for i in 0..g.batch {
        // SAFETY: ranges checked by `get`; C never overlaps A or B in the engine's plans.
        let c = unsafe { raw.get_mut("gemm", g.c.offset_by(i.saturating_mul(g.stride_c)), extent(g.m, g.n, g.ldc))? };
        if g.k == 0 {
            if !g.accumulate {
                for r in 0..g.m {
                    c[r * g.ldc..r * g.ldc + g.n].fill(0.0);
                }
            }
            continue;
        }
        let a = unsafe { raw.get("gemm", g.a.offset_by(i.saturating_mul(g.stride_a)), extent(a_rows, a_cols, g.lda))? };
        let b = unsafe { raw.get("gemm", g.b.offset_by(i.saturating_mul(g.stride_b)), extent(b_rows, b_cols, g.ldb))? };
        if few_rows && few_rows::product((g.m, g.n, g.k), (a, g.lda), (b, g.ldb, g.tb), (c, g.ldc), g.accumulate) {
            continue;
        }
        let (a_rs, a_cs) = if g.ta { (1, g.lda as isize) } else { (g.lda as isize, 1) };
        let (b_rs, b_cs) = if g.tb { (1, g.ldb as isize) } else { (g.ldb as isize, 1) };
        // SAFETY: every element the product touches lies in the checked slices above.
        unsafe {
            gemm::gemm(
                g.m,
                g.n,
                g.k,
                c.as_mut_ptr(),
                1,
                g.ldc as isize,
                g.accumulate,
                a.as_ptr(),
                a_cs,
                a_rs,
                b.as_ptr(),
                b_cs,
                b_rs,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                par,
            );
        }
    }
    Ok(())
}
