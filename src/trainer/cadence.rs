//! When a run snapshots `last/` between epochs' ends: every fixed number of steps, or — as
//! CheckFreq (Mohan et al., FAST 2021) chooses it — as often as a bound on the snapshots' share
//! of training time allows, from step and snapshot times measured online and retuned after
//! every snapshot — kept in checkpoints, so a resumed run goes on at the interval it had.

use crate::dist::Collective;
use arbor_core::error::{Error, Result};
use serde_json::{json, Value};

/// How often `last/` is snapshotted between epochs' ends ([`Settings::checkpoint_every`](super::Settings::checkpoint_every)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Every {
    /// Every this many optimizer steps.
    Steps(u64),
    /// As often as keeps the snapshots' time within this fraction of the training steps' time
    /// (CheckFreq's bound is 0.035): the first snapshot comes a few steps in, to measure its
    /// cost — the steps' stall while it is taken and its write in the background, which shares
    /// the cores with training — and each one retunes the interval to the times measured so far. A pipeline plans
    /// its windows of steps an epoch ahead: it snapshots where the plan had the next one, then
    /// at the end of the window the retuned one falls in.
    Auto(f64),
}

/// Steps before an automatic cadence's first snapshot: the first steps' times are measured.
const FIRST: u64 = 5;

/// Weight of the newest measurement in the running step and snapshot times.
const NEWEST: f64 = 0.5;

/// What an automatic cadence had measured and chosen at its last snapshot: kept in checkpoints
/// (`checkpoint_cadence`) so that a resumed run starts from it instead of measuring afresh.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Tuned {
    /// The interval chosen.
    pub(crate) interval: u64,
    /// Running seconds per step and per snapshot.
    pub(crate) step_seconds: f64,
    pub(crate) snapshot_seconds: f64,
}

impl Tuned {
    /// As a checkpoint records it.
    pub(crate) fn to_json(self) -> Value {
        json!({"interval": self.interval, "step_seconds": self.step_seconds, "snapshot_seconds": self.snapshot_seconds})
    }

    /// As a checkpoint recorded it; `None` for a checkpoint without one (or a malformed one:
    /// the cadence then measures afresh).
    pub(crate) fn from_json(v: &Value) -> Option<Tuned> {
        let seconds = |key: &str| v[key].as_f64().filter(|s| s.is_finite() && *s >= 0.0);
        Some(Tuned {
            interval: v["interval"].as_u64().filter(|&n| n > 0)?,
            step_seconds: seconds("step_seconds")?,
            snapshot_seconds: seconds("snapshot_seconds")?,
        })
    }
}

/// The cadence of one run (the same on every worker: their times are pooled at each snapshot).
#[derive(Clone, Debug)]
pub(crate) struct Cadence {
    every: Option<Every>,
    /// The step after which the next automatic snapshot is due.
    next: u64,
    /// The interval chosen last (automatic cadences).
    interval: Option<u64>,
    /// Running seconds per step and per snapshot.
    step_seconds: Option<f64>,
    snapshot_seconds: Option<f64>,
    /// Seconds spent in snapshots between epochs' ends.
    pub(crate) spent: f64,
    /// Seconds of training steps, and of the other checkpoints written meanwhile (`best/`),
    /// whose share of the bound the snapshots leave them.
    trained: f64,
    others: f64,
}

impl Cadence {
    /// The cadence `every` asks for, of a run at step `steps` — an automatic one going on from
    /// `tuned` where a resumed run had it (its next snapshot an interval on); an error for an
    /// automatic bound that is not a fraction above 0.
    pub(crate) fn new(every: Option<Every>, steps: u64, tuned: Option<Tuned>) -> Result<Cadence> {
        if let Some(Every::Auto(bound)) = every {
            if !(bound > 0.0 && bound < 1.0) {
                let got = bound.to_string();
                return Err(Error::input("checkpoint overhead bound", "a fraction of the step time in (0, 1)", got));
            }
        }
        let mut c = Cadence {
            every,
            next: steps + FIRST,
            interval: None,
            step_seconds: None,
            snapshot_seconds: None,
            spent: 0.0,
            trained: 0.0,
            others: 0.0,
        };
        if let (Some(Every::Auto(_)), Some(t)) = (every, tuned) {
            c.next = steps + t.interval;
            c.interval = Some(t.interval);
            c.step_seconds = Some(t.step_seconds);
            c.snapshot_seconds = Some(t.snapshot_seconds);
        }
        Ok(c)
    }

    /// What an automatic cadence has measured and chosen, once it has chosen.
    pub(crate) fn tuned(&self) -> Option<Tuned> {
        match (self.every, self.interval, self.step_seconds, self.snapshot_seconds) {
            (Some(Every::Auto(_)), Some(interval), Some(step_seconds), Some(snapshot_seconds)) => {
                Some(Tuned { interval, step_seconds, snapshot_seconds })
            }
            _ => None,
        }
    }

    /// Whether a snapshot is due after `steps` steps.
    pub(crate) fn due(&self, steps: u64) -> bool {
        match self.every {
            Some(Every::Steps(n)) => n > 0 && steps.is_multiple_of(n),
            Some(Every::Auto(_)) => steps >= self.next,
            None => false,
        }
    }

    /// Whether `last/` is written at an epoch's end after `steps` steps: always, but under an
    /// automatic cadence only where its next snapshot is due.
    pub(crate) fn due_at_epoch_end(&self, steps: u64) -> bool {
        !matches!(self.every, Some(Every::Auto(_))) || self.due(steps)
    }

    /// Whether a window of steps planned ahead (a pipeline's) ends after `steps` steps: where a
    /// snapshot is due, or where the automatic cadence's next is planned now.
    pub(crate) fn boundary(&self, steps: u64) -> bool {
        match self.every {
            Some(Every::Auto(_)) => steps == self.next,
            _ => self.due(steps),
        }
    }

    /// Records `steps` training steps that took `seconds`.
    pub(crate) fn stepped(&mut self, steps: usize, seconds: f64) {
        if steps > 0 {
            self.step_seconds = Some(blend(self.step_seconds, seconds / steps as f64));
            self.trained += seconds;
        }
    }

    /// Records another checkpoint's write (`best/`) that took `seconds`: an automatic cadence
    /// leaves such writes their share of the bound, snapshotting less often.
    pub(crate) fn charged(&mut self, seconds: f64) {
        self.others += seconds;
    }

    /// Records a snapshot after `steps` steps that took `seconds` on this worker, and for an
    /// automatic cadence sets the next: the times of all workers are pooled (`coll`), so every
    /// worker chooses the same.
    pub(crate) fn snapshotted(&mut self, coll: &mut dyn Collective, steps: u64, seconds: f64) -> Result<()> {
        self.spent += seconds;
        let Some(Every::Auto(bound)) = self.every else { return Ok(()) };
        // Summed over workers: the snapshots' cost as a whole, the mean step time, the other
        // checkpoints' writes' share.
        let others = if self.trained > 0.0 { self.others / self.trained } else { 0.0 };
        let mut times = [seconds as f32, self.step_seconds.unwrap_or(0.0) as f32, others as f32];
        coll.all_reduce_sum(&mut times)?;
        let size = coll.size().max(1) as f64;
        self.snapshot_seconds = Some(blend(self.snapshot_seconds, f64::from(times[0])));
        let step = f64::from(times[1]) / size;
        // What the other writes leave of the bound (their shares summed over the workers, as
        // one of them writes them), a quarter of it at least.
        let left = (bound - f64::from(times[2])).max(bound / 4.0);
        let interval = interval(self.snapshot_seconds.unwrap_or(0.0), step, left);
        self.interval = Some(interval);
        self.next = steps + interval;
        Ok(())
    }

    /// The interval an automatic cadence chose last, or the fixed one.
    pub(crate) fn interval(&self) -> Option<u64> {
        match self.every {
            Some(Every::Steps(n)) => Some(n),
            Some(Every::Auto(_)) => self.interval,
            None => None,
        }
    }
}

/// The running value after `x`.
fn blend(old: Option<f64>, x: f64) -> f64 {
    old.map_or(x, |o| NEWEST * x + (1.0 - NEWEST) * o)
}

/// The fewest steps between snapshots of `snapshot` seconds each that keeps them within `bound`
/// of the time of steps of `step` seconds (at least 1).
pub(crate) fn interval(snapshot: f64, step: f64, bound: f64) -> u64 {
    if step <= 0.0 || !step.is_finite() || !snapshot.is_finite() {
        return 1;
    }
    (snapshot / (bound * step)).ceil().clamp(1.0, u64::MAX as f64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::ThreadCollective;
    use std::time::Duration;

    #[test]
    fn an_automatic_cadence_writes_an_epochs_end_only_when_due() {
        let mut c = Cadence::new(Some(Every::Auto(0.05)), 100, None).expect("a bound");
        assert!(!c.due_at_epoch_end(103) && c.due_at_epoch_end(105), "the first snapshot comes 5 steps in");
        c.next = 300;
        assert!(!c.due_at_epoch_end(299) && c.due_at_epoch_end(300));
        let fixed = Cadence::new(Some(Every::Steps(7)), 0, None).expect("fixed");
        assert!(fixed.due_at_epoch_end(3) && Cadence::new(None, 0, None).expect("none").due_at_epoch_end(3));
    }

    #[test]
    fn the_interval_keeps_the_overhead_within_the_bound() {
        // A 10 ms snapshot over 2 ms steps within 3.5 %: every 143 steps (142 would be 3.52 %).
        assert_eq!(interval(0.010, 0.002, 0.035), 143);
        assert_eq!(interval(0.0, 0.002, 0.035), 1, "a free snapshot every step");
        assert_eq!(interval(0.010, 0.0, 0.035), 1, "no step time measured yet");
    }

    #[test]
    fn an_automatic_cadence_retunes_after_each_snapshot() {
        let mut coll = ThreadCollective::group(1, Duration::from_secs(1)).pop().expect("one worker");
        let mut c = Cadence::new(Some(Every::Auto(0.05)), 100, None).expect("a bound");
        assert!(!c.due(104) && c.due(105), "the first snapshot a few steps in");
        c.stepped(5, 0.05); // 10 ms a step
        c.snapshotted(&mut coll, 105, 0.0102).expect("one worker");
        assert_eq!(c.interval(), Some(21), "10.2 ms snapshots within 5 % of 10 ms steps");
        assert!(!c.due(125) && c.due(126));
        // Snapshots grow slower: the running time (the newest weighs half, 20.1 ms) moves it.
        c.snapshotted(&mut coll, 126, 0.03).expect("one worker");
        assert_eq!(c.interval(), Some(41));
        assert!((c.spent - 0.0402).abs() < 1e-9);
        let fixed = Cadence::new(Some(Every::Steps(7)), 0, None).expect("fixed");
        assert!(fixed.due(14) && !fixed.due(15) && fixed.interval() == Some(7));
        assert!(Cadence::new(Some(Every::Auto(0.0)), 0, None).is_err());
        assert!(Cadence::new(Some(Every::Auto(f64::NAN)), 0, None).is_err());
    }

    #[test]
    fn a_resumed_cadence_goes_on_at_its_interval() {
        let mut coll = ThreadCollective::group(1, Duration::from_secs(1)).pop().expect("one worker");
        let mut c = Cadence::new(Some(Every::Auto(0.05)), 100, None).expect("a bound");
        assert_eq!(c.tuned(), None, "nothing chosen before the first snapshot");
        c.stepped(5, 0.05);
        c.snapshotted(&mut coll, 105, 0.0102).expect("one worker");
        let tuned = c.tuned().expect("chosen");
        assert_eq!(Tuned::from_json(&tuned.to_json()), Some(tuned));
        // Resumed at step 300: the next snapshot an interval on, not a few steps in.
        let resumed = Cadence::new(Some(Every::Auto(0.05)), 300, Some(tuned)).expect("a bound");
        assert_eq!(resumed.interval(), Some(21));
        assert!(!resumed.due(305) && !resumed.due(320) && resumed.due(321));
        // A fixed cadence ignores it; a malformed record is none.
        assert_eq!(Cadence::new(Some(Every::Steps(7)), 300, Some(tuned)).expect("fixed").interval(), Some(7));
        assert_eq!(Tuned::from_json(&json!({"interval": 0, "step_seconds": 1.0, "snapshot_seconds": 1.0})), None);
    }
}
