//! Runs a fused kernel: the vertices are cut into chunks small enough that every intermediate
//! of a chunk stays in cache, and each op runs as one loop over the chunk. Contiguous inputs are
//! read where they lie, column slices of them are read in place (with the row stride of what they
//! slice), and stored results are computed where they go; only intermediates and gathered rows
//! use scratch. Values known to be zero (a load bound to zeros, a product with one) are not
//! computed, nor are values only they would read (a leaf's forget gates), and `x + 0` is `x`.
//! Large calls split their vertices between two threads.

use super::memory::{apart, apart_from_rows, load, Raw, Span};
use super::{bad, elementwise, team};
use arbor_core::backend::{IndexLoc, Loc, Rows, NO_ROW};
use arbor_core::error::Result;
use arbor_core::fusion::Kernel;
use arbor_core::ir::{BinaryOp, Node, Op, ValueId};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::rc::Rc;

/// Scratch elements a chunk may use across all of its intermediates (its vertices' share of the
/// core's L2, with the rows it reads and writes).
const CHUNK_ELEMS: usize = 1 << 15;

/// Per-call scratch, kept per thread and only ever grown.
#[derive(Default)]
struct Scratch {
    /// Intermediates.
    regs: Vec<f32>,
    /// Zeros, as wide as the widest op: what a value known to be zero reads.
    zeros: Vec<f32>,
    /// Offset of each op's scratch in `regs`.
    offs: Vec<usize>,
    /// Where each op's values for the current chunk are.
    at: Vec<View>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    static KNOWN: RefCell<Vec<Known>> = const { RefCell::new(Vec::new()) };
}

/// What a call needs to know of its kernel beyond where its values are: it depends only on the
/// kernel and on the kind of each load's binding, so it is worked out once for each pair and
/// kept ([`Known`]); a batch-1 step calls the same few kernels tens of times.
struct Facts {
    /// Each op's result is known to be all zeros in the call.
    zero: Vec<bool>,
    /// Each op's result is stored or read by an op computed in the call.
    live: Vec<bool>,
    /// For each `x + 0` (see [`zero_plus`]): `x`, whose values it reads in place.
    same_as: Vec<Option<ValueId>>,
    /// Each op computes into scratch: computed, not stored, not read where it lies.
    scratch: Vec<bool>,
    /// Scratch elements one vertex needs.
    scratch_per_vertex: usize,
    /// Elements of one vertex's values (all ops but parameters).
    per_vertex: usize,
    /// Elements of the widest op.
    widest: usize,
    /// Elements of each load's and each store's value, in binding order.
    load_blocks: Vec<usize>,
    store_blocks: Vec<usize>,
    /// Per op: its position among the load bindings, and among the stores, if it has one.
    load_at: Vec<Option<usize>>,
    store_at: Vec<Option<usize>>,
}

/// One call: the kernel, its facts and its bindings.
#[derive(Clone, Copy)]
struct Call<'c, 'r> {
    raw: &'c Raw<'r>,
    k: &'c Kernel,
    facts: &'c Facts,
    loads: &'c [Rows],
    stores: &'c [Loc],
}

impl Call<'_, '_> {
    /// The binding of op `l`, if it is a load.
    fn load_of(&self, l: usize) -> Option<Rows> {
        self.facts.load_at[l].map(|i| self.loads[i])
    }

    /// The store of op `l`, if it is stored.
    fn store_of(&self, l: usize) -> Option<Loc> {
        self.facts.store_at[l].map(|j| self.stores[j])
    }
}

/// The facts of a kernel called lately on this thread: the kernel's address and a copy of what
/// of its ops and stores the facts depend on (a new kernel at a freed one's address is told
/// apart), and its loads' kinds.
struct Known {
    at: *const Kernel,
    ops: Vec<OpShape>,
    stores: Vec<usize>,
    kinds: u64,
    facts: Rc<Facts>,
}

/// What of an op its kernel's facts depend on: the op, its value's rows and columns, whether it
/// is a parameter (compared without the shapes' extents one by one).
type OpShape = (Op, usize, usize, bool);

fn op_shape(x: &Node) -> OpShape {
    (x.op.clone(), x.shape.rows(), x.shape.cols(), x.is_param)
}

/// Whether `ops` describe the ops of `nodes`.
fn same_ops(ops: &[OpShape], nodes: &[Node]) -> bool {
    ops.len() == nodes.len()
        && ops.iter().zip(nodes).all(|((op, rows, cols, param), x)| {
            *param == x.is_param && *rows == x.shape.rows() && *cols == x.shape.cols() && *op == x.op
        })
}

/// Kernels whose facts a thread keeps (a model's cells and heads have a few each, a kernel one
/// entry per kind of bindings it is called with); the oldest goes first.
const KNOWN_KERNELS: usize = 64;

/// Calls over at least this many elements (all ops, all vertices) and vertices run on two
/// threads, each over half of the vertices. Smaller calls (most calls at batch size 1) lose more
/// to waking the other thread than they gain (`arbor bench --batch 1|64`); at 32 vertices a
/// Tree-LSTM's cell already gains (SST batch 64: fused time ~8% less than from 64 up).
const PARALLEL_ELEMS: usize = 1 << 16;
const PARALLEL_VERTICES: usize = 32;

pub(crate) fn run(raw: &Raw<'_>, k: &Kernel, n: usize, loads: &[Rows], stores: &[Loc]) -> Result<()> {
    if let Some(msg) = k.binding_mismatch(loads.len(), stores.len()) {
        return Err(bad("fused", msg));
    }
    let facts = facts_of(k, loads);
    let facts = &*facts;
    // What the kernel stores shares no element with what it loads or stores elsewhere.
    let written: SmallVec<[Span; 8]> =
        stores.iter().zip(&facts.store_blocks).map(|(&at, &block)| Span::at(at, n * block)).collect();
    for (rows, &block) in loads.iter().zip(&facts.load_blocks) {
        for &w in &written {
            apart_from_rows(raw, "fused", w, rows, n, block)?;
        }
    }
    for (j, &w) in written.iter().enumerate() {
        for &other in &written[j + 1..] {
            apart("fused", w, other)?;
        }
    }
    let max = if n >= PARALLEL_VERTICES && n * facts.per_vertex >= PARALLEL_ELEMS { usize::MAX } else { 1 };
    let call = Call { raw, k, facts, loads, stores };
    team::split(max, |part, parts| run_vertices(call, team::share(n, part, parts)))
}

/// The kind of a load's binding, as [`Facts`] depend on it (0 is left for no load).
fn kind(rows: &Rows) -> u64 {
    match rows {
        Rows::Zeros => 1,
        Rows::Contiguous(_) => 2,
        Rows::Broadcast(_) => 3,
        Rows::Indexed { .. } => 4,
        Rows::IndexedSet { .. } => 5,
    }
}

/// The facts of `k` called with `loads`: kept from an earlier call, or worked out (and kept).
fn facts_of(k: &Kernel, loads: &[Rows]) -> Rc<Facts> {
    // Three bits a load: kernels with more than 21 loads are worked out every call.
    let kinds = (loads.len() <= 21).then(|| loads.iter().fold(0, |acc, r| acc << 3 | kind(r)));
    let Some(kinds) = kinds else { return Rc::new(Facts::of(k, loads)) };
    KNOWN.with(|known| {
        let mut known = known.borrow_mut();
        let same =
            |x: &Known| std::ptr::eq(x.at, k) && x.kinds == kinds && x.stores == k.stores && same_ops(&x.ops, &k.nodes);
        if let Some(x) = known.iter().find(|x| same(x)) {
            return x.facts.clone();
        }
        let facts = Rc::new(Facts::of(k, loads));
        if known.len() == KNOWN_KERNELS {
            known.remove(0);
        }
        let ops = k.nodes.iter().map(op_shape).collect();
        known.push(Known { at: k, ops, stores: k.stores.clone(), kinds, facts: facts.clone() });
        facts
    })
}

impl Facts {
    /// Which ops' results are known zeros (from the load bindings), and which ops a call must
    /// compute: those stored, and those a computed op reads. A value that only feeds products
    /// with a zero factor (a leaf's forget gates) is not computed.
    fn of(k: &Kernel, loads: &[Rows]) -> Facts {
        let (mut load_at, mut store_at) = (vec![None; k.nodes.len()], vec![None; k.nodes.len()]);
        k.loads().enumerate().for_each(|(i, l)| load_at[l] = Some(i));
        k.stores.iter().enumerate().for_each(|(j, &l)| store_at[l] = Some(j));
        let load_of = |l: usize| load_at[l].and_then(|i: usize| loads.get(i).copied());
        let stored: Vec<bool> = store_at.iter().map(Option::is_some).collect();
        let (mut zero, mut same_as) = (Vec::new(), Vec::new());
        for (l, x) in k.nodes.iter().enumerate() {
            let z = is_zero(&x.op, x.shape.numel(), &zero, load_of(l));
            zero.push(z);
            same_as.push(zero_plus(&x.op, &zero, k, x.shape.numel()));
        }
        let mut live = stored.clone();
        for l in (0..k.nodes.len()).rev() {
            // A zero result reads nothing: it is a view of zeros, or its store is filled with them.
            if !live[l] || zero[l] {
                continue;
            }
            match same_as[l] {
                Some(x) => live[x.index()] = true,
                None => k.nodes[l].op.inputs().iter().for_each(|x| live[x.index()] = true),
            }
        }
        // Computed into scratch: computed (live, not zero, not stored) and not read where it lies
        // (contiguous and broadcast loads, column slices of one-row values, `x + 0`).
        let scratch: Vec<bool> = (0..k.nodes.len())
            .map(|l| {
                let x = &k.nodes[l];
                let in_place =
                    matches!(load_of(l), Some(Rows::Contiguous(_) | Rows::Broadcast(_) | Rows::Indexed { .. }))
                        || matches!(x.op, Op::Slice { x, .. } if k.nodes[x.index()].shape.rows() == 1)
                        || same_as[l].is_some();
                !x.is_param && live[l] && !zero[l] && !stored[l] && !in_place
            })
            .collect();
        let numel = |l: usize| k.nodes[l].shape.numel();
        Facts {
            scratch_per_vertex: (0..k.nodes.len()).filter(|&l| scratch[l]).map(numel).sum(),
            per_vertex: (0..k.nodes.len()).filter(|&l| !k.nodes[l].is_param).map(numel).sum(),
            widest: (0..k.nodes.len()).map(numel).max().unwrap_or(0),
            load_blocks: k.loads().map(numel).collect(),
            store_blocks: k.stores.iter().map(|&l| numel(l)).collect(),
            load_at,
            store_at,
            zero,
            live,
            same_as,
            scratch,
        }
    }
}

/// Runs the kernel over the vertices `vertices`, in chunks, with this thread's scratch.
fn run_vertices(call: Call<'_, '_>, vertices: std::ops::Range<usize>) -> Result<()> {
    let (k, facts) = (call.k, call.facts);
    SCRATCH.with(|s| {
        let s = &mut *s.borrow_mut();
        let chunk = (CHUNK_ELEMS / facts.scratch_per_vertex.max(1)).clamp(1, vertices.len().max(1));
        // Scratch only for the ops that compute into it, back to back.
        s.offs.clear();
        let mut total = 0;
        for (l, x) in k.nodes.iter().enumerate() {
            s.offs.push(total);
            if x.is_param {
                total += x.shape.numel();
            } else if facts.scratch[l] {
                total += chunk * x.shape.numel();
            }
        }
        if s.regs.len() < total {
            s.regs.resize(total, 0.0);
        }
        if s.zeros.len() < facts.widest {
            s.zeros.resize(facts.widest, 0.0);
        }
        s.at.clear();
        s.at.resize(k.nodes.len(), View::NONE);
        let mut start = vertices.start;
        while start < vertices.end {
            let m = chunk.min(vertices.end - start);
            run_chunk(call, start, m, s)?;
            start += m;
        }
        Ok(())
    })
}

fn run_chunk(call: Call<'_, '_>, start: usize, m: usize, s: &mut Scratch) -> Result<()> {
    let Call { raw, k, facts, .. } = call;
    for (l, node) in k.nodes.iter().enumerate() {
        let block = node.shape.numel();
        let store = call.store_of(l);
        let stored = store.is_some();
        if !facts.live[l] && !facts.zero[l] {
            continue;
        }
        // Values read where they lie: inputs in place and column slices of one-row values.
        let zero = View::at(s.zeros.as_ptr(), 0, block);
        let view = if stored {
            None
        } else if facts.zero[l] {
            Some(zero)
        } else if let Some(x) = facts.same_as[l] {
            Some(s.at[x.index()])
        } else {
            match (&node.op, call.load_of(l)) {
                (_, Some(Rows::Contiguous(at))) => {
                    // SAFETY: loads are never written by the call that reads them.
                    let p = unsafe { raw.get("fused load", at.offset_by(start * block), m * block)? }.as_ptr();
                    Some(View::at(p, block, block))
                }
                (_, Some(Rows::Broadcast(at))) => {
                    // SAFETY: as above.
                    let p = unsafe { raw.get("fused load", at, block)? }.as_ptr();
                    Some(View::at(p, 0, block))
                }
                (_, Some(Rows::Indexed { data, index })) => {
                    Some(gathered(raw, data, index, start, m, block, zero.ptr)?)
                }
                (Op::Slice { x, start: c0, len }, _) if k.nodes[x.index()].shape.rows() == 1 => {
                    // Columns `c0..c0 + len` of each row of a one-row value.
                    let x = s.at[x.index()];
                    Some(View { off: x.off + c0, width: *len, ..x })
                }
                _ => None,
            }
        };
        if let Some(v) = view {
            s.at[l] = v;
            continue;
        }
        // Everything else is computed into its store or into scratch.
        // SAFETY: a store's region is not read by this kernel (the memory plan keeps the regions
        // a kernel writes apart from those it reads), and each scratch register is this op's own.
        let out: &mut [f32] = match store {
            // SAFETY: as said above, for the store.
            Some(at) => unsafe { raw.get_mut("fused store", at.offset_by(start * block), m * block)? },
            // SAFETY: as said above, for the scratch register (laid out to hold `m` rows).
            None => unsafe { std::slice::from_raw_parts_mut(s.regs.as_mut_ptr().add(s.offs[l]), m * block) },
        };
        s.at[l] = View::at(out.as_ptr(), block, block);
        if facts.zero[l] {
            out.fill(0.0);
            continue;
        }
        let at = &s.at;
        // Inputs are earlier ops; their values stay put for the whole chunk.
        let reg = |v: ValueId| at[v.index()];
        match &node.op {
            op if op.is_load() => {
                let binding = call.load_of(l).ok_or_else(|| bad("fused", format!("load {l} has no binding")))?;
                load(raw, &binding, start, m, block, out)?;
            }
            Op::Unary { op, x } => {
                let x = reg(*x);
                match x.dense(m) {
                    Some(x) if x.len() == out.len() => elementwise::unary(*op, x, out),
                    _ => (0..m).for_each(|r| elementwise::unary(*op, x.row(r), &mut out[r * block..][..block])),
                }
            }
            Op::Binary { op, a, b } => {
                let (a, b) = (reg(*a), reg(*b));
                match (a.dense(m), b.dense(m)) {
                    (Some(a), Some(b)) if a.len().max(b.len()) == out.len() => elementwise::binary(*op, a, b, out),
                    _ => (0..m)
                        .for_each(|r| elementwise::binary(*op, a.row(r), b.row(r), &mut out[r * block..][..block])),
                }
            }
            Op::Slice { x, start: c0, len } => {
                let (w, x) = (k.nodes[x.index()].shape.cols(), reg(*x));
                let mut rows = out.chunks_exact_mut(*len);
                for r in 0..m {
                    for (i, o) in x.row(r).chunks_exact(w).zip(rows.by_ref()) {
                        o.copy_from_slice(&i[*c0..c0 + len]);
                    }
                }
            }
            Op::Concat { parts } => {
                let c = node.shape.cols();
                for (r, out) in out.chunks_exact_mut(block).enumerate() {
                    let mut col = 0;
                    for p in parts {
                        let w = k.nodes[p.index()].shape.cols();
                        for (o, i) in out.chunks_exact_mut(c).zip(reg(*p).row(r).chunks_exact(w)) {
                            o[col..col + w].copy_from_slice(i);
                        }
                        col += w;
                    }
                }
            }
            Op::SumCols { x } => {
                let (w, x) = (k.nodes[x.index()].shape.cols(), reg(*x));
                for (r, out) in out.chunks_exact_mut(block).enumerate() {
                    for (o, i) in out.iter_mut().zip(x.row(r).chunks_exact(w)) {
                        *o = i.iter().sum();
                    }
                }
            }
            Op::MaxCols { x } => {
                let (w, x) = (k.nodes[x.index()].shape.cols(), reg(*x));
                for (r, out) in out.chunks_exact_mut(block).enumerate() {
                    for (o, i) in out.iter_mut().zip(x.row(r).chunks_exact(w)) {
                        *o = i.iter().copied().reduce(f32::max).unwrap_or(f32::NAN);
                    }
                }
            }
            Op::BroadcastCols { x, cols } => {
                let x = reg(*x);
                for (r, out) in out.chunks_exact_mut(block).enumerate() {
                    for (o, &i) in out.chunks_exact_mut(*cols).zip(x.row(r)) {
                        o.fill(i);
                    }
                }
            }
            op => return Err(bad("fused", format!("op {} cannot run in a fused kernel", op.name()))),
        }
    }
    Ok(())
}

/// Gathered rows read where they lie: the view of vertices `start..start + m` of `data` rows
/// named by `index` (`zeros` for [`NO_ROW`]), every row checked to lie in its buffer.
fn gathered(
    raw: &Raw<'_>,
    data: Loc,
    index: IndexLoc,
    start: usize,
    m: usize,
    block: usize,
    zeros: *const f32,
) -> Result<View> {
    let idx = raw.index("gather", IndexLoc { offset: index.offset + start, ..index }, m)?;
    let rows = idx.iter().filter(|&&i| i != NO_ROW).map(|&i| i as usize + 1).max().unwrap_or(0);
    // SAFETY: loads are never written by the call that reads them.
    let ptr = unsafe { raw.get("gather", data, rows.saturating_mul(block))? }.as_ptr();
    Ok(View { ptr, stride: block, width: block, off: 0, index: idx.as_ptr(), zeros })
}

/// Where an op's values for the current chunk are: `width` values per vertex, vertex `r`'s at
/// `ptr + r·stride + off` (a stride of 0: the same values for every vertex), or, for gathered
/// rows read in place, at `ptr + index[r]·stride + off` (at `zeros + off` for [`NO_ROW`]).
#[derive(Clone, Copy)]
struct View {
    ptr: *const f32,
    stride: usize,
    width: usize,
    off: usize,
    /// Row numbers of the chunk's vertices (null: rows in order).
    index: *const u32,
    /// What a [`NO_ROW`] vertex reads.
    zeros: *const f32,
}

impl View {
    const NONE: View = View::at(std::ptr::null(), 0, 0);

    /// Rows in order from `ptr`.
    const fn at(ptr: *const f32, stride: usize, width: usize) -> View {
        View { ptr, stride, width, off: 0, index: std::ptr::null(), zeros: std::ptr::null() }
    }

    /// Vertex `r`'s values.
    fn row<'a>(self, r: usize) -> &'a [f32] {
        // SAFETY: a view is only made over memory that holds the chunk's rows (every index
        // checked) and stays put (and unwritten) for the rest of the chunk.
        unsafe {
            let base = match self.index.is_null() {
                true => self.ptr.add(r * self.stride),
                false => match *self.index.add(r) {
                    NO_ROW => self.zeros,
                    i => self.ptr.add(i as usize * self.stride),
                },
            };
            std::slice::from_raw_parts(base.add(self.off), self.width)
        }
    }

    /// All `m` vertices' values as one slice, when they lie back to back (or are shared).
    fn dense<'a>(self, m: usize) -> Option<&'a [f32]> {
        let len = match self.stride {
            _ if !self.index.is_null() => return None,
            0 => self.width,
            s if s == self.width => m * s,
            _ => return None,
        };
        // SAFETY: as in `row`.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(self.off), len) })
    }
}

/// Whether op's result is all zeros given which earlier values are (`zero`): a load bound to
/// zeros, or an op that maps zeros to zeros applied to them (a product with a zero factor).
fn is_zero(op: &Op, block: usize, zero: &[bool], load: Option<Rows>) -> bool {
    let z = |v: &ValueId| zero[v.index()];
    match op {
        _ if load.is_some() => matches!(load, Some(Rows::Zeros)),
        Op::Unary { op, x } if op.keeps_zero() => z(x),
        Op::Binary { op, a, b } => op.zeros().of(z(a), z(b)),
        Op::Slice { x, .. } | Op::SumCols { x } | Op::MaxCols { x } | Op::BroadcastCols { x, .. } => z(x),
        Op::Concat { parts } => parts.iter().all(z),
        _ => block == 0,
    }
}

/// For `x + 0`, `0 + x` and `x − 0` with `x` as wide as the result (`block`): `x`, which the
/// result is.
fn zero_plus(op: &Op, zero: &[bool], k: &Kernel, block: usize) -> Option<ValueId> {
    let x = match *op {
        Op::Binary { op: BinaryOp::Add, a, b } if zero[a.index()] => b,
        Op::Binary { op: BinaryOp::Add | BinaryOp::Sub, a, b } if zero[b.index()] => a,
        _ => return None,
    };
    Some(x).filter(|x| k.nodes[x.index()].shape.numel() == block)
}

#[cfg(test)]
mod tests {
    use crate::cpu::{CpuBackend, HostBuffer};
    use arbor_core::backend::{Backend, Loc, Mem, Rows};
    use arbor_core::fusion::{Kernel, Step};
    use arbor_core::ir::{Builder, Var};

    /// The inference kernel of `y = op(x)` over rows of 4.
    fn kernel(op: impl Fn(Var<'_>) -> Var<'_>) -> Kernel {
        let f = Builder::new("cell", 1);
        let x = f.pull("x", 4);
        f.push("y", op(x));
        let f = f.build().unwrap();
        let steps = &f.inference_plan().phases;
        let Some(Step::Fused(k)) = steps.iter().flatten().find(|s| matches!(s, Step::Fused(_))) else {
            panic!("no fused step")
        };
        k.clone()
    }

    /// The kept facts of a kernel follow its load bindings and its ops: the same kernel called
    /// with zeros and then with values (a stale "zeros" would store zeros), and another kernel
    /// made where a dropped one was (likely the same address) computing its own op.
    #[test]
    fn kept_facts_follow_the_bindings_and_the_kernel() {
        let cpu = CpuBackend::new();
        let mut data = vec![HostBuffer::from((0..16).map(|i| i as f32 / 8.0 - 1.0).collect::<Vec<f32>>())];
        let mut mem = Mem { data: &mut data, index: &[] };
        let (x, y) = (Loc { buf: 0, offset: 0 }, Loc { buf: 0, offset: 8 });
        let tanh = Box::new(kernel(|x| x.tanh()));
        for rows in [Rows::Zeros, Rows::Contiguous(x), Rows::Zeros, Rows::Contiguous(x)] {
            cpu.fused(&mut mem, &tanh, 2, &[rows], &[y]).unwrap();
            let want: Vec<f32> = (0..8).map(|i| if rows == Rows::Zeros { 0.0 } else { mem.data[0][i] }).collect();
            let want: Vec<f32> = want.iter().map(|v| arbor_core::ir::UnaryOp::Tanh.apply(*v)).collect();
            assert_eq!(&mem.data[0][8..16], &want[..], "{rows:?}");
        }
        drop(tanh);
        let sigmoid = Box::new(kernel(|x| x.sigmoid()));
        cpu.fused(&mut mem, &sigmoid, 2, &[Rows::Zeros], &[y]).unwrap();
        assert_eq!(&mem.data[0][8..16], &[0.5; 8], "sigmoid of zeros");
    }
}
