//! Runs a fused kernel: the vertices are cut into chunks small enough that every intermediate
//! of a chunk stays in cache, and each op runs as one loop over the chunk. Contiguous inputs are
//! read where they lie and stored results are computed where they go; only intermediates and
//! gathered rows use scratch. Large calls split their vertices between two threads.

use super::memory::{load, Raw};
use super::{bad, elementwise, team};
use arbor_core::backend::{Loc, Rows};
use arbor_core::error::Result;
use arbor_core::fusion::Kernel;
use arbor_core::ir::Op;
use std::cell::RefCell;

/// Scratch elements a chunk may use across all of its intermediates.
const CHUNK_ELEMS: usize = 1 << 15;

/// Per-call scratch, kept per thread and only ever grown.
#[derive(Default)]
struct Scratch {
    /// Intermediates.
    regs: Vec<f32>,
    /// Offset of each op's scratch in `regs`.
    offs: Vec<usize>,
    /// Where each op's values for the current chunk are.
    at: Vec<*const f32>,
    /// The store (if any) of each op.
    store_of: Vec<Option<Loc>>,
    /// The binding of each load op.
    load_of: Vec<Option<Rows>>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Calls over at least this many elements (all ops, all vertices) and vertices run on two
/// threads, each over half of the vertices. Smaller calls (most calls at batch size 1) lose more
/// to waking the other thread than they gain (`arbor bench --batch 1|64`).
const PARALLEL_ELEMS: usize = 1 << 16;
const PARALLEL_VERTICES: usize = 64;

pub(crate) fn run(raw: &Raw<'_>, k: &Kernel, n: usize, loads: &[Rows], stores: &[Loc]) -> Result<()> {
    if let Some(msg) = k.binding_mismatch(loads.len(), stores.len()) {
        return Err(bad("fused", msg));
    }
    let per_vertex: usize = k.nodes.iter().filter(|x| !x.is_param).map(|x| x.shape.numel()).sum();
    let max = if n >= PARALLEL_VERTICES && n * per_vertex >= PARALLEL_ELEMS { usize::MAX } else { 1 };
    team::split(max, |part, parts| run_vertices(raw, k, team::share(n, part, parts), per_vertex, loads, stores))
}

/// Runs the kernel over the vertices `vertices`, in chunks, with this thread's scratch.
fn run_vertices(
    raw: &Raw<'_>,
    k: &Kernel,
    vertices: std::ops::Range<usize>,
    per_vertex: usize,
    loads: &[Rows],
    stores: &[Loc],
) -> Result<()> {
    let chunk = (CHUNK_ELEMS / per_vertex.max(1)).clamp(1, vertices.len().max(1));
    SCRATCH.with(|s| {
        let s = &mut *s.borrow_mut();
        s.offs.clear();
        let mut total = 0;
        for x in &k.nodes {
            s.offs.push(total);
            total += if x.is_param { x.shape.numel() } else { chunk * x.shape.numel() };
        }
        if s.regs.len() < total {
            s.regs.resize(total, 0.0);
        }
        s.at.clear();
        s.at.resize(k.nodes.len(), std::ptr::null());
        s.store_of.clear();
        s.store_of.resize(k.nodes.len(), None);
        for (&l, &at) in k.stores.iter().zip(stores) {
            s.store_of[l] = Some(at);
        }
        s.load_of.clear();
        s.load_of.resize(k.nodes.len(), None);
        for (l, &rows) in k.loads().zip(loads) {
            s.load_of[l] = Some(rows);
        }
        let mut start = vertices.start;
        while start < vertices.end {
            let m = chunk.min(vertices.end - start);
            run_chunk(raw, k, start, m, s)?;
            start += m;
        }
        Ok(())
    })
}

fn run_chunk(raw: &Raw<'_>, k: &Kernel, start: usize, m: usize, s: &mut Scratch) -> Result<()> {
    for (l, node) in k.nodes.iter().enumerate() {
        let block = node.shape.numel();
        let len = if node.is_param { block } else { m * block };
        // An input in place: read it where it lies.
        match s.load_of[l] {
            Some(Rows::Contiguous(at)) if s.store_of[l].is_none() => {
                // SAFETY: loads are never written by the call that reads them.
                s.at[l] = unsafe { raw.get("fused load", at.offset_by(start * block), len)? }.as_ptr();
                continue;
            }
            Some(Rows::Broadcast(at)) => {
                s.at[l] = unsafe { raw.get("fused load", at, len)? }.as_ptr();
                continue;
            }
            _ => {}
        }
        // Everything else is computed into its store or into scratch.
        // SAFETY: a store's region is not read by this kernel (the memory plan keeps the regions
        // a kernel writes apart from those it reads), and each scratch register is this op's own.
        let out: &mut [f32] = match s.store_of[l] {
            Some(at) => unsafe { raw.get_mut("fused store", at.offset_by(start * block), len)? },
            None => unsafe { std::slice::from_raw_parts_mut(s.regs.as_mut_ptr().add(s.offs[l]), len) },
        };
        s.at[l] = out.as_ptr();
        // Inputs are earlier ops; their values stay put for the whole chunk.
        let reg = |v: arbor_core::ir::ValueId| -> &[f32] {
            let x = &k.nodes[v.index()];
            let len = if x.is_param { x.shape.numel() } else { m * x.shape.numel() };
            // SAFETY: `at` of an earlier op points at `len` values written (or loaded) above.
            unsafe { std::slice::from_raw_parts(s.at[v.index()], len) }
        };
        let rows = m * node.shape.rows();
        match &node.op {
            op if op.is_load() => {
                let binding = s.load_of[l].ok_or_else(|| bad("fused", format!("load {l} has no binding")))?;
                load(raw, &binding, start, m, block, out)?;
            }
            Op::Unary { op, x } => elementwise::unary(*op, reg(*x), out),
            Op::Binary { op, a, b } => elementwise::binary(*op, reg(*a), reg(*b), out),
            Op::Slice { x, start: c0, len } => {
                let w = k.nodes[x.index()].shape.cols();
                for (o, i) in out.chunks_exact_mut(*len).zip(reg(*x).chunks_exact(w)) {
                    o.copy_from_slice(&i[*c0..c0 + len]);
                }
            }
            Op::Concat { parts } => {
                let mut col = 0;
                let c = node.shape.cols();
                for p in parts {
                    let w = k.nodes[p.index()].shape.cols();
                    for (r, i) in reg(*p).chunks_exact(w).enumerate().take(rows) {
                        out[r * c + col..r * c + col + w].copy_from_slice(i);
                    }
                    col += w;
                }
            }
            Op::SumCols { x } => {
                let w = k.nodes[x.index()].shape.cols();
                for (o, i) in out.iter_mut().zip(reg(*x).chunks_exact(w)) {
                    *o = i.iter().sum();
                }
            }
            Op::BroadcastCols { x, cols } => {
                for (o, &i) in out.chunks_exact_mut(*cols).zip(reg(*x)) {
                    o.fill(i);
                }
            }
            op => return Err(bad("fused", format!("op {} cannot run in a fused kernel", op.name()))),
        }
    }
    Ok(())
}
