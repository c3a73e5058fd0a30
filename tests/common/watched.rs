//! The CPU backend, watched: every call goes to a [`CpuBackend`] after telling a test's
//! [`Watch`] what it is — a copy each way (a read of rows counted as the CUDA backend makes it),
//! a compute call, a fused kernel with its bindings. It keeps no host memory the engine may use
//! in place (as a device), so the engine takes the paths it takes on a GPU.

use arbor::backend::{Attention, AttentionGrads, Gemm, IndexLoc, Loc, Mem, OptimAt, Rows};
use arbor::fusion::Kernel;
use arbor::optim::Update;
use arbor::{Backend, CpuBackend, HostBuffer};

/// What a test notes of the calls.
pub trait Watch: Sized {
    /// The watch of a replica (another worker's backend).
    fn replica(&self) -> Self;
    /// A copy to the device (`up`) or back, of `bytes`.
    fn copy(&self, _up: bool, _bytes: usize) {}
    /// A copy of indices (u32) to the device, of `bytes`.
    fn index(&self, bytes: usize) {
        self.copy(true, bytes);
    }
    /// A compute call (a launch on a GPU).
    fn call(&self) {}
    /// A fused kernel and its loads, before it runs.
    fn fused(&self, _kernel: &Kernel, _loads: &[Rows]) {}
    /// The engine starts (`true`) or ends a launch list a device may hold and issue as one
    /// ([`Backend::hold_launches`]).
    fn hold(&self, _on: bool) {}
}

/// The CPU backend under a [`Watch`].
pub struct Watched<W> {
    cpu: CpuBackend,
    /// What watches it.
    pub watch: W,
}

impl<W: Watch> Watched<W> {
    /// The CPU backend watched by `watch`.
    pub fn new(watch: W) -> Watched<W> {
        Watched { cpu: CpuBackend::new(), watch }
    }
}

/// The same memory, as the CPU backend's.
fn cpu<'a, W: Watch>(mem: &'a mut Mem<'_, Watched<W>>) -> Mem<'a, CpuBackend> {
    Mem { data: &mut *mem.data, index: mem.index }
}

impl<W: Watch> Backend for Watched<W> {
    type Buffer = HostBuffer;
    type Index = Vec<u32>;

    fn name(&self) -> &'static str {
        "watched"
    }
    fn replica(&self) -> arbor::Result<Watched<W>> {
        Ok(Watched::new(self.watch.replica()))
    }
    fn alloc(&self, len: usize) -> arbor::Result<HostBuffer> {
        self.cpu.alloc(len)
    }
    fn hold_launches(&self) {
        self.watch.hold(true);
    }
    fn issue_held(&self) -> arbor::Result<()> {
        self.watch.hold(false);
        Ok(())
    }
    fn alloc_index(&self, len: usize) -> arbor::Result<Vec<u32>> {
        self.cpu.alloc_index(len)
    }
    fn allocations(&self) -> usize {
        self.cpu.allocations()
    }
    fn len(&self, buf: &HostBuffer) -> usize {
        buf.len()
    }
    fn index_len(&self, buf: &Vec<u32>) -> usize {
        buf.len()
    }
    fn write(&self, buf: &mut HostBuffer, offset: usize, src: &[f32]) -> arbor::Result<()> {
        self.watch.copy(true, 4 * src.len());
        self.cpu.write(buf, offset, src)
    }
    fn write_index(&self, buf: &mut Vec<u32>, offset: usize, src: &[u32]) -> arbor::Result<()> {
        self.watch.index(4 * src.len());
        self.cpu.write_index(buf, offset, src)
    }
    fn read(&self, buf: &HostBuffer, offset: usize, dst: &mut [f32]) -> arbor::Result<()> {
        self.watch.copy(false, 4 * dst.len());
        self.cpu.read(buf, offset, dst)
    }
    /// As the CUDA backend reads rows: one copy of the span they lie in where they are close
    /// together, else their numbers sent and only they read back.
    fn read_rows(
        &self,
        buf: &HostBuffer,
        offset: usize,
        block: usize,
        rows: &[u32],
        dst: &mut [f32],
    ) -> arbor::Result<()> {
        let (lo, hi) = (rows.iter().min().copied().unwrap_or(0), rows.iter().max().map_or(0, |&r| r + 1));
        if (hi - lo) as usize <= 2 * rows.len() {
            self.watch.copy(false, 4 * block * (hi - lo) as usize);
        } else {
            self.watch.index(4 * rows.len());
            self.watch.copy(false, 4 * block * rows.len());
        }
        self.cpu.read_rows(buf, offset, block, rows, dst)
    }
    fn fill(&self, mem: &mut Mem<'_, Self>, dst: Loc, len: usize, value: f32) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.fill(&mut cpu(mem), dst, len, value)
    }
    fn gemm(&self, mem: &mut Mem<'_, Self>, g: &Gemm) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.gemm(&mut cpu(mem), g)
    }
    fn gemm_sum(&self, mem: &mut Mem<'_, Self>, gs: &[Gemm]) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.gemm_sum(&mut cpu(mem), gs)
    }
    fn fused(
        &self,
        mem: &mut Mem<'_, Self>,
        k: &Kernel,
        n: usize,
        loads: &[Rows],
        stores: &[Loc],
    ) -> arbor::Result<()> {
        self.watch.call();
        self.watch.fused(k, loads);
        self.cpu.fused(&mut cpu(mem), k, n, loads, stores)
    }
    fn attend(&self, mem: &mut Mem<'_, Self>, a: &Attention, out: Loc) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.attend(&mut cpu(mem), a, out)
    }
    fn attend_grad(&self, mem: &mut Mem<'_, Self>, a: &Attention, grads: &AttentionGrads) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.attend_grad(&mut cpu(mem), a, grads)
    }
    fn scatter_add(&self, mem: &mut Mem<'_, Self>, src: Loc, block: usize, n: usize, dst: &Rows) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.scatter_add(&mut cpu(mem), src, block, n, dst)
    }
    fn scatter_add_many(
        &self,
        mem: &mut Mem<'_, Self>,
        block: usize,
        n: usize,
        parts: &[(Loc, Rows)],
    ) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.scatter_add_many(&mut cpu(mem), block, n, parts)
    }
    fn sum_rows(
        &self,
        mem: &mut Mem<'_, Self>,
        src: Loc,
        rows: usize,
        cols: usize,
        dst: Loc,
        accumulate: bool,
    ) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.sum_rows(&mut cpu(mem), src, rows, cols, dst, accumulate)
    }
    fn update(&self, mem: &mut Mem<'_, Self>, u: &Update, at: &OptimAt, len: usize) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.update(&mut cpu(mem), u, at, len)
    }
    fn update_rows(
        &self,
        mem: &mut Mem<'_, Self>,
        u: &Update,
        at: &OptimAt,
        table: (usize, usize),
        rows: IndexLoc,
        n: usize,
    ) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.update_rows(&mut cpu(mem), u, at, table, rows, n)
    }
    /// A launch that zeroes the partial sums, then a launch per region; nothing read.
    fn sum_squares(&self, mem: &mut Mem<'_, Self>, regions: &[(Loc, usize)], to: Loc) -> arbor::Result<()> {
        self.watch.call();
        regions.iter().for_each(|_| self.watch.call());
        self.cpu.sum_squares(&mut cpu(mem), regions, to)
    }
    fn decide(&self, mem: &mut Mem<'_, Self>, sums: Loc, regions: usize, clip: f32, gate: Loc) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.decide(&mut cpu(mem), sums, regions, clip, gate)
    }
    fn scale(&self, mem: &mut Mem<'_, Self>, dst: Loc, len: usize, s: f32) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.scale(&mut cpu(mem), dst, len, s)
    }
    fn average(&self, mem: &mut Mem<'_, Self>, avg: Loc, x: Loc, len: usize, keep: f32) -> arbor::Result<()> {
        self.watch.call();
        self.cpu.average(&mut cpu(mem), avg, x, len, keep)
    }
}
