//! The optimizer's calls on the device: updates of dense tensors and of table rows (the kernels
//! of [`crate::optim`]) under the step's gate, sums of squares of gradients and the gate decided
//! from them, all left on the device.

use super::{Arg, CudaBackend};
use arbor_core::backend::{Backend, IndexLoc, Loc, Mem, OptimAt};
use arbor_core::error::Result;
use arbor_core::gate::{self, GATE_LEN, SUM_SLOTS, SUM_WORDS};
use arbor_core::optim::Update;

impl CudaBackend {
    /// [`Backend::update`](arbor_core::backend::Backend::update): one launch of `arbor_update`.
    pub(super) fn update_on_device(&self, mem: &Mem<'_, Self>, u: &Update, at: &OptimAt, len: usize) -> Result<()> {
        let mut args = vec![Arg::I64(len as i64)];
        for loc in [at.p, at.g, at.m, at.v] {
            args.push(Arg::Ptr(self.data(mem, "update", loc, len)?));
        }
        args.push(self.gate(mem, "update", at)?);
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
        args.push(self.gate(mem, op, at)?);
        args.extend(coefficients(u));
        self.launch(op, &self.helpers["arbor_update_rows"], n * dim, &args)
    }

    /// The address of the gate of an update (0: none).
    fn gate(&self, mem: &Mem<'_, Self>, op: &str, at: &OptimAt) -> Result<Arg> {
        Ok(Arg::Ptr(match at.gate {
            Some(loc) => self.data(mem, op, loc, GATE_LEN)?,
            None => 0,
        }))
    }

    /// [`Backend::sum_squares`](arbor_core::backend::Backend::sum_squares): the partial sums
    /// zeroed (one launch), then a launch per region adding into its [`SUM_SLOTS`] f64 slots.
    pub(super) fn sum_squares_on_device(
        &self,
        mem: &mut Mem<'_, Self>,
        regions: &[(Loc, usize)],
        to: Loc,
    ) -> Result<()> {
        let op = "sum_squares";
        gate::check_even("cuda", op, to)?;
        self.zero_many(mem, &[(to, SUM_WORDS * regions.len())])?;
        let base = self.data(mem, op, to, SUM_WORDS * regions.len())?;
        for (k, &(at, len)) in regions.iter().enumerate() {
            let threads = crate::optim::sum_threads(len);
            let x = self.data(mem, op, at, len)?;
            let sum = Arg::Ptr(base + (4 * k * SUM_WORDS) as u64);
            let args = [Arg::I64(threads as i64), Arg::Ptr(x), Arg::I64(len as i64), sum, Arg::I64(SUM_SLOTS as i64)];
            self.launch(op, &self.helpers["arbor_sum_squares"], threads, &args)?;
        }
        Ok(())
    }

    /// [`Backend::decide`](arbor_core::backend::Backend::decide): one launch of one thread.
    pub(super) fn decide_on_device(
        &self,
        mem: &Mem<'_, Self>,
        sums: Loc,
        regions: usize,
        clip: f32,
        gate: Loc,
    ) -> Result<()> {
        let op = "decide";
        gate::check_even("cuda", op, sums)?;
        let args = [
            Arg::Ptr(self.data(mem, op, sums, SUM_WORDS * regions)?),
            Arg::I64(regions as i64),
            Arg::I64(SUM_SLOTS as i64),
            Arg::F32(clip),
            Arg::Ptr(self.data(mem, op, gate, GATE_LEN)?),
        ];
        self.launch(op, &self.helpers["arbor_decide"], 1, &args)
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
