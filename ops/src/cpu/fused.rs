//! Runs a fused kernel: the vertices are cut into chunks small enough that every intermediate
//! of a chunk stays in cache, and each op runs as one loop over the chunk.

use super::memory::{load, Raw};
use super::{bad, elementwise};
use arbor_core::backend::{Loc, Rows};
use arbor_core::error::Result;
use arbor_core::fusion::Kernel;
use arbor_core::ir::Op;
use std::cell::RefCell;

/// Scratch elements a chunk may use across all of its intermediates.
const CHUNK_ELEMS: usize = 1 << 15;

thread_local! {
    /// Grow-only scratch: intermediates, then their offsets.
    static SCRATCH: RefCell<(Vec<f32>, Vec<usize>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

pub(crate) fn run(raw: &Raw<'_>, k: &Kernel, n: usize, loads: &[Rows], stores: &[Loc]) -> Result<()> {
    let load_ops: Vec<usize> = k.loads().collect();
    if load_ops.len() != loads.len() || k.stores.len() != stores.len() {
        return Err(bad(
            "fused",
            format!(
                "kernel has {} loads and {} stores, got {} and {}",
                load_ops.len(),
                k.stores.len(),
                loads.len(),
                stores.len()
            ),
        ));
    }
    let per_vertex: usize = k.nodes.iter().filter(|x| !x.is_param).map(|x| x.shape.numel()).sum();
    let chunk = (CHUNK_ELEMS / per_vertex.max(1)).clamp(1, n.max(1));
    SCRATCH.with(|s| {
        let (regs, offs) = &mut *s.borrow_mut();
        offs.clear();
        let mut total = 0;
        for x in &k.nodes {
            offs.push(total);
            total += if x.is_param { x.shape.numel() } else { chunk * x.shape.numel() };
        }
        offs.push(total);
        if regs.len() < total {
            regs.resize(total, 0.0);
        }
        let mut start = 0;
        while start < n {
            let m = chunk.min(n - start);
            run_chunk(raw, k, loads, stores, start, m, regs, offs)?;
            start += m;
        }
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
fn run_chunk(
    raw: &Raw<'_>,
    k: &Kernel,
    loads: &[Rows],
    stores: &[Loc],
    start: usize,
    m: usize,
    regs: &mut [f32],
    offs: &[usize],
) -> Result<()> {
    let mut next_load = 0;
    for (l, node) in k.nodes.iter().enumerate() {
        let block = node.shape.numel();
        let len = if node.is_param { block } else { m * block };
        // Inputs are earlier ops, so they lie below this op's register.
        let (below, here) = regs.split_at_mut(offs[l]);
        let out = &mut here[..len];
        let reg = |v: arbor_core::ir::ValueId| {
            let i = v.index();
            let n = &k.nodes[i];
            &below[offs[i]..offs[i] + if n.is_param { n.shape.numel() } else { m * n.shape.numel() }]
        };
        let rows = m * node.shape.rows();
        match &node.op {
            op if op.is_load() => {
                load(raw, &loads[next_load], start, m, block, out)?;
                next_load += 1;
            }
            Op::Unary { op, x } => elementwise::unary(*op, reg(*x), out),
            Op::Binary { op, a, b } => elementwise::binary(*op, reg(*a), reg(*b), out),
            Op::Slice { x, start: s, len } => {
                let w = k.nodes[x.index()].shape.cols();
                for (o, i) in out.chunks_exact_mut(*len).zip(reg(*x).chunks_exact(w)) {
                    o.copy_from_slice(&i[*s..s + len]);
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
    for (&l, &at) in k.stores.iter().zip(stores) {
        let block = k.nodes[l].shape.numel();
        // SAFETY: a kernel's stores go to regions no load of the same call reads.
        let dst = unsafe { raw.get_mut("fused store", at.offset_by(start * block), m * block)? };
        dst.copy_from_slice(&regs[offs[l]..offs[l] + m * block]);
    }
    Ok(())
}
