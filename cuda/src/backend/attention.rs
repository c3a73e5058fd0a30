//! Attention over the children on the device: the arguments of the `arbor_attend` and
//! `arbor_attend_grad` helper kernels (one thread per vertex and head).

use super::{Arg, CudaBackend};
use arbor_core::backend::{Attention, AttentionGrads, Backend, Loc, Mem};
use arbor_core::error::Result;

impl CudaBackend {
    /// The arguments both attention kernels begin with; the row count every child row is
    /// checked against is the fewest that any of `rows_of` (with their block widths) holds.
    fn attention_args(
        &self,
        mem: &Mem<'_, Self>,
        op: &str,
        a: &Attention,
        rows_of: &[(Loc, usize)],
    ) -> Result<Vec<Arg>> {
        let w = a.widths;
        let (kb, vb) = (w.heads * w.key, w.heads * w.value);
        let rows = rows_of.iter().map(|&(at, block)| self.rows_held(mem, at, block)).min().unwrap_or(0);
        let len = mem.index.get(a.index.buf).map_or(0, |b| self.index_len(b).saturating_sub(a.index.offset));
        Ok(vec![
            Arg::I64(a.n as i64),
            Arg::I64(w.heads as i64),
            Arg::I64(w.key as i64),
            Arg::I64(w.value as i64),
            Arg::F32(w.slope),
            Arg::Ptr(self.data(mem, op, a.query, a.n * kb)?),
            Arg::Ptr(self.data(mem, op, a.keys, kb)?),
            Arg::Ptr(self.data(mem, op, a.values, vb)?),
            Arg::I64(rows),
            Arg::Ptr(self.index(mem, op, a.offsets, a.n + 1)?),
            Arg::Ptr(self.index(mem, op, a.index, 0)?),
            Arg::I64(len as i64),
        ])
    }

    /// [`Backend::attend`](arbor_core::backend::Backend::attend).
    pub(super) fn attend_on_device(&self, mem: &Mem<'_, Self>, a: &Attention, out: Loc) -> Result<()> {
        let (kb, vb) = (a.widths.heads * a.widths.key, a.widths.heads * a.widths.value);
        let mut args = self.attention_args(mem, "attend", a, &[(a.keys, kb), (a.values, vb)])?;
        args.push(Arg::Ptr(self.data(mem, "attend", out, a.n * vb)?));
        self.launch("attend", &self.helpers["arbor_attend"], a.n * a.widths.heads, &args)
    }

    /// [`Backend::attend_grad`](arbor_core::backend::Backend::attend_grad).
    pub(super) fn attend_grad_on_device(&self, mem: &Mem<'_, Self>, a: &Attention, g: &AttentionGrads) -> Result<()> {
        let op = "attend_grad";
        let (kb, vb) = (a.widths.heads * a.widths.key, a.widths.heads * a.widths.value);
        let rows_of = [(a.keys, kb), (a.values, vb), (g.keys, kb), (g.values, vb)];
        let mut args = self.attention_args(mem, op, a, &rows_of)?;
        args.extend([
            Arg::Ptr(self.data(mem, op, g.out, a.n * vb)?),
            Arg::Ptr(self.data(mem, op, g.query, a.n * kb)?),
            Arg::Ptr(self.data(mem, op, g.keys, kb)?),
            Arg::Ptr(self.data(mem, op, g.values, vb)?),
        ]);
        self.launch(op, &self.helpers["arbor_attend_grad"], a.n * a.widths.heads, &args)
    }
}
