//! The lowered form of a pass: a plain list of launches (matrix products, fused kernels, row
//! copies, fills, scatter-adds, row sums) addressed in the engine's buffers. The list prints,
//! can be checked without a backend, and runs on any backend through [`execute`].

use super::analysis::StepRef;
use super::dedup;
use arbor_core::backend::{Attention, AttentionGrads, Backend, Combine, Gemm, IndexLoc, Loc, Mem, Rows, SCATTERS};
use arbor_core::error::Result;
use arbor_core::fusion::Kernel;
use arbor_core::profile::{self, Activity};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// The engine's buffer that holds every value of a minibatch (see [`MemoryPlan`](arbor_batching::MemoryPlan)).
pub const ARENA: usize = 0;
/// The engine's buffer that holds the parameters.
pub const PARAMS: usize = 1;
/// The engine's buffer that holds the parameters' gradients.
pub const GRADS: usize = 2;
/// The engine's buffer of values staged for one pass outside the arena (the pushed outputs'
/// gradients given for chosen rows, before they are scattered to those rows).
pub const STAGED: usize = 9;
/// The engine's index buffer of the rows [`STAGED`] values go to.
pub const STAGED_ROWS: usize = 2;

/// One operation on the engine's buffers.
#[derive(Clone, Debug)]
pub enum Launch {
    /// Sets `len` elements at `dst` to zero.
    Fill {
        /// Where.
        dst: Loc,
        /// How many elements.
        len: usize,
    },
    /// One matrix product.
    Gemm(Gemm),
    /// Independent matrix products: none writes what another reads or writes.
    Gemms(Vec<Gemm>),
    /// Matrix products summed into one output in order (see [`Backend::gemm_sum`]).
    GemmSum(Vec<Gemm>),
    /// A fused kernel over `n` vertices (see [`Backend::fused`]).
    Fused {
        /// The step of the vertex function's plan it runs.
        step: StepRef,
        /// The kernel: the step's, or the step's with the stores nothing reads left out.
        kernel: Arc<Kernel>,
        /// Vertices.
        n: usize,
        /// One binding per load of the kernel.
        loads: Vec<Rows>,
        /// One place per store of the kernel.
        stores: Vec<Loc>,
    },
    /// Copies `rows` rows of `block` values from `from` (one per row) to `to` onwards.
    Copy {
        /// The rows to read.
        from: Rows,
        /// Where the first row goes.
        to: Loc,
        /// How many rows.
        rows: usize,
        /// Values per row.
        block: usize,
    },
    /// Adds `n` blocks from `src` on into the rows `dst` names (see [`Backend::scatter_add`]).
    ScatterAdd {
        /// The blocks, back to back.
        src: Loc,
        /// Values per block.
        block: usize,
        /// How many blocks.
        n: usize,
        /// Where each is added.
        dst: Rows,
    },
    /// Several scatter-adds of `n` blocks of `block` values, each from its `src` into the
    /// `Indexed` rows of its `dst`, in one call (see [`Backend::scatter_add_many`]).
    ScatterAdds {
        /// Values per block.
        block: usize,
        /// How many blocks each.
        n: usize,
        /// Each scatter's blocks and where they are added (at most `SCATTERS`).
        parts: Vec<(Loc, Rows)>,
    },
    /// Attention over the children of `attention.n` vertices, its outputs written at `out` (see
    /// [`Backend::attend`]).
    Attend {
        /// Where the queries and the children's rows are.
        attention: Attention,
        /// Where the outputs go.
        out: Loc,
    },
    /// The gradients of an [`Launch::Attend`] (see [`Backend::attend_grad`]).
    AttendGrad {
        /// The forward call's operands.
        attention: Attention,
        /// Where the outputs' gradients are and the others go.
        grads: AttentionGrads,
    },
    /// Adds the sum of `rows` rows of `cols` values at `src` to the `cols` values at `dst` (or
    /// writes it there, unless `accumulate`).
    SumRows {
        /// The rows.
        src: Loc,
        /// How many rows.
        rows: usize,
        /// Values per row.
        cols: usize,
        /// The sum goes here.
        dst: Loc,
        /// Whether the sum is added to what `dst` holds.
        accumulate: bool,
    },
}

/// How many launches of each kind a list holds (products counted one by one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Matrix products.
    pub products: usize,
    /// Fused kernels.
    pub fused: usize,
    /// Row copies.
    pub copies: usize,
    /// Zero fills.
    pub fills: usize,
    /// Scatter-adds.
    pub scatters: usize,
    /// Row sums.
    pub row_sums: usize,
    /// Attention calls, forward and backward.
    pub attention: usize,
}

impl Counts {
    /// The counts of `launches`.
    pub fn of(launches: &[Launch]) -> Counts {
        let mut c = Counts::default();
        for l in launches {
            match l {
                Launch::Fill { .. } => c.fills += 1,
                Launch::Gemm(_) => c.products += 1,
                Launch::Gemms(gs) | Launch::GemmSum(gs) => c.products += gs.len(),
                Launch::Fused { .. } => c.fused += 1,
                Launch::Copy { .. } => c.copies += 1,
                Launch::ScatterAdd { .. } | Launch::ScatterAdds { .. } => c.scatters += 1,
                Launch::SumRows { .. } => c.row_sums += 1,
                Launch::Attend { .. } | Launch::AttendGrad { .. } => c.attention += 1,
            }
        }
        c
    }

    /// Backend calls in all: one per product, fused kernel, copy, fill, scatter-add, row sum and
    /// attention (a device launches a kernel, or a library call, for each).
    pub fn total(&self) -> usize {
        self.products + self.fused + self.copies + self.fills + self.scatters + self.row_sums + self.attention
    }
}

impl Launch {
    /// Backend calls: one per product of a wave, else one (a chain of summed products is one
    /// call; the sum over a list is [`Counts::total`] less those chains' other products).
    pub fn calls(&self) -> usize {
        match self {
            Launch::Gemms(gs) => gs.len(),
            _ => 1,
        }
    }

    /// Floating-point operations: `2·m·n·k` per matrix product, one per element per fused op
    /// (copies, fills, sums and attention, whose work depends on the children, count none).
    pub fn flops(&self) -> u64 {
        match self {
            Launch::Gemm(g) => gemm_flops(g),
            Launch::Gemms(gs) | Launch::GemmSum(gs) => gs.iter().map(gemm_flops).sum(),
            Launch::Fused { kernel, n, .. } => {
                (n * kernel.nodes.iter().filter(|x| !x.op.is_load()).map(|x| x.shape.numel()).sum::<usize>()) as u64
            }
            _ => 0,
        }
    }
}

fn gemm_flops(g: &Gemm) -> u64 {
    2 * (g.m * g.n * g.k * g.batch) as u64
}

/// Host data a pass writes before its launches: rows of the arena, and the whole index buffer.
#[derive(Default)]
pub struct Uploads {
    /// The values, back to back.
    pub data: Vec<f32>,
    /// Per write, the arena offset it goes to and its range in `data`.
    pub writes: Vec<(usize, Range<usize>)>,
    /// The index buffer's contents (empty: unchanged).
    pub index: Vec<u32>,
    /// Values for the [`STAGED`] buffer, and the rows they go to ([`STAGED_ROWS`]).
    pub staged: Vec<f32>,
    /// See [`Uploads::staged`]; the rows linked gradients are copied from follow.
    pub staged_rows: Vec<u32>,
    /// Values of [`STAGED`] in use, the host's and the linked rows copied there after them.
    pub staged_len: usize,
}

impl Uploads {
    /// Forgets every write.
    pub(super) fn clear(&mut self) {
        self.data.clear();
        self.writes.clear();
        self.index.clear();
        self.staged.clear();
        self.staged_rows.clear();
        self.staged_len = 0;
    }

    /// Values the [`STAGED`] buffer must hold: the host's, then room for linked rows.
    pub fn staged_room(&self) -> usize {
        self.staged.len().max(self.staged_len)
    }

    /// Adds a write to the arena at `at` whose values `fill` appends to the vector it is given.
    pub(super) fn write_with(&mut self, at: usize, fill: impl FnOnce(&mut Vec<f32>)) {
        let start = self.data.len();
        fill(&mut self.data);
        self.writes.push((at, start..self.data.len()));
    }
}

/// Runs `launches` in order on `backend` over `mem`; returns the flops they executed and the
/// backend calls they made.
pub(super) fn execute<B: Backend>(backend: &B, mem: &mut Mem<'_, B>, launches: &[Launch]) -> Result<(u64, u64)> {
    backend.hold_launches();
    let done = execute_held(backend, mem, launches);
    let issued = profile::time(Activity::Issue, || backend.issue_held());
    let done = done?;
    issued.map(|()| done)
}

/// [`execute`]'s launches, which the backend may hold until its end.
fn execute_held<B: Backend>(backend: &B, mem: &mut Mem<'_, B>, launches: &[Launch]) -> Result<(u64, u64)> {
    let (mut flops, mut calls) = (0, 0);
    let mut rest = launches;
    while let Some(l) = rest.first() {
        // Zero fills in a row go out together, up to four at a time (zeroing commutes).
        let fills = rest.iter().take(SCATTERS).take_while(|l| matches!(l, Launch::Fill { .. })).count();
        let (now, later) = rest.split_at(fills.max(1));
        flops += now.iter().map(Launch::flops).sum::<u64>();
        calls += now.iter().map(|l| l.calls() as u64).sum::<u64>();
        let activity = match l {
            Launch::Gemm(_) | Launch::Gemms(_) | Launch::GemmSum(_) => Activity::Products,
            Launch::Fused { .. } | Launch::Copy { .. } => Activity::Fused,
            Launch::Fill { .. } => Activity::Fill,
            Launch::ScatterAdd { .. } | Launch::ScatterAdds { .. } => Activity::Scatter,
            Launch::SumRows { .. } => Activity::RowSums,
            Launch::Attend { .. } | Launch::AttendGrad { .. } => Activity::Attention,
        };
        profile::time(activity, || run(backend, mem, now))?;
        rest = later;
    }
    Ok((flops, calls))
}

/// Runs `now`: one launch, or zero fills in a row as one call.
fn run<B: Backend>(backend: &B, mem: &mut Mem<'_, B>, now: &[Launch]) -> Result<()> {
    let Some(l) = now.first() else { return Ok(()) };
    match l {
        Launch::Fill { .. } => {
            let zeros: Vec<(Loc, usize)> = now
                .iter()
                .filter_map(|l| match *l {
                    Launch::Fill { dst, len } => Some((dst, len)),
                    _ => None,
                })
                .collect();
            backend.zero_many(mem, &zeros)?
        }
        Launch::Gemm(g) => backend.gemm(mem, g)?,
        Launch::Gemms(gs) => backend.gemm_batch(mem, gs)?,
        Launch::GemmSum(gs) => backend.gemm_sum(mem, gs)?,
        Launch::Fused { kernel, n, loads, stores, .. } => backend.fused(mem, kernel, *n, loads, stores)?,
        Launch::Copy { from, to, rows, block } => {
            backend.fused(mem, &dedup::copy_kernel(*block), *rows, std::slice::from_ref(from), &[*to])?
        }
        Launch::ScatterAdd { src, block, n, dst } => backend.scatter_add(mem, *src, *block, *n, dst)?,
        Launch::ScatterAdds { block, n, parts } => backend.scatter_add_many(mem, *block, *n, parts)?,
        Launch::SumRows { src, rows, cols, dst, accumulate } => {
            backend.sum_rows(mem, *src, *rows, *cols, *dst, *accumulate)?
        }
        Launch::Attend { attention, out } => backend.attend(mem, attention, *out)?,
        Launch::AttendGrad { attention, grads } => backend.attend_grad(mem, attention, grads)?,
    }
    Ok(())
}

/// `buf:offset`, with the engine's buffers named.
struct At(Loc);

impl fmt::Display for At {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.buf {
            ARENA => write!(f, "arena+{}", self.0.offset),
            PARAMS => write!(f, "params+{}", self.0.offset),
            GRADS => write!(f, "grads+{}", self.0.offset),
            b => write!(f, "buf{b}+{}", self.0.offset),
        }
    }
}

/// Where rows are read or written, briefly.
struct RowsAt<'a>(&'a Rows);

impl fmt::Display for RowsAt<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ix = |i: &IndexLoc| format!("index+{}", i.offset);
        match self.0 {
            Rows::Contiguous(l) => write!(f, "{}", At(*l)),
            Rows::Broadcast(l) => write!(f, "{} (each)", At(*l)),
            Rows::Indexed { data, index } => write!(f, "{}[{}]", At(*data), ix(index)),
            Rows::IndexedSet { data, offsets, combine, .. } => match combine {
                Combine::Sum => write!(f, "{}[set {}]", At(*data), ix(offsets)),
                Combine::Mean => write!(f, "{}[mean of set {}]", At(*data), ix(offsets)),
                Combine::Max { by } => write!(f, "{}[max by {} of set {}]", At(*data), At(*by), ix(offsets)),
                Combine::Weighted { weights, .. } => {
                    write!(f, "{}[set {} weighted by {}]", At(*data), ix(offsets), At(*weights))
                }
            },
            Rows::Zeros => write!(f, "zeros"),
        }
    }
}

fn gemm(f: &mut fmt::Formatter<'_>, g: &Gemm) -> fmt::Result {
    let t = |x: bool| if x { "ᵀ" } else { "" };
    let batch = if g.batch > 1 { format!(" ×{}", g.batch) } else { String::new() };
    let op = if g.accumulate { "+=" } else { "=" };
    write!(f, "{} {op} {}{} · {}{} ({}×{}×{}{batch})", At(g.c), At(g.a), t(g.ta), At(g.b), t(g.tb), g.m, g.n, g.k)
}

impl fmt::Display for Launch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Launch::Fill { dst, len } => write!(f, "fill    {} ×{len}", At(*dst)),
            Launch::Gemm(g) => {
                write!(f, "product ")?;
                gemm(f, g)
            }
            Launch::Gemms(gs) | Launch::GemmSum(gs) => {
                let what = if matches!(self, Launch::GemmSum(_)) { "summed" } else { "products" };
                write!(f, "{what} {}:", gs.len())?;
                for g in gs {
                    write!(f, "\n          ")?;
                    gemm(f, g)?;
                }
                Ok(())
            }
            Launch::Fused { step, kernel, n, loads, stores } => {
                write!(
                    f,
                    "fused   {} {:?} step {} over {n} rows, {} ops: ",
                    step.plan.name(),
                    step.phase,
                    step.step,
                    kernel.nodes.len()
                )?;
                let loads: Vec<String> = loads.iter().map(|r| RowsAt(r).to_string()).collect();
                let stores: Vec<String> = stores.iter().map(|l| At(*l).to_string()).collect();
                write!(f, "{} → {}", loads.join(", "), stores.join(", "))
            }
            Launch::Copy { from, to, rows, block } => {
                write!(f, "copy    {} → {} ({rows} rows of {block})", RowsAt(from), At(*to))
            }
            Launch::ScatterAdd { src, block, n, dst } => {
                write!(f, "scatter {} → {} += ({n} rows of {block})", At(*src), RowsAt(dst))
            }
            Launch::ScatterAdds { block, n, parts } => {
                write!(f, "scatters {}:", parts.len())?;
                for (src, dst) in parts {
                    write!(f, "\n          {} → {} += ({n} rows of {block})", At(*src), RowsAt(dst))?;
                }
                Ok(())
            }
            Launch::SumRows { src, rows, cols, dst, accumulate } => {
                let op = if *accumulate { "+=" } else { "=" };
                write!(f, "sum     {} {op} Σ rows of {} ({rows} rows of {cols})", At(*dst), At(*src))
            }
            Launch::Attend { attention: a, out } => write!(
                f,
                "attend  {} ← softmax({} · {}[set {}]) {} over {} rows",
                At(*out),
                At(a.query),
                At(a.keys),
                a.offsets.offset,
                At(a.values),
                a.n
            ),
            Launch::AttendGrad { attention: a, grads: g } => write!(
                f,
                "attend′ {} ← {}; {}, {}[set {}] += over {} rows",
                At(g.query),
                At(g.out),
                At(g.keys),
                At(g.values),
                a.offsets.offset,
                a.n
            ),
        }
    }
}
