//! The one training loop: epochs of shuffled minibatches, data-parallel over any
//! [`Collective`] (one worker, threads, or MPI ranks), with CheckFreq-style checkpoints, for any
//! [`Learner`]: a `Model` (see the `model` module) over examples of one or more graphs.
//!
//! Every worker runs the same loop on the same data (SPMD); worker 0 alone evaluates, reports and
//! writes checkpoints. A checkpoint holds the parameters, the optimizer state, the position of
//! the data iterator (epoch, minibatch within it, and the RNG state the epoch's order was drawn
//! from) and the best accuracies, so [`Run::resume`] continues exactly where the run stopped.

use crate::average::Average;
use crate::checkpoint::{Checkpoint, Lent, Named, Persister};
use crate::dist::{Collective, ThreadCollective};
use crate::engine::{Planned, Planner};
use crate::optim::Optimizer;
use crate::run_folder::{self, Existing, RunFolder};
use crate::InputGraph;
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;
use serde_json::Value;
use std::borrow::Cow;
use std::time::Instant;

mod ahead;
mod averaging;
mod batch_size;
mod cadence;
mod folds;
mod gather;
mod settings;
mod state;
pub(crate) mod step;
mod threads;
pub use ahead::{each_step, plan_each};
pub use batch_size::{AutoBatch, BatchSize, Noise, MEASURE_EVERY};
pub use cadence::Every;
use cadence::{Cadence, Tuned};
pub use folds::{cross_validate, fold_dir, fold_indices, member_dir, CvResult, FoldPool, Folds};
use gather::gather_parts;
pub(crate) use gather::share_from;
pub use settings::{EpochEnd, EpochHook, LrSchedule, Next, Settings};
pub use step::StepStats;
pub use threads::{fit_threads, fit_together, on_threads};

/// Where the data iterator stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// The current epoch, from 1.
    pub epoch: usize,
    /// Minibatches of this epoch already trained on.
    pub step_in_epoch: usize,
    /// Examples of this epoch already trained on (`None` where a checkpoint written before
    /// they were counted did not say: `step_in_epoch` minibatches of the run's batch size).
    pub examples_in_epoch: Option<usize>,
    /// The RNG state this epoch's order is drawn from.
    pub epoch_rng: [u64; 4],
    /// Optimizer steps taken since the start of training.
    pub steps: u64,
}

/// The splits of a data set (a treebank unless said otherwise).
#[derive(Debug)]
pub struct Splits<'a, E> {
    /// Trained on.
    pub train: &'a [E],
    /// Chooses the best epoch.
    pub dev: &'a [E],
    /// Reported at the best epoch.
    pub test: &'a [E],
}

impl<E> Clone for Splits<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for Splits<'_, E> {}

/// Scores by name, the first the one that picks the best epoch (see [`Learner::score`]).
pub type Scores = Vec<(String, f64)>;

/// The first of `scores` (NaN if there is none).
fn main_score(scores: &Scores) -> f64 {
    scores.first().map_or(f64::NAN, |s| s.1)
}

/// What the one training loop trains: a model over examples of type `E`, one data-parallel step
/// at a time, or — for a model whose workers each hold a part of it ([`Learned::parted`], a
/// pipeline's stages) — a window of minibatches at a time. A `Model` learns from any example
/// that is one or more graphs and a target (its `AsExample`); the `model` module implements this
/// trait for it, the `pipeline` module for a stage of one.
pub trait Learner<E>: Learned {
    /// The graphs this worker's engine runs for worker `rank`'s share (of `size` workers) of
    /// `batch`: what is scheduled on a helper thread while the step before runs.
    fn share_graphs<'a>(batch: &[&'a E], rank: usize, size: usize, plan: &Settings) -> Result<Vec<&'a InputGraph>>;

    /// The scheduler of the engine that runs those graphs (none: nothing is scheduled ahead).
    fn planner(&self) -> Option<Planner>;

    /// One optimizer step on `batch` (the same on every worker of `coll`, each taking its share
    /// and summing gradients), as step `step` since the start of training (it keys the dropout
    /// masks, so a resumed run draws what an uninterrupted one did); `planned` is this worker's
    /// share as scheduled. Returns the whole minibatch's numbers.
    fn step(
        &mut self,
        coll: &mut dyn Collective,
        batch: &[&E],
        opt: &mut Optimizer,
        plan: &Settings,
        step: u64,
        planned: Option<Planned<'_>>,
    ) -> Result<StepStats>;

    /// [`Learner::step`] on each of `batches` in order, the first as step `first`, for a parted
    /// learner (a pipeline overlaps them, and applies every update before it returns), telling
    /// `hooks` as it goes. Returns every minibatch's numbers, the same on every worker.
    fn steps(
        &mut self,
        coll: &mut dyn Collective,
        batches: &[Vec<&E>],
        opt: &mut Optimizer,
        plan: &Settings,
        first: u64,
        hooks: &mut WindowHooks<'_, Self>,
    ) -> Result<Vec<StepStats>> {
        let mut all = Vec::with_capacity(batches.len());
        for (k, batch) in batches.iter().enumerate() {
            let graphs = Self::share_graphs(batch, coll.rank(), coll.size(), plan)?;
            let planned = self.planner().map(|p| p.plan(&graphs)).transpose()?;
            all.push(self.step(coll, batch, opt, plan, first + k as u64, planned)?);
            (hooks.trained)(batch.len());
            (hooks.updated)(self)?;
        }
        Ok(all)
    }

    /// The scores of the model on `data`, by name: the first picks the best epoch on dev data
    /// (higher is better: root accuracy, a correlation, …); all are reported on test data.
    /// Every worker of `coll` calls it and gets the same scores.
    fn score(&mut self, data: &[E], coll: &mut dyn Collective) -> Result<Scores>;
}

/// What [`Learner::steps`] tells as it trains a window of minibatches.
pub struct WindowHooks<'a, L> {
    /// Each minibatch's examples as it finishes (on the worker that knows its numbers).
    pub trained: &'a mut dyn FnMut(usize),
    /// The model after each update (for a weight average).
    pub updated: &'a mut dyn FnMut(&L) -> Result<()>,
}

/// What checkpoints and the workers of a run need of a model: its learned tensors by name.
pub trait Learned: Sized {
    /// Every learned tensor under its name, for a checkpoint.
    fn tensors(&self) -> Result<Vec<Named>>;

    /// [`Learned::tensors`], lending the values the model holds on the host instead of copying
    /// them (the default copies), for a weight average updated every step.
    fn tensors_lent(&self) -> Result<Vec<Lent<'_>>> {
        Ok(self.tensors()?.into_iter().map(|(name, shape, values)| (name, shape, Cow::Owned(values))).collect())
    }

    /// Moves a weight average of the learned tensors that the model keeps itself, beside them
    /// (on their device), `1 − keep` of the way to them, the first call starting it at them;
    /// `false` (the default) where it keeps none, and the run averages
    /// [`Learned::tensors_lent`] on the host instead.
    fn average_in_place(&mut self, _keep: f32) -> Result<bool> {
        Ok(false)
    }

    /// The weight average [`Learned::average_in_place`] keeps, named as the tensors (`None`
    /// before it begins, or where the model keeps none).
    fn averaged(&self) -> Result<Option<Vec<Named>>> {
        Ok(None)
    }

    /// Sets that weight average (a resumed run's), or forgets it given none; `false` where the
    /// model keeps none.
    fn set_averaged(&mut self, _averages: &[Named]) -> Result<bool> {
        Ok(false)
    }

    /// What builds the model again, stored in every checkpoint as `model_spec` (see
    /// `model::ModelSpec`); none by default.
    fn spec(&self) -> Option<Value> {
        None
    }

    /// Takes every learned tensor from a checkpoint made of [`Learned::tensors`].
    fn restore(&mut self, ck: &Checkpoint) -> Result<()>;

    /// The optimizer state the model keeps itself, beside its parameters (on their device),
    /// named as [`Optimizer::tensors`] names it, for a checkpoint; none by default (the
    /// optimizer holds all of it).
    fn optimizer_tensors(&self) -> Result<Vec<Named>> {
        Ok(Vec::new())
    }

    /// Takes from `opt` (as restored from a checkpoint) the state of the tensors the model
    /// updates itself; nothing by default.
    fn adopt_optimizer_state(&mut self, opt: &mut Optimizer) -> Result<()> {
        let _ = opt;
        Ok(())
    }

    /// A copy with the same learned values, for another worker.
    fn replica(&self) -> Result<Self>;

    /// Whether each worker holds its own part of the model (a pipeline's stage) rather than a
    /// replica of the whole: then [`Run::fit`] trains windows of minibatches
    /// ([`Learner::steps`]), and a checkpoint gathers every worker's tensors. No by default.
    fn parted(&self) -> bool {
        false
    }

    /// Workers holding each part of a [parted](Learned::parted) model: a pipeline replicated for
    /// data parallelism (its workers `r·P + s`, `P` stages), where only the first replica's
    /// parts make a checkpoint and its last stage reports. 1 by default.
    fn replicas(&self) -> usize {
        1
    }
}

/// What a run reports as it goes (the reporting worker: worker 0 of a data-parallel run, the
/// last stage of a pipeline).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Event {
    /// An epoch starts; `done` of its `total` trees were trained on before a resume.
    EpochStart {
        /// The epoch.
        epoch: usize,
        /// Trees already done.
        done: usize,
        /// Trees in the epoch.
        total: usize,
    },
    /// A minibatch of `trees` was trained on.
    Trees(usize),
    /// An epoch ended.
    EpochEnd {
        /// The epoch.
        epoch: usize,
        /// Mean training loss over its minibatches.
        loss: f64,
        /// The dev score after it (root accuracy for a classifier).
        dev: f64,
    },
}

/// What a finished run reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    /// Seconds spent in training steps.
    pub train_seconds: f64,
    /// Trees trained on.
    pub sentences: usize,
    /// Mean training loss per epoch.
    pub loss_curve: Vec<f64>,
    /// The dev score per epoch.
    pub dev_curve: Vec<f64>,
    /// For a run stopped (by `max_steps`) before any epoch ended: the dev score and the test
    /// scores of what it trained.
    pub unfinished: Option<(f64, Scores)>,
    /// Steps between snapshots of `last/` besides epochs' ends: the fixed interval, or the one
    /// an automatic cadence chose last ([`Every::Auto`]); none without.
    pub checkpoint_interval: Option<u64>,
    /// Seconds this worker spent taking those snapshots (their overhead is this over
    /// `train_seconds`).
    pub checkpoint_seconds: f64,
    /// With an automatic batch size ([`Settings::batch_auto`]): `(step, batch)` at the start
    /// of training and at every change since.
    pub batch_trajectory: Vec<(u64, usize)>,
    /// With [`Settings::test_curve`]: the test score after each epoch (empty without).
    pub test_curve: Vec<f64>,
}

/// Everything a run carries from step to step, and so everything a checkpoint holds; the model
/// is a [`Learner`].
pub struct Run<L> {
    /// The model.
    model: L,
    /// The optimizer and its state.
    opt: Optimizer,
    /// Where the data iterator stands.
    pos: Position,
    /// Best dev score so far (root accuracy for a classifier); −∞ before the first epoch's end.
    best_dev: f64,
    /// The test score at the best dev score; NaN before the first epoch's end.
    test_acc: f64,
    /// Every test score at the best dev score (the first is `test_acc`); none before the first
    /// epoch's end.
    test_scores: Scores,
    /// A moving average of the learned tensors, updated after every step, that is scored (and
    /// kept as `best/`) in place of the trained values; none by default (see
    /// [`Run::with_average`]).
    average: Option<Average>,
    /// The summed training losses of the current epoch's steps so far (`pos.step_in_epoch` of
    /// them), kept in checkpoints so that a resumed epoch reports the loss of the whole epoch.
    epoch_loss: f64,
    /// The epoch of the best dev score (0 before any).
    best_epoch: usize,
    /// What the last evaluated epoch reported (for [`Settings::on_epoch`], also after a resume).
    last_epoch: Option<EpochEnd>,
    /// What an automatic checkpoint cadence had chosen at its last snapshot (kept in
    /// checkpoints; a resumed run's cadence goes on from it).
    tuned: Option<Tuned>,
    /// Where an automatic batch size stands ([`Settings::batch_auto`]; kept in checkpoints).
    batch_size: Option<BatchSize>,
}

impl<L> Run<L> {
    /// The model.
    pub fn model(&self) -> &L {
        &self.model
    }

    /// The model, to change (e.g. its word vectors before training).
    pub fn model_mut(&mut self) -> &mut L {
        &mut self.model
    }

    /// The model, the run ended.
    pub fn into_model(self) -> L {
        self.model
    }

    /// The model and the optimizer with its state, the run ended (to go on in a fresh run).
    pub fn into_parts(self) -> (L, Optimizer) {
        (self.model, self.opt)
    }

    /// The optimizer and its state.
    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }

    /// Where the data iterator stands.
    pub fn position(&self) -> Position {
        self.pos
    }

    /// The best dev score so far (root accuracy for a classifier); −∞ before the first epoch's
    /// end.
    pub fn best_dev(&self) -> f64 {
        self.best_dev
    }

    /// The epoch of the best dev score (0 before any).
    pub fn best_epoch(&self) -> usize {
        self.best_epoch
    }

    /// The main test score at the best dev score; NaN before the first epoch's end.
    pub fn test_acc(&self) -> f64 {
        self.test_acc
    }

    /// Every test score at the best dev score (the first is [`Run::test_acc`]); none before the
    /// first epoch's end.
    pub fn test_scores(&self) -> &Scores {
        &self.test_scores
    }

    /// What the last evaluated epoch reported.
    pub fn last_epoch(&self) -> Option<EpochEnd> {
        self.last_epoch
    }

    /// The moving average of the learned tensors, if the run keeps one ([`Run::with_average`]).
    pub fn average(&self) -> Option<&Average> {
        self.average.as_ref()
    }

    /// A fresh run whose first epoch's order is drawn from `rng`.
    pub fn new(model: L, opt: Optimizer, rng: &Rng) -> Run<L> {
        let pos = Position { epoch: 1, step_in_epoch: 0, examples_in_epoch: Some(0), epoch_rng: rng.state(), steps: 0 };
        let (best_dev, test_acc) = (f64::NEG_INFINITY, f64::NAN);
        let test_scores = Scores::new();
        Run {
            model,
            opt,
            pos,
            best_dev,
            test_acc,
            test_scores,
            average: None,
            epoch_loss: 0.0,
            best_epoch: 0,
            last_epoch: None,
            tuned: None,
            batch_size: None,
        }
    }

    /// The batch size now: `--batch auto`'s, or `batch`.
    fn batch_now(&self, batch: usize) -> usize {
        self.batch_size.as_ref().map_or(batch, |b| b.batch).max(1)
    }

    /// The learning-rate factor now: the epoch's in `plan`'s schedule, times the automatic
    /// batch size's ([`BatchSize::lr_factor`]).
    fn lr_factor(&self, plan: &Settings) -> f32 {
        let scheduled = plan.lr_schedule.as_ref().map_or(1.0, |f| f(self.pos.epoch));
        scheduled * self.batch_size.as_ref().map_or(1.0, BatchSize::lr_factor)
    }

    /// [`Run::fit`] with one worker on this thread, telling `events` nothing.
    pub fn fit_local<E: Sync>(&mut self, data: Splits<'_, E>, plan: &Settings) -> Result<Summary>
    where
        L: Learner<E>,
    {
        let no_worker = || Error::Worker { rank: 0, msg: "no worker".into() };
        let mut coll = ThreadCollective::group(1, crate::dist::DEFAULT_TIMEOUT).pop().ok_or_else(no_worker)?;
        self.fit(data, plan, &mut coll, &mut |_| {})
    }

    /// Scores the model with its tensors averaged over the steps, at `decay` per step (see
    /// [`Average`]): 0.999 averages about the last thousand steps. The trained values go on
    /// training; checkpoints' `last/` keeps both, `best/` the average.
    pub fn with_average(mut self, decay: f32) -> Result<Run<L>> {
        self.average = Some(Average::new(decay)?);
        Ok(self)
    }

    /// A copy for another worker.
    pub fn replica(&self) -> Result<Run<L>>
    where
        L: Learned,
    {
        Ok(Run {
            model: self.model.replica()?,
            opt: self.opt.clone(),
            test_scores: self.test_scores.clone(),
            average: self.average.clone(),
            batch_size: self.batch_size.clone(),
            ..*self
        })
    }

    /// Trains until `plan.epochs` epochs (or `plan.max_steps` steps) are done, as worker
    /// `coll.rank()` of `coll.size()`.
    pub fn fit<E: Sync>(
        &mut self,
        data: Splits<'_, E>,
        plan: &Settings,
        coll: &mut dyn Collective,
        events: &mut dyn FnMut(Event),
    ) -> Result<Summary>
    where
        L: Learner<E>,
    {
        if data.train.is_empty() {
            return Err(Error::input("the training split", "at least one example", "none"));
        }
        if plan.batch == 0 {
            return Err(Error::input("the settings' batch size", "at least 1 example", "0"));
        }
        if plan.epochs == 0 {
            return Err(Error::input("the settings' epochs", "at least 1 (nothing is trained or scored in 0)", "0"));
        }
        let batch = plan.batch;
        if let Some(auto) = &plan.batch_auto {
            auto.check()?;
        }
        if plan.batch_auto.is_some() && (coll.size() > 1 || self.model.parted()) {
            let got = if self.model.parted() { "a pipeline" } else { "several workers" };
            return Err(Error::input("an automatic batch size", "one worker (one model, unpipelined)", got));
        }
        // A resumed run goes on with the batch size it had, and the step-time model it was
        // chosen by; a run without `batch_auto` has none.
        self.batch_size = match (plan.batch_auto, self.batch_size.take()) {
            (Some(_), Some(b)) => Some(b),
            (Some(auto), None) => Some(BatchSize::new(auto)),
            (None, _) => None,
        };
        // The writing worker claims the checkpoint folder for the run unless this process holds
        // it already: another run's checkpoints there are refused unless this run goes on from
        // them.
        let _folder = match &plan.checkpoint {
            Some(dir) if coll.rank() == 0 && !run_folder::held_here(dir) => {
                let existing = if self.pos.steps > 0 { Existing::Resume } else { Existing::Refuse };
                Some(RunFolder::claim(dir, existing)?)
            }
            _ => None,
        };
        let mut persister = Persister::paced(plan.persist_pause);
        let mut cadence = Cadence::new(plan.checkpoint_every, self.pos.steps, self.tuned)?;
        let mut summary = Summary::default();
        let (mut stopped, mut trained, mut ended) = (false, false, false);
        let done = |steps: u64| plan.max_steps.is_some_and(|m| steps >= m);
        let stop_asked = |end: &Option<EpochEnd>| match (&plan.on_epoch, end) {
            (Some(hook), Some(end)) => hook(end) == Next::Stop,
            _ => false,
        };
        // A run resumed at the end of the epoch its hook stopped at trains no further.
        let mut finished = self.pos.step_in_epoch == 0 && stop_asked(&self.last_epoch);
        while self.pos.epoch <= plan.epochs && !stopped && !finished {
            self.opt.lr_factor = self.lr_factor(plan);
            let mut rng = Rng::from_state(self.pos.epoch_rng);
            let order = epoch_order(data.train.len(), &mut rng);
            let total = data.train.len();
            let start = self.pos.examples_in_epoch.unwrap_or(self.pos.step_in_epoch * batch).min(total);
            events(Event::EpochStart { epoch: self.pos.epoch, done: start, total });
            self.pos.examples_in_epoch = Some(start);
            // The epoch's minibatches from where it stands, cut again where `--batch auto`
            // changes the batch size.
            let mut rebatch = true;
            while rebatch && !stopped {
                rebatch = false;
                let (at, size) = (self.pos.examples_in_epoch.unwrap_or(total).min(total), self.batch_now(batch));
                let batches: Vec<Vec<&E>> =
                    order[at..].chunks(size).map(|chunk| chunk.iter().map(|&i| &data.train[i]).collect()).collect();
                if batches.is_empty() {
                    break;
                }
                stopped = done(self.pos.steps);
                let count = if stopped { 0 } else { batches.len() };
                let windows = if self.model.parted() { self.windows(count, plan, &cadence) } else { Vec::new() };
                let mut account = |run: &mut Self,
                                   coll: &mut dyn Collective,
                                   first: usize,
                                   all: Vec<StepStats>,
                                   seconds: f64|
                 -> Result<bool> {
                    summary.train_seconds += seconds;
                    cadence.stepped(all.len(), seconds);
                    let end = first + all.len();
                    for (examples, stats) in batches[first..].iter().zip(all) {
                        summary.sentences += examples.len();
                        run.epoch_loss += f64::from(stats.loss);
                        run.pos.step_in_epoch += 1;
                        run.pos.examples_in_epoch = Some(run.pos.examples_in_epoch.unwrap_or(0) + examples.len());
                        run.pos.steps += 1;
                        if let (Some(b), Some(noise)) = (&mut run.batch_size, stats.noise) {
                            b.observe(&noise);
                        }
                    }
                    // A new batch size (and its learning rate) is decided before a snapshot
                    // records the run, so a resumed run goes on with it as this one does.
                    if run.batch_size.as_mut().is_some_and(|b| b.decide(run.pos.steps)) {
                        run.opt.lr_factor = run.lr_factor(plan);
                    }
                    trained = true;
                    if let (true, Some(dir)) = (cadence.due(run.pos.steps), &plan.checkpoint) {
                        let start = Instant::now();
                        run.save(coll, &plan.meta, true, dir.join("last"), &mut persister)?;
                        // The snapshot's cost: the steps' stall, and the last background write,
                        // which shared the cores with the steps since.
                        let cost = start.elapsed() + persister.last_write();
                        cadence.snapshotted(coll, run.pos.steps, cost.as_secs_f64())?;
                        run.tuned = cadence.tuned();
                    }
                    if end < batches.len() && done(run.pos.steps) {
                        stopped = true;
                    }
                    Ok(!stopped)
                };
                if self.model.parted() {
                    for w in windows {
                        let start = Instant::now();
                        let (first, mut step) = (self.pos.steps, self.pos.steps);
                        let Run { model, opt, average, .. } = &mut *self;
                        let mut hooks = WindowHooks {
                            trained: &mut |n| events(Event::Trees(n)),
                            updated: &mut |m: &L| {
                                step += 1;
                                average.as_mut().map_or(Ok(()), |avg| avg.update(step - 1, &m.tensors_lent()?))
                            },
                        };
                        let all = model.steps(coll, &batches[w.clone()], opt, plan, first, &mut hooks)?;
                        if !account(self, coll, w.start, all, start.elapsed().as_secs_f64())? {
                            break;
                        }
                    }
                } else {
                    let (rank, size) = (coll.rank(), coll.size());
                    let graphs = |k: usize| L::share_graphs(&batches[k], rank, size, plan);
                    let planner = self.model.planner();
                    let prepare = |k: usize| planner.as_ref().map(|p| p.plan(&graphs(k)?)).transpose();
                    each_step(count, &prepare, &mut |k, planned| {
                        let start = Instant::now();
                        let stats = self.model.step(coll, &batches[k], &mut self.opt, plan, self.pos.steps, planned)?;
                        self.average_step()?;
                        events(Event::Trees(batches[k].len()));
                        let go_on = account(self, coll, k, vec![stats], start.elapsed().as_secs_f64())?;
                        // A new batch size cuts the rest of the epoch again.
                        rebatch = self.batch_now(batch) != size;
                        Ok(go_on && !rebatch)
                    })?;
                }
            }
            if stopped {
                break;
            }
            let loss = self.epoch_loss / self.pos.step_in_epoch.max(1) as f64;
            self.epoch_loss = 0.0;
            self.pos = Position {
                epoch: self.pos.epoch + 1,
                step_in_epoch: 0,
                examples_in_epoch: Some(0),
                epoch_rng: rng.state(),
                ..self.pos
            };
            let epoch = self.pos.epoch - 1;
            let (dev, test) = self.evaluate(data, plan, coll, (&mut persister, &mut cadence))?;
            summary.test_curve.extend(test);
            ended = true;
            self.last_epoch = Some(EpochEnd { epoch, loss, dev, best_dev: self.best_dev, best_epoch: self.best_epoch });
            finished = stop_asked(&self.last_epoch);
            // `last/` after every epoch; under an automatic cadence only where its snapshot is
            // due (counted as one) and after the last epoch, so its overhead stays bounded.
            let last = self.pos.epoch > plan.epochs || finished;
            if let (Some(dir), true) = (&plan.checkpoint, last || cadence.due_at_epoch_end(self.pos.steps)) {
                let start = Instant::now();
                self.save(coll, &plan.meta, true, dir.join("last"), &mut persister)?;
                if matches!(plan.checkpoint_every, Some(Every::Auto(_))) && cadence.due(self.pos.steps) {
                    let cost = start.elapsed() + persister.last_write();
                    cadence.snapshotted(coll, self.pos.steps, cost.as_secs_f64())?;
                    self.tuned = cadence.tuned();
                }
            }
            summary.loss_curve.push(loss);
            summary.dev_curve.push(dev);
            events(Event::EpochEnd { epoch, loss, dev });
        }
        if stopped && trained && self.best_dev == f64::NEG_INFINITY {
            // A run stopped before any epoch's end is scored on what it trained (not kept as a
            // best epoch, so that a resumed run goes on as an uninterrupted one would).
            summary.unfinished = Some(self.averaged(|run| {
                let dev = main_score(&run.model.score(data.dev, coll)?);
                Ok((dev, run.model.score(data.test, coll)?))
            })?);
        } else if ended && self.best_dev == f64::NEG_INFINITY {
            // No epoch had a finite dev score (an empty or constant dev split): test is scored on
            // the weights `last/` holds, those of the last epoch.
            self.test_scores = self.averaged(|run| run.model.score(data.test, coll))?;
            self.test_acc = main_score(&self.test_scores);
        }
        if let (true, Some(dir)) = (stopped, &plan.checkpoint) {
            self.save(coll, &plan.meta, true, dir.join("last"), &mut persister)?;
        }
        persister.wait()?;
        (summary.checkpoint_interval, summary.checkpoint_seconds) = (cadence.interval(), cadence.spent);
        summary.batch_trajectory = self.batch_size.as_ref().map(|b| b.trajectory.clone()).unwrap_or_default();
        Ok(summary)
    }

    /// Scores the model on dev at an epoch's end, and on test when dev improves on the best so
    /// far, then writes `best/` (its cost charged to `cadence`). Every worker evaluates (replicas
    /// are identical, and a pipeline's stages score together), so none waits for another under
    /// the peer timeout. Returns the dev score, and the test score where
    /// [`Settings::test_curve`] asks for it every epoch.
    fn evaluate<E>(
        &mut self,
        data: Splits<'_, E>,
        plan: &Settings,
        coll: &mut dyn Collective,
        (persister, cadence): (&mut Persister, &mut Cadence),
    ) -> Result<(f64, Option<f64>)>
    where
        L: Learner<E>,
    {
        self.averaged(|run| {
            let dev = main_score(&run.model.score(data.dev, coll)?);
            if dev > run.best_dev {
                run.best_dev = dev;
                run.best_epoch = run.pos.epoch - 1;
                run.test_scores = run.model.score(data.test, coll)?;
                run.test_acc = main_score(&run.test_scores);
                if let Some(dir) = &plan.checkpoint {
                    let start = Instant::now();
                    run.save(coll, &plan.meta, false, dir.join("best"), persister)?;
                    cadence.charged((start.elapsed() + persister.last_write()).as_secs_f64());
                }
                return Ok((dev, plan.test_curve.then_some(run.test_acc)));
            }
            let test = plan.test_curve.then(|| run.model.score(data.test, coll)).transpose()?;
            Ok((dev, test.map(|t| main_score(&t))))
        })
    }

    /// Writes the run's state to `dir` in the background (see [`Run::snapshot`]): worker 0 writes
    /// it, and for a [parted](Learned::parted) model every worker sends it its part first.
    fn save(
        &self,
        coll: &mut dyn Collective,
        meta: &Value,
        with_optimizer: bool,
        dir: std::path::PathBuf,
        persister: &mut Persister,
    ) -> Result<()>
    where
        L: Learned,
    {
        let ck = if self.model.parted() {
            let parts = coll.size() / self.model.replicas().max(1);
            gather_parts(coll, parts, self.snapshot(meta, with_optimizer)?)?
        } else {
            (coll.rank() == 0).then(|| self.snapshot(meta, with_optimizer)).transpose()?
        };
        ck.map_or(Ok(()), |ck| persister.persist(ck, dir))
    }

    /// The minibatches `0..count` of the epoch in the windows a [parted](Learned::parted) model
    /// trains at once: as many as run before the next checkpoint `cadence` plans or
    /// `plan.max_steps` (a pipeline applies every update of a window before a checkpoint is
    /// taken).
    fn windows(&self, count: usize, plan: &Settings, cadence: &Cadence) -> Vec<std::ops::Range<usize>> {
        let steps = self.pos.steps;
        let ends = |k: usize| {
            let after = steps + k as u64 + 1;
            cadence.boundary(after) || plan.max_steps == Some(after)
        };
        let mut out = Vec::new();
        let mut start = 0;
        for k in 0..count {
            if ends(k) || k + 1 == count {
                out.push(start..k + 1);
                start = k + 1;
            }
        }
        out
    }
}

/// The order of an epoch over `len` examples, drawn from `rng`.
pub fn epoch_order(len: usize, rng: &mut Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    rng.shuffle(&mut order);
    order
}
