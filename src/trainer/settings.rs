//! The settings of a run: what [`Run::fit`](super::Run::fit) trains for and where it saves,
//! built with defaults ([`Settings::new`]) and per-epoch hooks that stop a run early or set
//! its learning rate.

use arbor_core::error::{Error, Result};
use serde_json::Value;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What a run knows after an epoch's evaluation: what an [`EpochHook`] decides on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EpochEnd {
    /// The epoch that ended (from 1).
    pub epoch: usize,
    /// Its mean training loss.
    pub loss: f64,
    /// Its dev score (NaN without one).
    pub dev: f64,
    /// The best dev score so far (−∞ before any finite one).
    pub best_dev: f64,
    /// The epoch of the best dev score (0 before any).
    pub best_epoch: usize,
}

/// What an [`EpochHook`] decides after an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Train the next epoch.
    Continue,
    /// End the run here (its `last/` and `best/` stay as they are).
    Stop,
}

/// Decides after every epoch whether the run goes on (early stopping). It must depend only on
/// what it is told, so that every worker decides alike and a resumed run as the uninterrupted
/// one did.
pub type EpochHook = Arc<dyn Fn(&EpochEnd) -> Next + Send + Sync>;

/// The learning-rate factor of each epoch (from 1): every tensor's rate is multiplied by it for
/// that epoch's steps (a schedule). A function of the epoch alone, so a resumed run follows it.
pub type LrSchedule = Arc<dyn Fn(usize) -> f32 + Send + Sync>;

/// Settings of a run. [`Settings::new`] fills in the defaults; the fields stay public.
#[derive(Clone)]
pub struct Settings {
    /// Passes over the training set.
    pub epochs: usize,
    /// Examples per minibatch (the whole minibatch, over all workers).
    pub batch: usize,
    /// Gradient-norm bound.
    pub clip: Option<f32>,
    /// Keep checkpoints here: `last/` (latest) and `best/` (best dev accuracy).
    pub checkpoint: Option<PathBuf>,
    /// Also snapshot to `last/` between epochs' ends: every so many steps, or as often as a
    /// bound on the snapshots' overhead allows ([`Every`](super::Every)), which then also
    /// decides whether an epoch's end writes it (the last epoch's always does).
    pub checkpoint_every: Option<super::Every>,
    /// Stop after this many steps in all (a checkpoint is written there).
    pub max_steps: Option<u64>,
    /// A pause inside each checkpoint write (crash tests only).
    pub persist_pause: Duration,
    /// What every checkpoint records about the model and data (sizes, vocabulary, …).
    pub meta: Value,
    /// Asked after every epoch whether to go on (none: train every epoch).
    pub on_epoch: Option<EpochHook>,
    /// The learning-rate factor of each epoch (none: 1).
    pub lr_schedule: Option<LrSchedule>,
    /// Choose the batch size as training goes, for the most goodput (`batch` is then unused;
    /// see [`AutoBatch`](super::AutoBatch)); none: `batch` throughout.
    pub batch_auto: Option<super::AutoBatch>,
    /// Also score the test split after every epoch, into [`Summary::test_curve`](super::Summary)
    /// (off: test is scored only where dev improves). Which epoch the run keeps is unchanged.
    pub test_curve: bool,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("epochs", &self.epochs)
            .field("batch", &self.batch)
            .field("clip", &self.clip)
            .field("checkpoint", &self.checkpoint)
            .field("checkpoint_every", &self.checkpoint_every)
            .field("max_steps", &self.max_steps)
            .field("meta", &self.meta)
            .field("on_epoch", &self.on_epoch.is_some())
            .field("lr_schedule", &self.lr_schedule.is_some())
            .field("batch_auto", &self.batch_auto)
            .field("test_curve", &self.test_curve)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// `epochs` passes over the training set in minibatches of `batch` examples (at least 1: a
    /// run refuses 0), gradients clipped to norm 5, no checkpoints, every epoch trained and a
    /// constant learning rate. Where the loss is taken is the examples' and the model's readout's
    /// to say, not the settings'.
    pub fn new(epochs: usize, batch: usize) -> Settings {
        Settings {
            epochs,
            batch,
            clip: Some(5.0),
            checkpoint: None,
            checkpoint_every: None,
            max_steps: None,
            persist_pause: Duration::ZERO,
            meta: Value::Object(Default::default()),
            on_epoch: None,
            lr_schedule: None,
            batch_auto: None,
            test_curve: false,
        }
    }

    /// Keeps checkpoints in `dir` (`last/` and `best/`); hold a
    /// [`RunFolder`](crate::run_folder::RunFolder) of it while the run lasts.
    pub fn checkpoint(mut self, dir: impl Into<PathBuf>) -> Settings {
        self.checkpoint = Some(dir.into());
        self
    }

    /// Also scores the test split after every epoch, into
    /// [`Summary::test_curve`](super::Summary::test_curve) (sets the field of that name).
    pub fn test_curve(mut self) -> Settings {
        self.test_curve = true;
        self
    }

    /// Stops the run after `patience` epochs in a row without a better dev score (early
    /// stopping); the best epoch stays in `best/`.
    pub fn patience(self, patience: usize) -> Settings {
        self.stop_when(move |e| e.epoch.saturating_sub(e.best_epoch) >= patience)
    }

    /// Stops the run after the first epoch where `stop` holds (see [`EpochHook`]).
    pub fn stop_when(mut self, stop: impl Fn(&EpochEnd) -> bool + Send + Sync + 'static) -> Settings {
        self.on_epoch = Some(Arc::new(move |e| if stop(e) { Next::Stop } else { Next::Continue }));
        self
    }

    /// Checks a learning-rate decay (see [`Settings::lr_decay`]): a factor above 0 and at most 1;
    /// an error names it as `what` (a flag, a setting).
    pub fn check_lr_decay(what: &str, decay: f32) -> Result<()> {
        if decay.is_finite() && decay > 0.0 && decay <= 1.0 {
            return Ok(());
        }
        Err(Error::input(what, "a factor above 0 and at most 1", decay.to_string()))
    }

    /// Multiplies the learning rate by `decay` after every epoch: epoch `e` trains at
    /// `decay^(e − 1)` times the optimizer's rates ([`Settings::check_lr_decay`] says which
    /// factors make sense).
    pub fn lr_decay(mut self, decay: f32) -> Settings {
        self.lr_schedule = Some(Arc::new(move |epoch| decay.powi(epoch.saturating_sub(1) as i32)));
        self
    }
}
