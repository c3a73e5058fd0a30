//! Attention over children on the CPU: [`arbor_core::attention`]'s arithmetic vertex by vertex,
//! over the rows a call names, every region bounds-checked and every write apart from every read.

use super::bad;
use super::memory::{apart, rows_span, Raw, Span, PARALLEL_ELEMS};
use super::team;
use arbor_core::attention::{self, Scratch};
use arbor_core::backend::{Attention, AttentionGrads, IndexLoc, Loc, NO_ROW};
use arbor_core::error::Result;

/// The children's row numbers of every vertex of `a`, checked: per vertex, its range in the
/// returned list (offsets never decrease, numbers in the index buffer).
fn sets<'a>(raw: &Raw<'a>, op: &str, a: &Attention) -> Result<(&'a [u32], &'a [u32])> {
    let offs = raw.index(op, a.offsets, a.n + 1)?;
    if offs.windows(2).any(|w| w[0] > w[1]) {
        return Err(bad(op, "child offsets decrease"));
    }
    let (lo, hi) = (offs[0] as usize, offs[a.n] as usize);
    Ok((offs, raw.index(op, IndexLoc { offset: a.index.offset + lo, ..a.index }, hi - lo)?))
}

/// Vertex `v`'s children's row numbers in the list [`sets`] gives.
fn children<'a>(offs: &[u32], index: &'a [u32], v: usize) -> &'a [u32] {
    &index[(offs[v] - offs[0]) as usize..(offs[v + 1] - offs[0]) as usize]
}

/// Every pair of a written and a read span apart.
fn all_apart(op: &str, written: &[Option<Span>], read: &[Option<Span>]) -> Result<()> {
    for w in written.iter().flatten() {
        for r in read.iter().flatten() {
            apart(op, *w, *r)?;
        }
    }
    Ok(())
}

/// The key and value rows of one vertex's children, into `keys` and `values`.
///
/// # Safety
/// No mutable slice may overlap the rows while they are held.
unsafe fn child_rows<'a>(
    raw: &Raw<'a>,
    a: &Attention,
    rows: &[u32],
    keys: &mut Vec<&'a [f32]>,
    values: &mut Vec<&'a [f32]>,
) -> Result<()> {
    let (kb, vb) = (a.widths.heads * a.widths.key, a.widths.heads * a.widths.value);
    keys.clear();
    values.clear();
    for &r in rows.iter().filter(|&&r| r != NO_ROW) {
        // SAFETY: the caller's contract.
        unsafe {
            keys.push(raw.row("attend", a.keys, r, kb)?);
            values.push(raw.row("attend", a.values, r, vb)?);
        }
    }
    Ok(())
}

/// [`Backend::attend`](arbor_core::backend::Backend::attend).
pub(crate) fn attend(raw: &Raw<'_>, a: &Attention, out: Loc) -> Result<()> {
    let op = "attend";
    let (w, n) = (a.widths, a.n);
    let (qb, kb, vb) = (w.heads * w.key, w.heads * w.key, w.heads * w.value);
    let (offs, index) = sets(raw, op, a)?;
    let write = [Some(Span::at(out, n * vb))];
    let read = [Some(Span::at(a.query, n * qb)), rows_span(index, a.keys, kb), rows_span(index, a.values, vb)];
    all_apart(op, &write, &read)?;
    // SAFETY: the output is apart from everything read (checked above).
    let q = unsafe { raw.get(op, a.query, n * qb)? };
    // Vertices write rows of their own: split across the team when the children are many.
    let work = index.len() * (kb + vb);
    let max = if n >= 2 && work >= PARALLEL_ELEMS { usize::MAX } else { 1 };
    team::split(max, |part, parts| {
        let mine = team::share(n, part, parts);
        // SAFETY: as above; the parts' output rows are disjoint.
        let o = unsafe { raw.get_mut(op, out.offset_by(mine.start * vb), mine.len() * vb)? };
        let (mut keys, mut values, mut scratch) = (Vec::new(), Vec::new(), Scratch::default());
        for (v, o) in mine.zip(o.chunks_exact_mut(vb.max(1))) {
            // SAFETY: as above.
            unsafe { child_rows(raw, a, children(offs, index, v), &mut keys, &mut values)? };
            attention::forward(&w, &q[v * qb..(v + 1) * qb], &keys, &values, o, &mut scratch);
        }
        Ok(())
    })
}

/// [`Backend::attend_grad`](arbor_core::backend::Backend::attend_grad).
pub(crate) fn attend_grad(raw: &Raw<'_>, a: &Attention, g: &AttentionGrads) -> Result<()> {
    let op = "attend_grad";
    let (w, n) = (a.widths, a.n);
    let (qb, vb) = (w.heads * w.key, w.heads * w.value);
    let (offs, index) = sets(raw, op, a)?;
    let (dkeys, dvalues) = (rows_span(index, g.keys, qb), rows_span(index, g.values, vb));
    let dq = Some(Span::at(g.query, n * qb));
    let read = [
        Some(Span::at(a.query, n * qb)),
        Some(Span::at(g.out, n * vb)),
        rows_span(index, a.keys, qb),
        rows_span(index, a.values, vb),
    ];
    all_apart(op, &[dq, dkeys, dvalues], &read)?;
    all_apart(op, &[dq], &[dkeys, dvalues])?;
    if g.keys != g.values {
        all_apart(op, &[dkeys], &[dvalues])?;
    }
    // SAFETY: the queries' gradients are apart from everything else (checked above).
    let (q, grad, dq) =
        unsafe { (raw.get(op, a.query, n * qb)?, raw.get(op, g.out, n * vb)?, raw.get_mut(op, g.query, n * qb)?) };
    let (mut keys, mut values, mut scratch, mut rows) = (Vec::new(), Vec::new(), Scratch::default(), Vec::new());
    for v in 0..n {
        rows.clear();
        rows.extend(children(offs, index, v).iter().filter(|&&r| r != NO_ROW));
        // SAFETY: the rows read are apart from every row written (checked above).
        unsafe { child_rows(raw, a, &rows, &mut keys, &mut values)? };
        let (qv, gv) = (&q[v * qb..(v + 1) * qb], &grad[v * vb..(v + 1) * vb]);
        let mut failed = Ok(());
        attention::backward(&w, qv, &keys, &values, gv, &mut dq[v * qb..(v + 1) * qb], &mut scratch, |c, dk, dv| {
            let r = rows[c] as usize;
            let add = |at: Loc, x: &[f32]| -> Result<()> {
                // SAFETY: one destination row at a time, apart from everything read.
                let d = unsafe { raw.get_mut(op, at.offset_by(r * x.len()), x.len())? };
                d.iter_mut().zip(x).for_each(|(d, x)| *d += x);
                Ok(())
            };
            if failed.is_ok() {
                failed = add(g.keys, dk).and_then(|()| add(g.values, dv));
            }
        });
        failed?;
    }
    Ok(())
}
