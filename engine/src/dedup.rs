//! Shared pulled rows: when many vertices of a minibatch pull the same row (the same word of an
//! embedding), a product of the pulled input with a parameter runs once per distinct row and its
//! result is copied to every vertex that pulled it (or, where only fused kernels read it, read by
//! index where it is); the parameter's gradient sums the output
//! gradients per distinct row first. Rows given one per vertex are compared by content, so
//! nothing is assumed of where they came from; rows looked up in a table are told apart by id.

use super::fnv::FnvMap;
use arbor_core::backend::NO_ROW;
use arbor_core::fusion::Kernel;
use arbor_core::ir::{Func, Node, Op, ParamGrad, ValueId, VertexFn};
use arbor_core::Shape;
use std::ops::Range;

/// Distinct rows are worth sharing only when they are at most this fraction of the non-zero rows.
const WORTHWHILE: f64 = 0.9;

/// The distinct non-zero rows of one pulled input of a minibatch.
pub(super) struct Shared {
    /// How many distinct rows.
    pub unique: usize,
    /// For rows looked up in a table: the ids of the distinct rows, ascending.
    pub ids: Option<Vec<u32>>,
    /// Per row (in row order), the index of its distinct row, or `NO_ROW` for a zero row.
    pub map: Vec<u32>,
    /// The distinct rows, back to back.
    pub rows: Vec<f32>,
    /// Where the engine put the distinct rows (in its arena) and the map (in its index buffer).
    pub rows_at: usize,
    pub map_at: usize,
    /// In training, the rows that pull each distinct row (ascending), as a set per distinct row:
    /// where they are in the index buffer, and the first and last of them (empty: none).
    pub members: Option<Members>,
}

/// The rows that pull each distinct row, laid out in the index buffer as [`Rows::IndexedSet`]
/// reads them: `unique + 1` offsets at `at`, then the rows.
///
/// [`Rows::IndexedSet`]: arbor_core::backend::Rows::IndexedSet
#[derive(Clone, Debug)]
pub(super) struct Members {
    /// The offsets, then the rows.
    pub entries: Vec<u32>,
    /// Where `entries` starts in the index buffer.
    pub at: usize,
    /// The first row and one past the last that pull a distinct row.
    pub span: Range<usize>,
}

impl Shared {
    /// The rows that pull each distinct row (placed at index 0 until [`Members::at`] is set).
    pub fn members(&self) -> Members {
        let mut entries = vec![0u32; self.unique + 1];
        for &k in self.map.iter().filter(|&&k| k != NO_ROW) {
            entries[k as usize + 1] += 1;
        }
        for k in 0..self.unique {
            entries[k + 1] += entries[k];
        }
        let mut next: Vec<u32> = entries[..self.unique].to_vec();
        entries.resize(self.unique + 1 + entries[self.unique] as usize, 0);
        for (r, &k) in self.map.iter().enumerate().filter(|(_, &k)| k != NO_ROW) {
            entries[self.unique + 1 + next[k as usize] as usize] = r as u32;
            next[k as usize] += 1;
        }
        let pulls = |&k: &u32| k != NO_ROW;
        let span =
            self.map.iter().position(pulls).zip(self.map.iter().rposition(pulls)).map_or(0..0, |(a, b)| a..b + 1);
        Members { entries, at: 0, span }
    }
}

/// The distinct rows among `n` rows of `block` values (`row(r)`), if sharing them saves enough.
pub(super) fn find<'a>(n: usize, block: usize, zero: &[bool], row: impl Fn(usize) -> &'a [f32]) -> Option<Shared> {
    let nonzero = zero.iter().filter(|&&z| !z).count();
    if nonzero < 2 || block == 0 {
        return None;
    }
    // Per hash, the first distinct row with it; further ones with the same hash chain on.
    let mut first: FnvMap<u64, u32> = FnvMap::default();
    first.reserve(nonzero);
    let mut next: Vec<u32> = Vec::new();
    let mut map = vec![NO_ROW; n];
    let mut reps: Vec<usize> = Vec::new();
    for r in (0..n).filter(|&r| !zero[r]) {
        let x = row(r);
        let fresh = reps.len() as u32;
        let mut at = *first.entry(key(x)).or_insert(fresh);
        while at != fresh && bits(row(reps[at as usize])) != bits(x) {
            if next[at as usize] == NO_ROW {
                next[at as usize] = fresh;
            }
            at = next[at as usize];
        }
        if at == fresh {
            reps.push(r);
            next.push(NO_ROW);
        }
        map[r] = at;
    }
    if reps.len() as f64 > WORTHWHILE * nonzero as f64 {
        return None;
    }
    let mut rows = Vec::with_capacity(reps.len() * block);
    for &r in &reps {
        rows.extend_from_slice(row(r));
    }
    Some(Shared { unique: reps.len(), ids: None, map, rows, rows_at: 0, map_at: 0, members: None })
}

/// The distinct rows that row `r` (vertex `order[r]`) pulls as row `ids[order[r]]` of `table`
/// (`block` values per row), every id but `padding`, which pulls zeros; with no table (one the
/// engine holds), their ids only. Ids are checked already.
pub(super) fn lookup(order: &[u32], ids: &[u32], table: Option<&[f32]>, block: usize, padding: Option<u32>) -> Shared {
    let mut distinct: Vec<u32> = ids.iter().copied().filter(|&i| Some(i) != padding).collect();
    distinct.sort_unstable();
    distinct.dedup();
    let map = order
        .iter()
        .map(|&v| {
            let id = ids[v as usize];
            if Some(id) == padding {
                NO_ROW
            } else {
                distinct.binary_search(&id).map_or(NO_ROW, |k| k as u32)
            }
        })
        .collect();
    let mut rows = Vec::new();
    if let Some(table) = table {
        rows.reserve(distinct.len() * block);
        for &id in &distinct {
            rows.extend_from_slice(&table[id as usize * block..(id as usize + 1) * block]);
        }
    }
    Shared { unique: distinct.len(), ids: Some(distinct), map, rows, rows_at: 0, map_at: 0, members: None }
}

/// The bit patterns of `x` (rows are equal when these are).
fn bits(x: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment, and every bit pattern is a u32.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len()) }
}

/// A hash of 16 values spread over the row (equal rows hash equally; others are told apart by
/// comparing them whole).
fn key(x: &[f32]) -> u64 {
    let step = (x.len() / 16).max(1);
    bits(x)
        .iter()
        .step_by(step)
        .fold(0xcbf2_9ce4_8422_2325, |h: u64, &v| (h ^ u64::from(v)).wrapping_mul(0x1000_0000_01b3))
}

/// The pulled input read (untransposed, one row per vertex) as the left factor of a product with
/// a parameter, if `v` is such a product.
pub(super) fn pulled_factor(func: &Func, v: ValueId) -> Option<usize> {
    let Op::MatMul { a, b, ta: false, .. } = func.node(v).op else { return None };
    match func.node(a).op {
        Op::Pull { input } if func.node(b).is_param && func.node(a).shape.rows() == 1 => Some(input),
        _ => None,
    }
}

/// Whether F or F′ reads the rows of input `input` one per vertex: for anything but the left
/// factor of a product with a parameter (which reads the distinct rows) and that product's
/// parameter gradient (which sums per distinct row).
pub(super) fn rows_read(f: &VertexFn, input: usize) -> bool {
    let fwd = f.forward();
    let is_pull = |v: ValueId| fwd.node(v).op == Op::Pull { input };
    let b = f.backward();
    let primal = |v: ValueId| matches!(b.func.node(v).op, Op::Primal { value } if is_pull(value));
    let in_f = (0..fwd.nodes.len())
        .map(|v| ValueId(v as u32))
        .any(|v| fwd.node(v).op.inputs().into_iter().any(is_pull) && pulled_factor(fwd, v) != Some(input));
    let in_b = b.func.nodes.iter().any(|n| n.op.inputs().into_iter().any(primal));
    let summed = b.param_grads.iter().any(|pg| matches!(*pg, ParamGrad::SumRows { dy, .. } if primal(dy)));
    let kept = f.outputs().iter().any(|p| is_pull(p.value)) || f.states().iter().any(|s| is_pull(s.value));
    in_f || in_b || summed || kept
}

/// The kernel that copies rows `block` wide (a gather when its load is bound to indexed rows).
pub(super) fn copy_kernel(block: usize) -> Kernel {
    Kernel {
        values: vec![ValueId(0)],
        nodes: vec![Node { op: Op::Pull { input: 0 }, shape: Shape::mat(1, block), is_param: false }],
        stores: vec![0],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows 1 and 4 pull id 7, rows 2 and 5 id 3, row 0 the padding: the sets follow the
    /// distinct ids (ascending), each set's rows ascending, and the span is rows 1..6.
    #[test]
    fn members_list_each_distinct_rows_pullers() {
        let order: Vec<u32> = (0..6).collect();
        let ids = [0, 7, 3, 9, 7, 3];
        let s = lookup(&order, &ids, None, 2, Some(0));
        assert_eq!(s.ids.as_deref(), Some(&[3, 7, 9][..]));
        let m = s.members();
        assert_eq!(m.entries, [0, 2, 4, 5, 2, 5, 1, 4, 3]);
        assert_eq!(m.span, 1..6);
        let none = lookup(&order, &[0; 6], None, 2, Some(0)).members();
        assert_eq!((none.entries, none.span), (vec![0], 0..0));
    }
}
