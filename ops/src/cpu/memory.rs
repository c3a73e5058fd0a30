//! Raw, bounds-checked access to the buffers of one backend call, and row gathers and
//! scatter-adds.

use super::{bad, team, CpuBackend};
use arbor_core::backend::{IndexLoc, Loc, Mem, Rows, NO_ROW};
use arbor_core::error::Result;

const MAX_BUFFERS: usize = 16;

/// Base pointers and lengths of the buffers of one call.
///
/// The engine's memory plan guarantees that the regions a call writes do not overlap the regions
/// it reads, which is what makes handing out a mutable and shared slices of one buffer sound.
pub(crate) struct Raw<'a> {
    data: [(*mut f32, usize); MAX_BUFFERS],
    index: [(*const u32, usize); MAX_BUFFERS],
    _mem: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: `Raw` is a table of base pointers. Sharing it across threads is sound as long as no two
// threads write overlapping ranges: `Backend::gemm_batch` promises it for its products, and a
// fused call split between threads writes each half's own vertex rows.
unsafe impl Sync for Raw<'_> {}

impl<'a> Raw<'a> {
    pub(crate) fn new(mem: &'a mut Mem<'_, CpuBackend>) -> Result<Raw<'a>> {
        if mem.data.len() > MAX_BUFFERS || mem.index.len() > MAX_BUFFERS {
            return Err(bad("call", format!("more than {MAX_BUFFERS} buffers in one call")));
        }
        let mut data = [(std::ptr::null_mut(), 0); MAX_BUFFERS];
        for (d, b) in data.iter_mut().zip(mem.data.iter_mut()) {
            *d = (b.as_mut_ptr(), b.len());
        }
        let mut index = [(std::ptr::null(), 0); MAX_BUFFERS];
        for (d, b) in index.iter_mut().zip(mem.index.iter()) {
            *d = (b.as_ptr(), b.len());
        }
        Ok(Raw { data, index, _mem: std::marker::PhantomData })
    }

    fn check(&self, op: &str, at: Loc, len: usize) -> Result<*mut f32> {
        let (ptr, cap) = self.data.get(at.buf).copied().unwrap_or((std::ptr::null_mut(), 0));
        if ptr.is_null() || at.offset.checked_add(len).is_none_or(|end| end > cap) {
            return Err(bad(op, format!("{len} elements at {}:{} outside a buffer of {cap}", at.buf, at.offset)));
        }
        // SAFETY: in bounds of the buffer, checked above.
        Ok(unsafe { ptr.add(at.offset) })
    }

    /// `len` elements at `at`, to read.
    ///
    /// # Safety
    /// No mutable slice overlapping this range may be live.
    pub(crate) unsafe fn get(&self, op: &str, at: Loc, len: usize) -> Result<&'a [f32]> {
        let p = self.check(op, at, len)?;
        // SAFETY: in bounds (checked); no mutable slice overlaps it (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(p, len) })
    }

    /// `len` elements at `at`, to write.
    ///
    /// # Safety
    /// No other slice overlapping this range may be live.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn get_mut(&self, op: &str, at: Loc, len: usize) -> Result<&'a mut [f32]> {
        let p = self.check(op, at, len)?;
        // SAFETY: in bounds (checked); no other slice overlaps it (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
    }

    /// `len` indices at `at`.
    pub(crate) fn index(&self, op: &str, at: IndexLoc, len: usize) -> Result<&'a [u32]> {
        let (ptr, cap) = self.index.get(at.buf).copied().unwrap_or((std::ptr::null(), 0));
        if ptr.is_null() || at.offset.checked_add(len).is_none_or(|end| end > cap) {
            return Err(bad(op, format!("{len} indices at {}:{} outside an index buffer of {cap}", at.buf, at.offset)));
        }
        // SAFETY: in bounds, checked above; index buffers are never written during a call.
        Ok(unsafe { std::slice::from_raw_parts(ptr.add(at.offset), len) })
    }

    /// The block of row `row` (of `block` elements) starting at `data`, to read.
    ///
    /// # Safety
    /// As [`Raw::get`].
    pub(crate) unsafe fn row(&self, op: &str, data: Loc, row: u32, block: usize) -> Result<&'a [f32]> {
        // SAFETY: the caller's contract.
        unsafe { self.get(op, data.offset_by(row as usize * block), block) }
    }
}

/// Reads the blocks of vertices `start..start + m` of `rows` into `out` (`m·block` elements).
pub(crate) fn load(raw: &Raw<'_>, rows: &Rows, start: usize, m: usize, block: usize, out: &mut [f32]) -> Result<()> {
    match *rows {
        Rows::Contiguous(at) => {
            // SAFETY: a load's source is never written by the call that loads it.
            out.copy_from_slice(unsafe { raw.get("load", at.offset_by(start * block), m * block)? })
        }
        // SAFETY: as above.
        Rows::Broadcast(at) => out.copy_from_slice(unsafe { raw.get("load", at, block)? }),
        Rows::Zeros => out.fill(0.0),
        Rows::Indexed { data, index } => {
            let idx = raw.index("gather", IndexLoc { offset: index.offset + start, ..index }, m)?;
            for (o, &i) in out.chunks_exact_mut(block).zip(idx) {
                if i == NO_ROW {
                    o.fill(0.0);
                } else {
                    // SAFETY: as above.
                    o.copy_from_slice(unsafe { raw.row("gather", data, i, block)? });
                }
            }
        }
        Rows::IndexedSet { data, offsets, index } => {
            let offs = raw.index("gather_sum", IndexLoc { offset: offsets.offset + start, ..offsets }, m + 1)?;
            out.fill(0.0);
            for (v, o) in out.chunks_exact_mut(block).enumerate() {
                let (lo, hi) = (offs[v] as usize, offs[v + 1] as usize);
                let rows =
                    raw.index("gather_sum", IndexLoc { offset: index.offset + lo, ..index }, hi.saturating_sub(lo))?;
                for &i in rows {
                    // SAFETY: as above.
                    for (d, x) in o.iter_mut().zip(unsafe { raw.row("gather_sum", data, i, block)? }) {
                        *d += x;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Memory calls over fewer elements than this run on the caller alone.
pub(crate) const PARALLEL_ELEMS: usize = 1 << 15;

/// Adds each of `n` blocks at `src` into the rows `dst` names for its vertex. Large calls split
/// the columns between the team's threads (rows may repeat; columns never overlap).
pub(crate) fn scatter_add(raw: &Raw<'_>, src: Loc, block: usize, n: usize, dst: &Rows) -> Result<()> {
    // SAFETY: the source (a gradient of this task) and the destination (children's state
    // gradients) are different regions.
    let src = unsafe { raw.get("scatter_add", src, n * block)? };
    let data = match *dst {
        Rows::Indexed { data, .. } | Rows::IndexedSet { data, .. } => data,
        _ => return Err(bad("scatter_add", "destination must be indexed rows")),
    };
    // Every vertex's destination rows, checked once.
    let (offs, index): (Option<&[u32]>, &[u32]) = match *dst {
        Rows::Indexed { index, .. } => (None, raw.index("scatter_add", index, n)?),
        Rows::IndexedSet { offsets, index, .. } => {
            let offs = raw.index("scatter_add", offsets, n + 1)?;
            if offs.windows(2).any(|w| w[0] > w[1]) {
                return Err(bad("scatter_add", "child offsets decrease"));
            }
            let (lo, hi) = (offs[0] as usize, offs[n] as usize);
            (Some(offs), raw.index("scatter_add", IndexLoc { offset: index.offset + lo, ..index }, hi - lo)?)
        }
        _ => return Err(bad("scatter_add", "destination must be indexed rows")),
    };
    let rows_of = |v: usize| -> &[u32] {
        match offs {
            None => &index[v..v + 1],
            Some(o) => &index[(o[v] - o[0]) as usize..(o[v + 1] - o[0]) as usize],
        }
    };
    let max = if n * block >= PARALLEL_ELEMS { usize::MAX } else { 1 };
    team::split(max, |part, parts| {
        let cols = team::share(block, part, parts);
        for (v, x) in src.chunks_exact(block.max(1)).enumerate() {
            for &row in rows_of(v).iter().filter(|&&r| r != NO_ROW) {
                let at = data.offset_by(row as usize * block + cols.start);
                // SAFETY: each part writes only its own columns of a destination row, one row at
                // a time.
                let d = unsafe { raw.get_mut("scatter_add", at, cols.len())? };
                for (d, x) in d.iter_mut().zip(&x[cols.clone()]) {
                    *d += x;
                }
            }
        }
        Ok(())
    })
}
