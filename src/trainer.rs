//! The training loop over a treebank: epochs of shuffled minibatches, data-parallel over any
//! [`Collective`] (one worker, threads, or MPI ranks), with CheckFreq-style checkpoints.
//!
//! Every worker runs the same loop on the same data (SPMD); worker 0 alone evaluates, reports and
//! writes checkpoints. A checkpoint holds the parameters, the optimizer state, the position of
//! the data iterator (epoch, minibatch within it, and the RNG state the epoch's order was drawn
//! from) and the best accuracies, so [`Run::resume`] continues exactly where the run stopped.

use crate::checkpoint::{Checkpoint, Persister};
use crate::data::TreeExample;
use crate::dist::{data_parallel, Collective, ThreadCollective};
use crate::engine::{Planned, Planner};
use crate::layers::LossOn;
use crate::optim::Optimizer;
use crate::train::{Classifier, StepStats};
use crate::{Backend, CpuBackend, InputGraph};
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Where the data iterator stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// The current epoch, from 1.
    pub epoch: usize,
    /// Minibatches of this epoch already trained on.
    pub step_in_epoch: usize,
    /// The RNG state this epoch's order is drawn from.
    pub epoch_rng: [u64; 4],
    /// Optimizer steps taken since the start of training.
    pub steps: u64,
}

/// Settings of a run.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Passes over the training set.
    pub epochs: usize,
    /// Trees per minibatch (the whole minibatch, over all workers).
    pub batch: usize,
    /// Where the loss is taken.
    pub loss_on: LossOn,
    /// Gradient-norm bound.
    pub clip: Option<f32>,
    /// Keep checkpoints here: `last/` (latest) and `best/` (best dev accuracy).
    pub checkpoint: Option<PathBuf>,
    /// Also snapshot to `last/` every this many steps (besides every epoch's end).
    pub checkpoint_every: Option<u64>,
    /// Stop after this many steps in all (a checkpoint is written there).
    pub max_steps: Option<u64>,
    /// A pause inside each checkpoint write (crash tests only).
    pub persist_pause: Duration,
    /// What every checkpoint records about the model and data (sizes, vocabulary, …).
    pub meta: Value,
}

/// The splits of a treebank.
#[derive(Clone, Copy, Debug)]
pub struct Splits<'a> {
    /// Trained on.
    pub train: &'a [TreeExample],
    /// Chooses the best epoch.
    pub dev: &'a [TreeExample],
    /// Reported at the best epoch.
    pub test: &'a [TreeExample],
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
        /// Dev root accuracy after it.
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
    /// Dev accuracy per epoch.
    pub dev_curve: Vec<f64>,
}

/// Everything a run carries from step to step, and so everything a checkpoint holds; the model
/// runs its vertex function on `B` (the CPU unless said otherwise).
pub struct Run<B: Backend = CpuBackend> {
    /// The model.
    pub model: Classifier<B>,
    /// The optimizer and its state.
    pub opt: Optimizer,
    /// Where the data iterator stands.
    pub pos: Position,
    /// Best dev accuracy so far.
    pub best_dev: f64,
    /// Test accuracy at the best dev accuracy.
    pub test_acc: f64,
}

fn meta_error(key: &str, got: &Value) -> Error {
    Error::input("checkpoint metadata", format!("`{key}`"), got.to_string())
}

impl<B: Backend> Run<B> {
    /// A fresh run whose first epoch's order is drawn from `rng`.
    pub fn new(model: Classifier<B>, opt: Optimizer, rng: &Rng) -> Run<B> {
        let pos = Position { epoch: 1, step_in_epoch: 0, epoch_rng: rng.state(), steps: 0 };
        Run { model, opt, pos, best_dev: 0.0, test_acc: 0.0 }
    }

    /// A copy for another worker.
    pub fn replica(&self) -> Result<Run<B>> {
        Ok(Run { model: self.model.replica()?, opt: self.opt.clone(), ..*self })
    }

    /// The run's state as a checkpoint (phase one of CheckFreq: an in-memory copy); `meta` says
    /// what the model and data are.
    pub fn snapshot(&self, meta: &Value, with_optimizer: bool) -> Result<Checkpoint> {
        let mut tensors = self.model.tensors()?;
        if with_optimizer {
            tensors.extend(self.opt.tensors());
        }
        let mut meta = meta.clone();
        let p = self.pos;
        let state = json!({
            "epoch": p.epoch - usize::from(p.step_in_epoch == 0),
            "steps": p.steps,
            "position": { "epoch": p.epoch, "step_in_epoch": p.step_in_epoch, "epoch_rng": p.epoch_rng },
            "best_dev_acc": self.best_dev,
            "test_acc": self.test_acc,
        });
        if let (Some(m), Value::Object(s)) = (meta.as_object_mut(), state) {
            m.extend(s);
        }
        Ok(Checkpoint { tensors, meta })
    }

    /// Restores parameters, optimizer state, position and accuracies from a checkpoint written
    /// by a run (its `last/` folder). Every setting in `settings` (what [`Settings::meta`] records:
    /// model, sizes, data, seed, batch, …) must be what the checkpoint recorded, or the position
    /// would mean another place in another order.
    pub fn resume(&mut self, ck: &Checkpoint, settings: &Value) -> Result<()> {
        let m = &ck.meta;
        for (key, want) in settings.as_object().into_iter().flatten() {
            if &m[key] != want {
                let show = |v: &Value| {
                    let s = v.to_string();
                    if s.len() > 60 {
                        "a different one".to_string()
                    } else {
                        s
                    }
                };
                return Err(Error::input(
                    format!("resuming from a checkpoint with `{key}` = {}", show(&m[key])),
                    "the same setting in this run",
                    show(want),
                ));
            }
        }
        if !ck.tensors.iter().any(|(name, _, _)| name.starts_with("opt.")) && m["steps"].as_u64() != Some(0) {
            return Err(Error::input(
                "resuming from a checkpoint",
                "one with optimizer state (a `last/` folder)",
                "parameters only (a `best/` folder is for `arbor eval`)",
            ));
        }
        let p = &m["position"];
        let num = |v: &Value, key: &str| v[key].as_u64().ok_or_else(|| meta_error(key, &v[key]));
        let rng: Vec<u64> =
            p["epoch_rng"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default();
        let [a, b, c, d] = rng[..] else { return Err(meta_error("position.epoch_rng", &p["epoch_rng"])) };
        let epoch = num(p, "epoch")? as usize;
        if epoch == 0 {
            return Err(meta_error("position.epoch (from 1)", &p["epoch"]));
        }
        let pos = Position {
            epoch,
            step_in_epoch: num(p, "step_in_epoch")? as usize,
            epoch_rng: [a, b, c, d],
            steps: num(m, "steps")?,
        };
        self.model.restore(ck)?;
        self.opt.restore(ck, pos.steps)?;
        self.pos = pos;
        self.best_dev = m["best_dev_acc"].as_f64().unwrap_or(0.0);
        self.test_acc = m["test_acc"].as_f64().unwrap_or(0.0);
        Ok(())
    }

    /// Trains until `plan.epochs` epochs (or `plan.max_steps` steps) are done, as worker
    /// `coll.rank()` of `coll.size()`.
    pub fn fit(
        &mut self,
        data: Splits<'_>,
        plan: &Settings,
        coll: &mut dyn Collective,
        events: &mut dyn FnMut(Event),
    ) -> Result<Summary> {
        let lead = coll.rank() == 0;
        let batch = plan.batch.max(1);
        let mut persister = Persister::paced(plan.persist_pause);
        let mut summary = Summary::default();
        let mut stopped = false;
        let done = |steps: u64| plan.max_steps.is_some_and(|m| steps >= m);
        while self.pos.epoch <= plan.epochs && !stopped {
            let mut rng = Rng::from_state(self.pos.epoch_rng);
            let order = epoch_order(data.train.len(), &mut rng);
            let total = data.train.len();
            events(Event::EpochStart {
                epoch: self.pos.epoch,
                done: (self.pos.step_in_epoch * batch).min(total),
                total,
            });
            let (mut loss, mut steps) = (0.0f64, 0usize);
            let batches: Vec<Vec<&TreeExample>> = order
                .chunks(batch)
                .skip(self.pos.step_in_epoch)
                .map(|chunk| chunk.iter().map(|&i| &data.train[i]).collect())
                .collect();
            if !batches.is_empty() && done(self.pos.steps) {
                stopped = true;
            }
            let (rank, size) = (coll.rank(), coll.size());
            let graphs = |k: usize| data_parallel::share_graphs(&batches[k], rank, size, plan.loss_on);
            let planner = self.model.engine.planner();
            let count = if stopped { 0 } else { batches.len() };
            plan_each(&planner, count, &graphs, &mut |k, planned| {
                let start = Instant::now();
                let examples = &batches[k];
                // Masks keyed by the step since the start of training: a resumed run draws what
                // the uninterrupted one did.
                let key = self.model.engine.dropout_key();
                self.model.engine.set_dropout_key(crate::DropoutKey { step: self.pos.steps, ..key });
                let stats = data_parallel::step(
                    &mut self.model,
                    coll,
                    examples,
                    plan.loss_on,
                    &mut self.opt,
                    plan.clip,
                    Some(planned),
                )?;
                summary.train_seconds += start.elapsed().as_secs_f64();
                summary.sentences += examples.len();
                loss += f64::from(stats.loss);
                steps += 1;
                self.pos.step_in_epoch += 1;
                self.pos.steps += 1;
                events(Event::Trees(examples.len()));
                let due = plan.checkpoint_every.is_some_and(|n| n > 0 && self.pos.steps.is_multiple_of(n));
                if let (true, true, Some(dir)) = (lead, due, &plan.checkpoint) {
                    persister.persist(self.snapshot(&plan.meta, true)?, dir.join("last"))?;
                }
                if k + 1 < batches.len() && done(self.pos.steps) {
                    stopped = true;
                }
                Ok(!stopped)
            })?;
            if stopped {
                break;
            }
            self.pos = Position { epoch: self.pos.epoch + 1, step_in_epoch: 0, epoch_rng: rng.state(), ..self.pos };
            // Every replica evaluates (they are identical), so none waits for another under the
            // peer timeout.
            let epoch = self.pos.epoch - 1;
            let dev = self.model.accuracy(data.dev, 256)?;
            let improved = dev > self.best_dev;
            if improved {
                self.best_dev = dev;
                self.test_acc = self.model.accuracy(data.test, 256)?;
            }
            if lead {
                if let Some(dir) = &plan.checkpoint {
                    if improved {
                        persister.persist(self.snapshot(&plan.meta, false)?, dir.join("best"))?;
                    }
                    persister.persist(self.snapshot(&plan.meta, true)?, dir.join("last"))?;
                }
                let loss = loss / steps.max(1) as f64;
                summary.loss_curve.push(loss);
                summary.dev_curve.push(dev);
                events(Event::EpochEnd { epoch, loss, dev });
            }
        }
        if let (true, true, Some(dir)) = (lead, stopped, &plan.checkpoint) {
            persister.persist(self.snapshot(&plan.meta, true)?, dir.join("last"))?;
        }
        persister.wait()?;
        Ok(summary)
    }
}

/// The one loop over steps that every trainer runs (`arbor train` and `arbor bench --mode
/// train` through [`train_steps`], [`Run::fit`], [`Classifier::train_batches`],
/// [`cross_validate`](crate::train::cross_validate), and a pipeline stage's passes): while
/// `step` runs step `k` with what `prepare(k)` made of it, `prepare(k + 1)` runs on a helper
/// thread — for a minibatch, checking and scheduling its graphs ([`plan_each`]) — when this
/// thread's CPU budget leaves a core for it (more than one thread), else right after step `k`.
/// Stops after a step that returns `false`.
pub fn each_step<P: Send>(
    count: usize,
    prepare: &(dyn Fn(usize) -> Result<P> + Sync),
    step: &mut dyn FnMut(usize, P) -> Result<bool>,
) -> Result<()> {
    let planner_error = |got: &str| Error::input("the minibatch planner thread", "a finished plan", got);
    let mut next = if count > 0 { Some(prepare(0)?) } else { None };
    // Preparing ahead needs a core the step leaves idle: a worker held to one thread (every core
    // taken by workers) prepares each step right before it instead.
    let spare_core = crate::cpu_thread_budget() > 1;
    std::thread::scope(|scope| {
        for k in 0..count {
            let ahead = (spare_core && k + 1 < count)
                .then(|| {
                    std::thread::Builder::new().name("arbor-planner".into()).spawn_scoped(scope, move || prepare(k + 1))
                })
                .transpose()
                .map_err(|e| planner_error(&format!("no thread: {e}")))?;
            let planned = next.take().ok_or_else(|| planner_error("no plan"))?;
            let go = step(k, planned)?;
            next = match ahead {
                Some(h) => Some(h.join().map_err(|_| planner_error("a panic"))??),
                None if go && k + 1 < count => Some(prepare(k + 1)?),
                None => None,
            };
            if !go {
                break;
            }
        }
        Ok(())
    })
}

/// [`each_step`] over `count` minibatches whose graphs (the part this worker's engine runs) are
/// `graphs(k)`, each checked and scheduled by `planner` ahead of its step.
pub fn plan_each<'g>(
    planner: &Planner,
    count: usize,
    graphs: &(dyn Fn(usize) -> Result<Vec<&'g InputGraph>> + Sync),
    step: &mut dyn FnMut(usize, Planned<'g>) -> Result<bool>,
) -> Result<()> {
    each_step(count, &|k| planner.plan(&graphs(k)?), step)
}

/// Data-parallel training steps ([`data_parallel::step`]) on `batches` (the same on every
/// worker), through [`each_step`]: what `arbor train` runs per epoch and `arbor bench --mode
/// train` times. `after` hears each step's numbers and its tree count and says whether to go on.
#[allow(clippy::too_many_arguments)]
pub fn train_steps<B: Backend>(
    model: &mut Classifier<B>,
    opt: &mut Optimizer,
    coll: &mut dyn Collective,
    batches: &[Vec<&TreeExample>],
    loss_on: LossOn,
    clip: Option<f32>,
    after: &mut dyn FnMut(&StepStats, usize) -> Result<bool>,
) -> Result<()> {
    let (rank, size) = (coll.rank(), coll.size());
    let graphs = |k: usize| data_parallel::share_graphs(&batches[k], rank, size, loss_on);
    plan_each(&model.engine.planner(), batches.len(), &graphs, &mut |k, planned| {
        let stats = data_parallel::step(model, coll, &batches[k], loss_on, opt, clip, Some(planned))?;
        after(&stats, batches[k].len())
    })
}

/// The order of an epoch over `len` examples, drawn from `rng`.
pub fn epoch_order(len: usize, rng: &mut Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    rng.shuffle(&mut order);
    order
}

/// The error to report from a group of failed workers: the first that is not a consequence of
/// another worker stopping.
fn root_cause(errors: Vec<Error>) -> Error {
    let consequence = |e: &Error| matches!(e, Error::Worker { msg, .. } if msg.ends_with("has stopped"));
    let first = errors.iter().position(|e| !consequence(e)).unwrap_or(0);
    errors.into_iter().nth(first).unwrap_or(Error::Worker { rank: 0, msg: "failed".into() })
}

/// Runs `work` once per state, each on its own thread (one worker alone on this thread) as one
/// worker of a [`ThreadCollective`] group (worker `i` gets `states[i]`), with an equal share of the calling thread's CPU threads
/// ([`cpu_thread_budget`](crate::cpu_thread_budget)) for its backend calls and updates. Worker `reporter`'s events reach `events` on this thread. Returns every worker's
/// result in rank order; if any failed, the error that caused the others'.
pub fn on_threads<S: Send, T: Send>(
    states: Vec<S>,
    timeout: Duration,
    reporter: usize,
    events: &mut dyn FnMut(Event),
    work: impl Fn(S, &mut ThreadCollective, &mut dyn FnMut(Event)) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let workers = states.len().max(1);
    let share = (crate::cpu_thread_budget() / workers).max(1);
    if states.len() == 1 {
        // One worker runs on this thread: no thread to start, and its memory comes from the
        // allocator's main arena like the rest of the program's.
        let no_worker = || Error::Worker { rank: 0, msg: "no worker".into() };
        let mut coll = ThreadCollective::group(1, timeout).pop().ok_or_else(no_worker)?;
        let state = states.into_iter().next().ok_or_else(no_worker)?;
        let mut quiet = |_: Event| {};
        let events: &mut dyn FnMut(Event) = if reporter == 0 { events } else { &mut quiet };
        let run = std::panic::AssertUnwindSafe(|| crate::with_cpu_threads(share, || work(state, &mut coll, events)));
        let done =
            std::panic::catch_unwind(run).unwrap_or_else(|_| Err(Error::Worker { rank: 0, msg: "panicked".into() }));
        return done.map(|t| vec![t]);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let work = &work;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = states
            .into_iter()
            .zip(ThreadCollective::group(workers, timeout))
            .enumerate()
            .map(|(rank, (state, mut coll))| {
                let tx = (rank == reporter).then(|| tx.clone());
                s.spawn(move || {
                    let mut report = |e: Event| {
                        if let Some(tx) = &tx {
                            // The receiver lives until every worker has ended.
                            let _ = tx.send(e);
                        }
                    };
                    crate::with_cpu_threads(share, || work(state, &mut coll, &mut report))
                })
            })
            .collect();
        // The reporter's events, relayed on this thread until every worker is done.
        drop(tx);
        rx.iter().for_each(events);
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| h.join().unwrap_or_else(|_| Err(Error::Worker { rank, msg: "panicked".into() })))
            .collect()
    });
    let errors: Vec<Error> = results.iter().filter_map(|r| r.as_ref().err().cloned()).collect();
    if errors.is_empty() {
        results.into_iter().collect()
    } else {
        Err(root_cause(errors))
    }
}

/// Trains `run` data-parallel on `workers` threads of this process; returns worker 0's summary,
/// with `run` holding the result. A worker that fails or stops answering for `timeout` ends the
/// run with an error.
pub fn fit_threads<B: Backend>(
    run: &mut Run<B>,
    workers: usize,
    timeout: Duration,
    data: Splits<'_>,
    plan: &Settings,
    events: &mut dyn FnMut(Event),
) -> Result<Summary>
where
    Run<B>: Send,
{
    let mut replicas: Vec<Run<B>> = (1..workers.max(1)).map(|_| run.replica()).collect::<Result<_>>()?;
    let runs: Vec<&mut Run<B>> = std::iter::once(run).chain(replicas.iter_mut()).collect();
    let summaries = on_threads(runs, timeout, 0, events, |run, coll, report| run.fit(data, plan, coll, report))?;
    Ok(summaries.into_iter().next().unwrap_or_default())
}
