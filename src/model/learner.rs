//! A [`Model`] as the one loop's [`Learner`]: data-parallel steps, scores, and its tensors for
//! checkpoints.

use super::{AsExample, Example, Model};
use crate::checkpoint::{Checkpoint, Lent, Named};
use crate::dist::Collective;
use crate::engine::{Planned, Planner};
use crate::optim::Optimizer;
use crate::trainer::{Learned, Learner, Scores, Settings, StepStats, MEASURE_EVERY};
use crate::{Backend, InputGraph};
use arbor_core::error::Result;

impl<B: Backend, E: AsExample> Learner<E> for Model<B> {
    fn share_graphs<'a>(batch: &[&'a E], rank: usize, size: usize, _: &Settings) -> Result<Vec<&'a InputGraph>> {
        let examples: Vec<Example<'a>> = batch.iter().map(|e| e.example()).collect();
        let mine = &examples[Model::<B>::share(&examples, rank, size)];
        Ok(mine.iter().flat_map(Example::graphs).collect())
    }

    fn planner(&self) -> Option<Planner> {
        Some(Model::planner(self))
    }

    fn step(
        &mut self,
        coll: &mut dyn Collective,
        batch: &[&E],
        opt: &mut Optimizer,
        plan: &Settings,
        step: u64,
        planned: Option<Planned<'_>>,
    ) -> Result<StepStats> {
        let examples: Vec<Example<'_>> = batch.iter().map(|e| e.example()).collect();
        if plan.batch_auto.is_some() && coll.size() == 1 && step.is_multiple_of(MEASURE_EVERY) {
            let terms: Vec<usize> = batch.iter().map(|e| e.terms()).collect();
            return self.step_measured(&examples, &terms, opt, plan.clip, step);
        }
        let denom = batch.iter().map(|e| e.terms()).sum();
        self.step_shared(coll, &examples, denom, opt, plan.clip, step, planned)
    }

    /// Each replica scores alone (they are identical).
    fn score(&mut self, data: &[E], _: &mut dyn Collective) -> Result<Scores> {
        Model::score(self, data)
    }
}

impl<B: Backend> Learned for Model<B> {
    fn tensors(&self) -> Result<Vec<Named>> {
        Model::tensors(self)
    }

    fn spec(&self) -> Option<serde_json::Value> {
        Some(Model::spec(self).to_json())
    }

    fn tensors_lent(&self) -> Result<Vec<Lent<'_>>> {
        Model::tensors_lent(self)
    }

    fn restore(&mut self, ck: &Checkpoint) -> Result<()> {
        Model::restore(self, ck)
    }

    fn average_in_place(&mut self, keep: f32) -> Result<bool> {
        Model::average_in_place(self, keep).map(|()| true)
    }

    fn averaged(&self) -> Result<Option<Vec<Named>>> {
        Model::averaged(self)
    }

    fn set_averaged(&mut self, averages: &[Named]) -> Result<bool> {
        Model::set_averaged(self, averages).map(|()| true)
    }

    fn optimizer_tensors(&self) -> Result<Vec<Named>> {
        Model::optimizer_tensors(self)
    }

    fn adopt_optimizer_state(&mut self, opt: &mut Optimizer) -> Result<()> {
        Model::adopt_optimizer_state(self, opt)
    }

    fn replica(&self) -> Result<Self> {
        Model::replica(self)
    }
}
