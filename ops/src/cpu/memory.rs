//! Raw, bounds-checked access to the buffers of one backend call, and row gathers and
//! scatter-adds.

use super::{bad, team, CpuBackend};
use arbor_core::backend::{Combine, IndexLoc, Loc, Mem, Rows, NO_ROW};
use arbor_core::error::Result;

const MAX_BUFFERS: usize = 16;

/// Base pointers and lengths of the buffers of one call.
///
/// Every call first checks that the regions it writes share no element with the regions it reads
/// ([`apart`], and `Stored::meets` for products), which is what makes handing out a mutable and
/// shared slices of one buffer sound whatever the caller asks for.
pub(crate) struct Raw<'a> {
    data: [(*mut f32, usize); MAX_BUFFERS],
    /// Each buffer's id and version (see [`HostBuffer`](super::HostBuffer)).
    stamps: [(u64, u64); MAX_BUFFERS],
    index: [(*const u32, usize); MAX_BUFFERS],
    _mem: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: `Raw` is a table of base pointers. Sharing it across threads is sound as long as no two
// threads write overlapping ranges: `Backend::gemm_batch` promises it for its products, and a
// fused call split between threads writes each half's own vertex rows.
unsafe impl Sync for Raw<'_> {}

impl<'a> Raw<'a> {
    /// The buffers of one call that writes the buffers `written` (their versions move on).
    pub(crate) fn new(mem: &'a mut Mem<'_, CpuBackend>, written: impl IntoIterator<Item = usize>) -> Result<Raw<'a>> {
        if mem.data.len() > MAX_BUFFERS || mem.index.len() > MAX_BUFFERS {
            return Err(bad("call", format!("more than {MAX_BUFFERS} buffers in one call")));
        }
        for buf in written {
            if let Some(b) = mem.data.get_mut(buf) {
                b.changing();
            }
        }
        let mut data = [(std::ptr::null_mut(), 0); MAX_BUFFERS];
        let mut stamps = [(0, 0); MAX_BUFFERS];
        for ((d, s), b) in data.iter_mut().zip(&mut stamps).zip(mem.data.iter_mut()) {
            *d = (b.base(), b.len());
            *s = b.stamp();
        }
        let mut index = [(std::ptr::null(), 0); MAX_BUFFERS];
        for (d, b) in index.iter_mut().zip(mem.index.iter()) {
            *d = (b.as_ptr(), b.len());
        }
        Ok(Raw { data, stamps, index, _mem: std::marker::PhantomData })
    }

    /// The id and version of buffer `buf` (zeros for none).
    pub(crate) fn stamp(&self, buf: usize) -> (u64, u64) {
        self.stamps.get(buf).copied().unwrap_or((0, 0))
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
        Rows::IndexedSet { data, offsets, index, combine } => {
            let op = combine.reduce().name();
            if matches!(combine, Combine::Max { by } if by != data) {
                return Err(bad(op, "a read takes the largest of its own rows (`by` must be `data`)"));
            }
            let offs = raw.index(op, IndexLoc { offset: offsets.offset + start, ..offsets }, m + 1)?;
            out.fill(0.0);
            for (v, o) in out.chunks_exact_mut(block).enumerate() {
                let (lo, hi) = (offs[v] as usize, offs[v + 1] as usize);
                let rows = raw.index(op, IndexLoc { offset: index.offset + lo, ..index }, hi.saturating_sub(lo))?;
                let weights = set_weights(raw, combine, lo, rows.len())?;
                for (q, &i) in rows.iter().enumerate() {
                    // SAFETY: as above.
                    let x = unsafe { raw.row(op, data, i, block)? };
                    match combine {
                        Combine::Max { .. } if q == 0 => o.copy_from_slice(x),
                        // A later row must be larger to replace an earlier one (as the CUDA
                        // kernels and the interpreter compare).
                        Combine::Max { .. } => o.iter_mut().zip(x).filter(|(d, x)| *x > *d).for_each(|(d, x)| *d = *x),
                        Combine::Sum | Combine::Mean => o.iter_mut().zip(x).for_each(|(d, x)| *d += x),
                        Combine::Weighted { .. } => o.iter_mut().zip(x).for_each(|(d, x)| *d += weights[q] * x),
                    }
                }
                if let (Combine::Mean, count @ 1..) = (combine, rows.len()) {
                    o.iter_mut().for_each(|d| *d /= count as f32);
                }
            }
        }
    }
    Ok(())
}

/// The weights of the `n` members of a set from position `at` of its list on, for a
/// [`Combine::Weighted`] set (empty for the others).
fn set_weights<'r>(raw: &Raw<'r>, combine: Combine, at: usize, n: usize) -> Result<&'r [f32]> {
    match combine {
        // SAFETY: the weights are data of the minibatch, never written by the call reading them.
        Combine::Weighted { weights, .. } => unsafe { raw.get("gather_weighted", weights.offset_by(at), n) },
        _ => Ok(&[]),
    }
}

/// The elements `start..end` of buffer `buf`, as one call reads or writes them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    buf: usize,
    start: usize,
    end: usize,
}

impl Span {
    /// `len` elements at `at`.
    pub(crate) fn at(at: Loc, len: usize) -> Span {
        Span { buf: at.buf, start: at.offset, end: at.offset.saturating_add(len) }
    }

    /// Whether the two share an element.
    pub(crate) fn meets(self, o: Span) -> bool {
        self.buf == o.buf && self.start < o.end && o.start < self.end
    }
}

/// The elements that rows `index` of `block` values from `at` span, from the first row named
/// to the last (`None` when no row is named).
pub(crate) fn rows_span(index: &[u32], at: Loc, block: usize) -> Option<Span> {
    let (lo, hi) = index.iter().filter(|&&r| r != NO_ROW).fold((u32::MAX, 0), |(l, h), &r| (l.min(r), h.max(r)));
    (lo <= hi).then(|| Span::at(at.offset_by(lo as usize * block), (hi - lo + 1) as usize * block))
}

/// An error naming `op` where `a` and `b` share an element: a call never reads or writes what it
/// writes elsewhere, which is what lets the backend hand out a mutable slice beside shared ones
/// (so no caller, however it builds its calls, makes it alias memory).
pub(crate) fn apart(op: &str, a: Span, b: Span) -> Result<()> {
    if a.meets(b) {
        return Err(bad(op, format!("a region written ({a:?}) overlaps another the call reads or writes ({b:?})")));
    }
    Ok(())
}

/// [`apart`] for `write` and every block `rows` reads (or writes) for `n` vertices of `block`
/// elements: indexed rows one by one, their indices bounds-checked.
pub(crate) fn apart_from_rows(raw: &Raw<'_>, op: &str, write: Span, rows: &Rows, n: usize, block: usize) -> Result<()> {
    let row = |data: Loc, i: u32| Span::at(data.offset_by((i as usize).saturating_mul(block)), block);
    match *rows {
        Rows::Contiguous(at) => apart(op, write, Span::at(at, n.saturating_mul(block))),
        Rows::Broadcast(at) => apart(op, write, Span::at(at, block)),
        Rows::Zeros => Ok(()),
        Rows::Indexed { data, index } => {
            raw.index(op, index, n)?.iter().filter(|&&i| i != NO_ROW).try_for_each(|&i| apart(op, write, row(data, i)))
        }
        Rows::IndexedSet { data, offsets, index, combine } => {
            let offs = raw.index(op, offsets, n + 1)?;
            let (lo, hi) = (offs[0] as usize, offs[n] as usize);
            if let Combine::Weighted { weights, .. } = combine {
                apart(op, write, Span::at(weights.offset_by(lo), hi.saturating_sub(lo)))?;
            }
            let rows = raw.index(op, IndexLoc { offset: index.offset + lo, ..index }, hi.saturating_sub(lo))?;
            rows.iter().filter(|&&i| i != NO_ROW).try_for_each(|&i| apart(op, write, row(data, i)))
        }
    }
}

/// Memory calls over fewer elements than this run on the caller alone.
pub(crate) const PARALLEL_ELEMS: usize = 1 << 15;

/// Adds each of `n` blocks at `src` into the rows `dst` names for its vertex. Large calls split
/// the columns between the team's threads (rows may repeat; columns never overlap).
pub(crate) fn scatter_add(raw: &Raw<'_>, src: Loc, block: usize, n: usize, dst: &Rows) -> Result<()> {
    apart_from_rows(raw, "scatter_add", Span::at(src, n * block), dst, n, block)?;
    // SAFETY: the source and the destination rows share no element (checked above).
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
    let combine = match *dst {
        Rows::IndexedSet { combine, .. } => combine,
        _ => Combine::Sum,
    };
    // A weighted set's weights, read beside the rows written: apart from them.
    let first = offs.map_or(0, |o| o[0] as usize);
    let weights = set_weights(raw, combine, first, index.len())?;
    if let (Combine::Weighted { weights: at, .. }, Some(to)) = (combine, rows_span(index, data, block)) {
        apart("scatter_add", to, Span::at(at.offset_by(first), index.len()))?;
    }
    if let Combine::Max { by } = combine {
        // The compared rows are read while the destination rows are written: the spans of the
        // rows named, in each, apart, and the compared ones in bounds.
        if let (Some(to), Some(from)) = (rows_span(index, data, block), rows_span(index, by, block)) {
            apart("scatter_add", to, from)?;
            // SAFETY: only a bounds check; the rows are read below beside writes that do not meet them.
            unsafe { raw.get("scatter_add", Loc { buf: from.buf, offset: from.start }, from.end - from.start)? };
        }
    }
    let max = if n * block >= PARALLEL_ELEMS { usize::MAX } else { 1 };
    team::split(max, |part, parts| {
        let cols = team::share(block, part, parts);
        for (v, x) in src.chunks_exact(block.max(1)).enumerate() {
            let rows = rows_of(v);
            if let Combine::Max { by } = combine {
                for j in cols.clone() {
                    // SAFETY: the compared rows were bounds-checked and do not meet the written ones.
                    let at = |r: u32| unsafe { raw.get("scatter_add", by.offset_by(r as usize * block + j), 1) };
                    let mut best: Option<(u32, f32)> = None;
                    for &r in rows.iter().filter(|&&r| r != NO_ROW) {
                        let y = at(r)?[0];
                        if best.is_none_or(|(_, b)| y > b) {
                            best = Some((r, y));
                        }
                    }
                    if let Some((r, _)) = best {
                        // SAFETY: each part writes only its own columns of a destination row.
                        let d = unsafe { raw.get_mut("scatter_add", data.offset_by(r as usize * block + j), 1)? };
                        d[0] += x[j];
                    }
                }
                continue;
            }
            if v + AHEAD < n {
                for &row in rows_of(v + AHEAD).iter().filter(|&&r| r != NO_ROW) {
                    prefetch_row(raw, data.offset_by(row as usize * block + cols.start), cols.len());
                }
            }
            let count = rows.len() as f32;
            // Where the vertex's members start among the weights (which start at the first's).
            let from = offs.map_or(v, |o| (o[v] - o[0]) as usize);
            for (q, &row) in rows.iter().enumerate().filter(|&(_, &r)| r != NO_ROW) {
                let at = data.offset_by(row as usize * block + cols.start);
                // SAFETY: each part writes only its own columns of a destination row, one row at
                // a time.
                let d = unsafe { raw.get_mut("scatter_add", at, cols.len())? };
                match combine {
                    Combine::Mean => d.iter_mut().zip(&x[cols.clone()]).for_each(|(d, x)| *d += x / count),
                    Combine::Weighted { .. } => {
                        let w = weights[from + q];
                        d.iter_mut().zip(&x[cols.clone()]).for_each(|(d, x)| *d += x * w)
                    }
                    _ => d.iter_mut().zip(&x[cols.clone()]).for_each(|(d, x)| *d += x),
                }
            }
        }
        Ok(())
    })
}

/// Vertices a scatter looks ahead to ask for the rows it will add into: they lie anywhere in
/// the arena (a level's children, in the backward pass), and fetched on demand each row waits
/// on memory (the prefetch makes SST's backward scatters at batch 64 about 1.7× faster).
const AHEAD: usize = 4;

/// Asks the cache for the `len` elements at `at`, to be written soon; nothing where they lie
/// outside their buffer (the write checks them).
fn prefetch_row(raw: &Raw<'_>, at: Loc, len: usize) {
    // SAFETY: only the range is checked; nothing is read or written through the slice.
    if let Ok(row) = unsafe { raw.get("prefetch", at, len) } {
        super::simd::prefetch(row);
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::{CpuBackend, HostBuffer};
    use arbor_core::backend::{Backend, Gemm, IndexLoc, Loc, Mem, Rows};
    use arbor_core::fusion::Step;
    use arbor_core::ir::Builder;

    /// Calls whose writes overlap what they read are refused, so safe code cannot make the
    /// backend alias a mutable slice: a product into its own factor, a fused kernel storing over
    /// its load, a scatter-add from the rows it adds into, a row sum into its own rows. A product
    /// written beside its factor, in other columns of the same rows, runs.
    #[test]
    fn overlapping_calls_are_refused() {
        let cpu = CpuBackend::new();
        let mut data = vec![HostBuffer::from((0..64).map(|i| i as f32).collect::<Vec<f32>>())];
        let index = vec![vec![0u32, 1]];
        let mut mem = Mem { data: &mut data, index: &index };
        let at = |offset| Loc { buf: 0, offset };
        // A: 2 × 4 in columns 0..4 of rows 8 apart; B: 4 × 4 at 32.
        let product = |c: usize| Gemm::single((2, 4, 4), (at(0), 8, false), (at(32), 4, false, false), (at(c), 8));
        let e = cpu.gemm(&mut mem, &product(2)).unwrap_err().to_string();
        assert!(e.contains("gemm") && e.contains("overlaps"), "{e}");
        cpu.gemm(&mut mem, &product(4)).unwrap();
        let want: f32 = (0..4).map(|p| p as f32 * (32 + p * 4) as f32).sum();
        assert_eq!(mem.data[0][4], want, "C beside A is computed");

        let f = Builder::new("tanh", 1);
        let x = f.pull("x", 4);
        f.push("y", x.tanh());
        let f = f.build().unwrap();
        let Some(Step::Fused(k)) = f.inference_plan().phases.iter().flatten().find(|s| matches!(s, Step::Fused(_)))
        else {
            panic!("no fused step")
        };
        let e = cpu.fused(&mut mem, k, 2, &[Rows::Contiguous(at(0))], &[at(4)]).unwrap_err().to_string();
        assert!(e.contains("fused") && e.contains("overlaps"), "{e}");
        cpu.fused(&mut mem, k, 2, &[Rows::Contiguous(at(0))], &[at(8)]).unwrap();

        let rows = Rows::Indexed { data: at(0), index: IndexLoc { buf: 0, offset: 0 } };
        let e = cpu.scatter_add(&mut mem, at(4), 4, 2, &rows).unwrap_err().to_string();
        assert!(e.contains("scatter_add") && e.contains("overlaps"), "{e}");
        cpu.scatter_add(&mut mem, at(8), 4, 2, &rows).unwrap();
        assert!(cpu.sum_rows(&mut mem, at(0), 4, 4, at(8), false).is_err());
        cpu.sum_rows(&mut mem, at(0), 4, 4, at(16), false).unwrap();
    }
}
