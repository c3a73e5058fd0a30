//! The CPU backend: host buffers, an AVX-512 product kernel (the `gemm` crate where it does not
//! apply), and fused kernels run as tight loops.

mod attention;
mod buffer;
mod direct;
mod dots;
mod elementwise;
mod fused;
pub mod host;
pub mod isa;
mod matmul;
mod memory;
pub mod optim;
mod simd;
mod team;

use arbor_core::backend::{Attention, AttentionGrads, Backend, Gemm, IndexLoc, Loc, Mem, OptimAt, Rows};
use arbor_core::error::{Error, Result};
use arbor_core::fusion::Kernel;
use arbor_core::gate::{self, GATE_LEN, SUM_WORDS};
use arbor_core::optim::Update;
pub use buffer::HostBuffer;
use memory::Raw;
use std::sync::atomic::{AtomicUsize, Ordering};
pub use team::{budget, with_threads};

thread_local! {
    /// Grow-only f64 accumulators for row sums.
    static SUMS: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The CPU backend. Calls large enough to gain from it are split between the cores allowed (by
/// [`CpuBackend::with_threads`], else by the calling thread's budget, [`with_threads`],
/// else every core), on a team of spinning threads. Every call's
/// result is the same, bit for bit, however many threads run it (a call made while another holds
/// the team runs on one), so results never depend on timing. Its kernels use the vector
/// instructions [`isa::active`] names. A call whose writes overlap what it reads is an error:
/// no caller can make it alias memory.
#[derive(Debug, Default)]
pub struct CpuBackend {
    allocations: AtomicUsize,
    transposes: matmul::Transposes,
    /// Threads per call (0: the calling thread's budget).
    threads: usize,
}

impl CpuBackend {
    /// A CPU backend whose calls use the calling thread's budget of threads (every core unless
    /// [`with_threads`] says otherwise).
    pub fn new() -> CpuBackend {
        CpuBackend::default()
    }

    /// A CPU backend whose calls use at most `n` threads (at least 1), wherever they are made.
    pub fn with_threads(n: usize) -> CpuBackend {
        CpuBackend { threads: n.max(1), ..CpuBackend::default() }
    }

    /// The most threads one of its calls may use.
    pub fn threads(&self) -> usize {
        match self.threads {
            0 => team::budget(),
            n => n,
        }
    }

    /// Whether the update at `at` (its gradient `glen` values) goes ahead under its gate: the
    /// gradient multiplied by the gate's factor first where it is not 1.
    fn gated(&self, mem: &mut Mem<'_, Self>, op: &str, at: &OptimAt, glen: usize) -> Result<bool> {
        let Some(loc) = at.gate else { return Ok(true) };
        let g = span(data(mem, op, loc)?, loc.offset, GATE_LEN)?;
        let (factor, applied) = (g[0], gate::applies(g));
        if applied && factor != 1.0 {
            self.scale(mem, at.g, glen, factor)?;
        }
        Ok(applied)
    }

    /// Runs `f` within this backend's thread budget.
    fn within<T>(&self, f: impl FnOnce() -> T) -> T {
        match self.threads {
            0 => f(),
            n => team::with_threads(n, f),
        }
    }
}

pub(crate) fn bad(op: &str, msg: impl Into<String>) -> Error {
    Error::Backend { backend: "cpu", op: op.into(), msg: msg.into() }
}

/// The buffer `at` names, or an error naming `op`.
fn data<'a>(mem: &'a Mem<'_, CpuBackend>, op: &str, at: Loc) -> Result<&'a [f32]> {
    mem.data.get(at.buf).map(|b| &b[..]).ok_or_else(|| bad(op, format!("no buffer {}", at.buf)))
}

/// `len` elements of `buf` at `offset`, or an error naming the read past its end.
fn span(buf: &[f32], offset: usize, len: usize) -> Result<&[f32]> {
    buf.get(offset..offset + len)
        .ok_or_else(|| bad("read", format!("{len} elements at {offset} past a buffer of {}", buf.len())))
}

impl Backend for CpuBackend {
    type Buffer = HostBuffer;
    type Index = Vec<u32>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn replica(&self) -> Result<CpuBackend> {
        Ok(CpuBackend { threads: self.threads, ..CpuBackend::default() })
    }

    fn alloc(&self, len: usize) -> Result<HostBuffer> {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        self.transposes.clear();
        Ok(HostBuffer::zeros(len))
    }

    fn alloc_index(&self, len: usize) -> Result<Vec<u32>> {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        Ok(vec![0; len])
    }

    fn allocations(&self) -> usize {
        self.allocations.load(Ordering::Relaxed)
    }

    fn len(&self, buf: &HostBuffer) -> usize {
        buf.len()
    }

    fn index_len(&self, buf: &Vec<u32>) -> usize {
        buf.len()
    }

    fn write(&self, buf: &mut HostBuffer, offset: usize, src: &[f32]) -> Result<()> {
        let len = buf.len();
        let dst = buf
            .changing()
            .get_mut(offset..offset + src.len())
            .ok_or_else(|| bad("write", format!("{} elements at {offset} past a buffer of {len}", src.len())))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn write_index(&self, buf: &mut Vec<u32>, offset: usize, src: &[u32]) -> Result<()> {
        let len = buf.len();
        let dst = buf
            .get_mut(offset..offset + src.len())
            .ok_or_else(|| bad("write_index", format!("{} indices at {offset} past a buffer of {len}", src.len())))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn read(&self, buf: &HostBuffer, offset: usize, dst: &mut [f32]) -> Result<()> {
        dst.copy_from_slice(span(buf, offset, dst.len())?);
        Ok(())
    }

    fn read_vec(&self, buf: &HostBuffer, offset: usize, len: usize) -> Result<Vec<f32>> {
        Ok(span(buf, offset, len)?.to_vec())
    }

    fn host<'a>(&self, buf: &'a HostBuffer) -> Option<&'a [f32]> {
        Some(buf)
    }

    fn host_mut<'a>(&self, buf: &'a mut HostBuffer) -> Option<&'a mut [f32]> {
        Some(buf.changing())
    }

    fn fill(&self, mem: &mut Mem<'_, Self>, dst: Loc, len: usize, value: f32) -> Result<()> {
        let raw = Raw::new(mem, [dst.buf])?;
        let max = if len >= memory::PARALLEL_ELEMS { usize::MAX } else { 1 };
        self.within(|| {
            team::split(max, |part, parts| {
                let span = team::share(len, part, parts);
                // SAFETY: `Raw::get_mut` checks the range; the parts write disjoint ranges.
                unsafe { raw.get_mut("fill", dst.offset_by(span.start), span.len())? }.fill(value);
                Ok(())
            })
        })
    }

    fn gemm(&self, mem: &mut Mem<'_, Self>, g: &Gemm) -> Result<()> {
        let raw = Raw::new(mem, [g.c.buf])?;
        self.within(|| matmul::gemm_batch(&raw, std::slice::from_ref(g), &self.transposes))
    }

    fn gemm_batch(&self, mem: &mut Mem<'_, Self>, gs: &[Gemm]) -> Result<()> {
        let raw = Raw::new(mem, gs.iter().map(|g| g.c.buf))?;
        self.within(|| matmul::gemm_batch(&raw, gs, &self.transposes))
    }

    fn gemm_sum(&self, mem: &mut Mem<'_, Self>, gs: &[Gemm]) -> Result<()> {
        let raw = Raw::new(mem, gs.iter().map(|g| g.c.buf))?;
        self.within(|| matmul::gemm_sum(&raw, gs, &self.transposes))
    }

    fn fused(&self, mem: &mut Mem<'_, Self>, kernel: &Kernel, n: usize, loads: &[Rows], stores: &[Loc]) -> Result<()> {
        let raw = Raw::new(mem, stores.iter().map(|s| s.buf))?;
        self.within(|| fused::run(&raw, kernel, n, loads, stores))
    }

    fn scatter_add(&self, mem: &mut Mem<'_, Self>, src: Loc, block: usize, n: usize, dst: &Rows) -> Result<()> {
        let written = match *dst {
            Rows::Indexed { data, .. } | Rows::IndexedSet { data, .. } => Some(data.buf),
            _ => None,
        };
        let raw = Raw::new(mem, written)?;
        self.within(|| memory::scatter_add(&raw, src, block, n, dst))
    }

    fn attend(&self, mem: &mut Mem<'_, Self>, a: &Attention, out: Loc) -> Result<()> {
        let raw = Raw::new(mem, [out.buf])?;
        attention::attend(&raw, a, out)
    }

    fn attend_grad(&self, mem: &mut Mem<'_, Self>, a: &Attention, grads: &AttentionGrads) -> Result<()> {
        let raw = Raw::new(mem, [grads.query.buf, grads.keys.buf, grads.values.buf])?;
        attention::attend_grad(&raw, a, grads)
    }

    fn sum_rows(
        &self,
        mem: &mut Mem<'_, Self>,
        src: Loc,
        rows: usize,
        cols: usize,
        dst: Loc,
        accumulate: bool,
    ) -> Result<()> {
        let raw = Raw::new(mem, [dst.buf])?;
        memory::apart("sum_rows", memory::Span::at(dst, cols), memory::Span::at(src, rows * cols))?;
        let max = if rows * cols >= memory::PARALLEL_ELEMS { usize::MAX } else { 1 };
        self.within(|| {
            team::split(max, |part, parts| {
                let span = team::share(cols, part, parts);
                // SAFETY: both ranges are checked, and apart (above); the parts write disjoint
                // columns of `dst`.
                let (s, d) = unsafe {
                    (
                        raw.get("sum_rows", src, rows * cols)?,
                        raw.get_mut("sum_rows", dst.offset_by(span.start), span.len())?,
                    )
                };
                // Accumulate in f64: these sums run over every vertex of a minibatch.
                SUMS.with(|acc| {
                    let acc = &mut *acc.borrow_mut();
                    acc.clear();
                    acc.extend(d.iter().map(|&x| if accumulate { f64::from(x) } else { 0.0 }));
                    host::vectorised(
                        #[inline(always)]
                        || {
                            for row in s.chunks_exact(cols.max(1)) {
                                for (a, &x) in acc.iter_mut().zip(&row[span.clone()]) {
                                    *a += f64::from(x);
                                }
                            }
                        },
                    );
                    for (d, a) in d.iter_mut().zip(acc.iter()) {
                        *d = *a as f32;
                    }
                });
                Ok(())
            })
        })
    }

    fn update(&self, mem: &mut Mem<'_, Self>, u: &Update, at: &OptimAt, len: usize) -> Result<()> {
        if !self.gated(mem, "update", at, len)? {
            return Ok(());
        }
        let raw = Raw::new(mem, [at.p.buf, at.m.buf, at.v.buf])?;
        self.within(|| optim::update(&raw, u, at, len))
    }

    fn update_rows(
        &self,
        mem: &mut Mem<'_, Self>,
        u: &Update,
        at: &OptimAt,
        table: (usize, usize),
        rows: IndexLoc,
        n: usize,
    ) -> Result<()> {
        if !self.gated(mem, "update_rows", at, n * table.0)? {
            return Ok(());
        }
        let raw = Raw::new(mem, [at.p.buf, at.m.buf, at.v.buf])?;
        self.within(|| optim::update_rows(&raw, u, at, table, rows, n))
    }

    fn sum_squares(&self, mem: &mut Mem<'_, Self>, regions: &[(Loc, usize)], to: Loc) -> Result<()> {
        let region =
            |&(at, len): &(Loc, usize)| Ok(optim::sum_squares(span(data(mem, "sum_squares", at)?, at.offset, len)?));
        let sums = regions.iter().map(region).collect::<Result<Vec<f64>>>()?;
        gate::check_even("cpu", "sum_squares", to)?;
        let raw = Raw::new(mem, [to.buf])?;
        // SAFETY: `Raw::get_mut` checks the range; the sums were read before.
        let out = unsafe { raw.get_mut("sum_squares", to, SUM_WORDS * regions.len())? };
        out.fill(0.0);
        for (words, &sum) in out.chunks_exact_mut(SUM_WORDS).zip(&sums) {
            gate::put_f64(words, sum);
        }
        Ok(())
    }

    fn decide(&self, mem: &mut Mem<'_, Self>, sums: Loc, regions: usize, clip: f32, at: Loc) -> Result<()> {
        gate::check_even("cpu", "decide", sums)?;
        let words = span(data(mem, "decide", sums)?, sums.offset, regions * SUM_WORDS)?;
        let decided = gate::decide(words, regions, clip);
        let raw = Raw::new(mem, [at.buf])?;
        // SAFETY: `Raw::get_mut` checks the range; the sums were read before.
        unsafe { raw.get_mut("decide", at, GATE_LEN)? }.copy_from_slice(&decided);
        Ok(())
    }

    fn scale(&self, mem: &mut Mem<'_, Self>, dst: Loc, len: usize, s: f32) -> Result<()> {
        let raw = Raw::new(mem, [dst.buf])?;
        // SAFETY: `Raw::get_mut` checks the range; nothing else is read or written.
        let x = unsafe { raw.get_mut("scale", dst, len)? };
        x.iter_mut().for_each(|x| *x *= s);
        Ok(())
    }

    fn average(&self, mem: &mut Mem<'_, Self>, avg: Loc, x: Loc, len: usize, keep: f32) -> Result<()> {
        let raw = Raw::new(mem, [avg.buf])?;
        self.within(|| optim::average(&raw, avg, x, len, keep))
    }
}
