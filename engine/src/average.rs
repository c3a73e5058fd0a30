//! A weight average of the parameters and of the held table kept beside them, in the engine's
//! own buffers: moved toward the values after each step on the backend
//! ([`Backend::average`]), read only when a run saves or scores it.

use crate::held::TABLE;
use crate::launch::{Launch, PARAMS};
use crate::Engine;
use arbor_core::backend::{Backend, Loc, Mem, Rows};
use arbor_core::error::{Error, Result};

/// The engine's buffer of its parameters' weight average, laid out as [`PARAMS`].
pub const AVG: usize = 12;
/// The engine's buffer of its held table's weight average.
pub const TABLE_AVG: usize = 13;

impl<B: Backend> Engine<B> {
    /// Moves the weight average of the parameters (and of the held table, if any) `1 − keep`
    /// of the way to their values (`arbor_core::optim::average`); the first call starts it at
    /// the values, copied.
    pub fn average(&mut self, keep: f32) -> Result<()> {
        let table = self.backend.len(&self.bufs[TABLE]);
        let begun = self.has_average();
        for (avg, of, len) in [(AVG, PARAMS, self.lowering.a.params_len), (TABLE_AVG, TABLE, table)] {
            if len == 0 {
                continue;
            }
            let (to, from) = (Loc { buf: avg, offset: 0 }, Loc { buf: of, offset: 0 });
            if begun {
                let mem = &mut Mem { data: &mut self.bufs, index: &self.index };
                self.backend.average(mem, to, from, len, keep)?;
                self.calls += 1;
            } else {
                self.bufs[avg] = self.backend.alloc(len)?;
                let copy = [Launch::Copy { from: Rows::Contiguous(from), to, rows: len, block: 1 }];
                let mem = &mut Mem { data: &mut self.bufs, index: &self.index };
                self.calls += super::launch::execute(&self.backend, mem, &copy)?.1;
            }
        }
        Ok(())
    }

    /// Whether a weight average has begun ([`Engine::average`], [`Engine::set_averages`]).
    pub fn has_average(&self) -> bool {
        let len = self.lowering.a.params_len;
        let table = self.backend.len(&self.bufs[TABLE]);
        (len > 0 && self.backend.len(&self.bufs[AVG]) == len)
            || (table > 0 && self.backend.len(&self.bufs[TABLE_AVG]) == table)
    }

    /// The weight average of each parameter (in the function's order) and of the held table
    /// (empty if it holds none), read back.
    pub fn averages(&self) -> Result<(Vec<Vec<f32>>, Vec<f32>)> {
        if !self.has_average() {
            return Err(Error::input("Engine::averages", "a weight average begun (Engine::average)", "none"));
        }
        let params = self
            .function()
            .params()
            .iter()
            .zip(&self.lowering.a.param_at)
            .map(|(p, &at)| self.backend.read_vec(&self.bufs[AVG], at, p.shape.numel()))
            .collect::<Result<_>>()?;
        let table = self.backend.read_vec(&self.bufs[TABLE_AVG], 0, self.backend.len(&self.bufs[TABLE_AVG]))?;
        Ok((params, table))
    }

    /// Sets the weight averages (a resumed run's; each parameter's as long as it, the table's
    /// as long as the held table), or, given `None`, forgets them (the next
    /// [`Engine::average`] starts afresh).
    pub fn set_averages(&mut self, averages: Option<(&[Vec<f32>], &[f32])>) -> Result<()> {
        let Some((params, table)) = averages else {
            self.bufs[AVG] = self.backend.alloc(0)?;
            self.bufs[TABLE_AVG] = self.backend.alloc(0)?;
            return Ok(());
        };
        let f = self.lowering.function_arc().clone();
        let held = self.backend.len(&self.bufs[TABLE]);
        let sizes_fit = params.len() == f.params().len()
            && f.params().iter().zip(params).all(|(p, v)| p.shape.numel() == v.len())
            && table.len() == held;
        if !sizes_fit {
            let want = format!("{} parameters of their sizes and a table of {held} values", f.params().len());
            return Err(Error::input(format!("weight averages of `{}`", f.name()), want, "others"));
        }
        let mut avg = self.backend.alloc(self.lowering.a.params_len)?;
        for (v, &at) in params.iter().zip(&self.lowering.a.param_at) {
            self.backend.write(&mut avg, at, v)?;
        }
        let mut table_avg = self.backend.alloc(held)?;
        self.backend.write(&mut table_avg, 0, table)?;
        (self.bufs[AVG], self.bufs[TABLE_AVG]) = (avg, table_avg);
        Ok(())
    }
}
