//! A run's weight average: updated after every step where the model keeps it (beside its
//! tensors, on their device) or else on the host, resumed from a checkpoint, and scored in place
//! of the trained values.

use super::{Learned, Run};
use crate::checkpoint::{Checkpoint, Named};
use arbor_core::error::Result;
use serde_json::Value;

impl<L: Learned> Run<L> {
    /// Moves the weight average (if the run keeps one) toward the tensors after a step: in the
    /// model where it can ([`Learned::average_in_place`]), else from the tensors on the host.
    pub(super) fn average_step(&mut self) -> Result<()> {
        let Some(avg) = &mut self.average else { return Ok(()) };
        if self.model.average_in_place(avg.keep_at(self.pos.steps))? {
            avg.kept_by_model();
            return Ok(());
        }
        avg.update(self.pos.steps, &self.model.tensors_lent()?)
    }

    /// Takes the weight average saved in `ck` (none: it starts afresh), handing it to the model
    /// where the model keeps it.
    pub(super) fn restore_average(&mut self, ck: &Checkpoint) -> Result<()> {
        let Some(avg) = &mut self.average else { return Ok(()) };
        avg.restore(ck, &self.model.tensors()?)?;
        if self.model.set_averaged(avg.tensors())? && !avg.tensors().is_empty() {
            avg.kept_by_model();
        }
        Ok(())
    }

    /// The weight averages now: the model's where it keeps them, else `avg`'s.
    pub(super) fn averages(&self, avg: &crate::average::Average) -> Result<Vec<Named>> {
        if avg.is_kept_by_model() {
            return Ok(self.model.averaged()?.unwrap_or_default());
        }
        Ok(avg.tensors().to_vec())
    }

    /// The run's weight averages now, named as the model's tensors, wherever they are kept
    /// (read from the model's device where it keeps them); empty without an average or before
    /// it begins.
    pub fn average_tensors(&self) -> Result<Vec<Named>> {
        self.average.as_ref().map_or(Ok(Vec::new()), |avg| self.averages(avg))
    }

    /// Runs `f` on the run with the model's tensors replaced by their [average](Run::average)
    /// (if it has one and has begun), and puts the trained values back after, whatever `f` returns:
    /// the model as the run scores it.
    pub fn averaged<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let Some(avg) = self.average.as_ref().filter(|a| a.begun()) else { return f(self) };
        let averaged = Checkpoint { tensors: self.averages(avg)?, meta: Value::Null };
        let trained = Checkpoint { tensors: self.model.tensors()?, meta: Value::Null };
        self.model.restore(&averaged)?;
        let out = f(self);
        self.model.restore(&trained)?;
        out
    }
}
