//! A pipeline stage as a [`Learner`]: the one loop ([`Run::fit`](crate::trainer::Run::fit))
//! trains it in windows of minibatches, and its checkpoints name its tensors as the whole
//! model names them.

use super::stage::{Stage, Updates};
use crate::checkpoint::{Checkpoint, Named};
use crate::dist::collective::Collective;
use crate::engine::{Planned, Planner};
use crate::model::{layer_prefix, AsExample, Example};
use crate::optim::Optimizer;
use crate::trainer::step::names;
use crate::trainer::{share_from, Learned, Learner, Scores, Settings, StepStats, WindowHooks};
use crate::{Backend, InputGraph};
use arbor_core::error::{Error, Result};
use serde_json::{json, Value};

/// A number sent as JSON (NaN, which JSON cannot hold, as null).
fn number(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

impl<B: Backend, E: AsExample> Learner<E> for Stage<B> {
    fn share_graphs<'a>(batch: &[&'a E], _: usize, _: usize, _: &Settings) -> Result<Vec<&'a InputGraph>> {
        let examples: Vec<Example<'a>> = batch.iter().map(|e| e.example()).collect();
        Ok(examples.iter().flat_map(Example::graphs).collect())
    }

    /// A stage schedules each micro-batch itself, ahead of its pass.
    fn planner(&self) -> Option<Planner> {
        None
    }

    fn step(
        &mut self,
        coll: &mut dyn Collective,
        batch: &[&E],
        opt: &mut Optimizer,
        plan: &Settings,
        step: u64,
        _: Option<Planned<'_>>,
    ) -> Result<StepStats> {
        let mut hooks = WindowHooks { trained: &mut |_| {}, updated: &mut |_| Ok(()) };
        let all = self.steps(coll, &[batch.to_vec()], opt, plan, step, &mut hooks)?;
        all.into_iter().next().ok_or_else(|| Error::Worker { rank: coll.rank(), msg: "no step".into() })
    }

    fn steps(
        &mut self,
        coll: &mut dyn Collective,
        batches: &[Vec<&E>],
        opt: &mut Optimizer,
        plan: &Settings,
        first: u64,
        hooks: &mut WindowHooks<'_, Self>,
    ) -> Result<Vec<StepStats>> {
        // Dropout masks are keyed by the run's step; the engines load the part at the new count.
        self.version = first;
        let mut stats = Vec::with_capacity(batches.len());
        let mut up = Updates { opt: Some(opt), clip: plan.clip, updated: &mut *hooks.updated };
        let mut mail = self.mailbox(coll)?;
        // The first replica's last stage (the mailbox has checked the group's shape).
        let last = mail.size() - 1;
        self.window(&mut mail, batches, &mut up, &mut |examples, s| {
            (hooks.trained)(examples);
            stats.push(s);
        })?;
        drop(mail);
        // The last stage alone knows the losses: every stage keeps the same account of the run.
        let mine = json!(stats.iter().map(|s| json!([s.loss, s.correct, s.count, s.vertices])).collect::<Vec<_>>());
        let all = share_from(coll, last, mine)?;
        let rows = all.as_array().filter(|rows| rows.len() == batches.len());
        let rows = rows.ok_or_else(|| Error::Worker { rank: last, msg: format!("sent the numbers {all}") })?;
        Ok(rows
            .iter()
            .map(|r| StepStats {
                loss: number(&r[0]) as f32,
                correct: r[1].as_u64().unwrap_or(0) as usize,
                count: r[2].as_u64().unwrap_or(0) as usize,
                vertices: r[3].as_u64().unwrap_or(0) as usize,
                noise: None,
            })
            .collect())
    }

    /// Every stage runs its layers over `data`; the last stage's scores reach every stage.
    fn score(&mut self, data: &[E], coll: &mut dyn Collective) -> Result<Scores> {
        let mut mail = self.mailbox(coll)?;
        let last = mail.size() - 1;
        let scores = Stage::score(self, &mut mail, data)?;
        drop(mail);
        let mine = json!(scores.iter().map(|(name, v)| json!([name, v])).collect::<Vec<_>>());
        let all = share_from(coll, last, mine)?;
        let rows = all.as_array().ok_or_else(|| Error::Worker { rank: last, msg: format!("sent the scores {all}") })?;
        Ok(rows.iter().map(|r| (r[0].as_str().unwrap_or_default().to_string(), number(&r[1]))).collect())
    }
}

impl<B: Backend> Learned for Stage<B> {
    /// The stage's tensors, named as the whole model names them.
    fn tensors(&self) -> Result<Vec<Named>> {
        let part = self.part();
        let mut out = Vec::new();
        if let Some((e, _)) = &part.input {
            out.push(("embedding".to_string(), vec![e.vocab(), e.dim()], e.table().to_vec()));
        }
        let layers = part.layers.iter().enumerate().map(|(i, l)| (layer_prefix(part.first + i), l));
        for (of, layer) in layers.chain(part.head.iter().map(|h| ("head".to_string(), h))) {
            let decls = layer.f.params();
            for ((name, decl), values) in names(&of, &layer.f).into_iter().zip(decls).zip(&layer.params) {
                out.push((name, decl.shape.dims().to_vec(), values.clone()));
            }
        }
        Ok(out)
    }

    fn spec(&self) -> Option<Value> {
        self.part().spec.clone()
    }

    /// Takes this stage's tensors from `ck` (a checkpoint of the whole model or of this part).
    fn restore(&mut self, ck: &Checkpoint) -> Result<()> {
        let mut part = self.part().clone();
        if let Some((e, _)) = &mut part.input {
            let table = ck.sized("embedding", e.table().len())?;
            e.table_mut().copy_from_slice(&table);
        }
        let first = part.first;
        let layers = part.layers.iter_mut().enumerate().map(|(i, l)| (layer_prefix(first + i), l));
        for (of, layer) in layers.chain(part.head.iter_mut().map(|h| ("head".to_string(), h))) {
            for (name, values) in names(&of, &layer.f).into_iter().zip(&mut layer.params) {
                *values = ck.sized(&name, values.len())?;
            }
        }
        self.set_part(part);
        Ok(())
    }

    fn replica(&self) -> Result<Self> {
        let mut stage =
            Stage::on(self.backend().replica()?, self.part().clone(), self.plan).replicated(self.replicas());
        stage.version = self.version;
        Ok(stage)
    }

    fn parted(&self) -> bool {
        true
    }

    fn replicas(&self) -> usize {
        Stage::replicas(self)
    }
}
