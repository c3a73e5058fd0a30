//! The optimizer's calls on the device: updates of dense tensors and of table rows (the kernels
//! of [`crate::optim`]) and sums of squares of gradients.

use super::{fail, Arg, CudaBackend};
use arbor_core::backend::{IndexLoc, Loc, Mem, OptimAt};
use arbor_core::error::Result;
use arbor_core::optim::Update;
use cudarc::driver::DevicePtr;

/// The partial sums a sum of squares spreads its threads' atomic adds over (a region's sums are
/// read back together, 512 bytes, and added on the host).
const SUM_SLOTS: usize = 64;

impl CudaBackend {
    /// [`Backend::update`](arbor_core::backend::Backend::update): one launch of `arbor_update`.
    pub(super) fn update_on_device(&self, mem: &Mem<'_, Self>, u: &Update, at: &OptimAt, len: usize) -> Result<()> {
        let mut args = vec![Arg::I64(len as i64)];
        for loc in [at.p, at.g, at.m, at.v] {
            args.push(Arg::Ptr(self.data(mem, "update", loc, len)?));
        }
        args.extend(coefficients(u));
        self.launch("update", &self.helpers["arbor_update"], len, &args)
    }

    /// [`Backend::update_rows`](arbor_core::backend::Backend::update_rows): one launch of
    /// `arbor_update_rows` over the rows given.
    pub(super) fn update_rows_on_device(
        &self,
        mem: &Mem<'_, Self>,
        u: &Update,
        at: &OptimAt,
        (dim, vocab): (usize, usize),
        rows: IndexLoc,
        n: usize,
    ) -> Result<()> {
        let op = "update_rows";
        let table = dim * vocab;
        let mut args = vec![Arg::I64(n as i64), Arg::I64(dim as i64), Arg::Ptr(self.index(mem, op, rows, n)?)];
        args.push(Arg::I64(vocab as i64));
        args.push(Arg::Ptr(self.data(mem, op, at.p, table)?));
        args.push(Arg::Ptr(self.data(mem, op, at.g, n * dim)?));
        args.push(Arg::Ptr(self.data(mem, op, at.m, table)?));
        args.push(Arg::Ptr(self.data(mem, op, at.v, table)?));
        args.extend(coefficients(u));
        self.launch(op, &self.helpers["arbor_update_rows"], n * dim, &args)
    }

    /// [`Backend::sum_squares`](arbor_core::backend::Backend::sum_squares): a launch per region
    /// into [`SUM_SLOTS`] partial sums each, one read of them all, added on the host.
    pub(super) fn sum_squares_on_device(&self, mem: &Mem<'_, Self>, regions: &[(Loc, usize)]) -> Result<Vec<f64>> {
        let op = "sum_squares";
        let slots = SUM_SLOTS;
        let len = regions.len().max(1) * slots;
        let mut kept = self.sums.borrow_mut();
        let mut sums = match kept.take() {
            Some(s) if s.len() >= len => s,
            _ => self.stream.alloc_zeros(len).map_err(|e| fail(op, e))?,
        };
        let mut view = sums.slice_mut(0..len);
        self.stream.memset_zeros(&mut view).map_err(|e| fail(op, e))?;
        let base = sums.device_ptr(&self.stream).0;
        for (k, &(at, len)) in regions.iter().enumerate() {
            let threads = crate::optim::sum_threads(len);
            let x = self.data(mem, op, at, len)?;
            let sum = Arg::Ptr(base + (8 * k * slots) as u64);
            let args = [Arg::I64(threads as i64), Arg::Ptr(x), Arg::I64(len as i64), sum, Arg::I64(slots as i64)];
            self.launch(op, &self.helpers["arbor_sum_squares"], threads, &args)?;
        }
        let mut out = vec![0.0f64; len];
        self.stream.memcpy_dtoh(&sums.slice(0..len), &mut out).map_err(|e| fail(op, e))?;
        self.synchronize()?;
        *kept = Some(sums);
        Ok(out.chunks(slots).take(regions.len()).map(|s| s.iter().sum()).collect())
    }
}

/// The rule and coefficients of `u`, as the optimizer kernels take them after their pointers.
fn coefficients(u: &Update) -> [Arg; 9] {
    let c = u.config;
    [
        Arg::I32(u.rule_code()),
        Arg::F32(c.lr),
        Arg::F32(c.weight_decay),
        Arg::F32(u.momentum()),
        Arg::F32(c.beta1),
        Arg::F32(c.beta2),
        Arg::F32(c.eps),
        Arg::F32(u.bc1),
        Arg::F32(u.bc2),
    ]
}
