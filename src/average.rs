//! Weight averaging: an exponential moving average of a model's learned tensors, kept beside the
//! trained values and used in their place to score (Polyak averaging). An epoch's last iterates
//! scatter around a minimum as the step noise moves them; their average sits nearer its middle,
//! so dev and test scores are higher and vary less from epoch to epoch.
//!
//! ```
//! use arbor::average::Average;
//!
//! let mut avg = Average::new(0.9)?;
//! avg.update(0, &[("w".into(), vec![1], vec![1.0])])?;
//! avg.update(1, &[("w".into(), vec![1], vec![3.0])])?;
//! // Early steps are averaged evenly (the decay starts low), later ones at `decay`.
//! assert!((avg.tensors()[0].2[0] - 1.0 - 2.0 * (1.0 - 2.0 / 11.0)).abs() < 1e-6);
//! # Ok::<(), arbor::Error>(())
//! ```

use crate::checkpoint::{Checkpoint, Named};
use arbor_core::error::{Error, Result};
use arbor_ops::cpu::optim::average_on_team;

/// The name prefix of the averaged tensors in a checkpoint (`avg.embedding`, `avg.cell.W`, …).
const PREFIX: &str = "avg.";

/// An exponential moving average of named tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct Average {
    /// How much of the average a step keeps (0.999: about the last thousand steps).
    decay: f32,
    /// The averages as a checkpoint of the model's own tensors (to restore a model from); no
    /// tensors before the first update, nor while the model keeps them.
    model: Checkpoint,
    /// Whether the model keeps the averages beside its tensors (`Learned::average_in_place`).
    kept: bool,
}

impl Average {
    /// An empty average with `decay` in `[0, 1)`.
    pub fn new(decay: f32) -> Result<Average> {
        if !(0.0..1.0).contains(&decay) {
            return Err(Error::input("a weight average's decay", "a value in [0, 1)", decay.to_string()));
        }
        Ok(Average { decay, model: Checkpoint { tensors: Vec::new(), meta: serde_json::Value::Null }, kept: false })
    }

    /// The decay it was made with.
    pub fn decay(&self) -> f32 {
        self.decay
    }

    /// The averaged tensors kept here (empty before the first update, and while the model keeps
    /// them: `Run::average_tensors` reads them wherever they are).
    pub fn tensors(&self) -> &[Named] {
        &self.model.tensors
    }

    /// Folds in the values `current` (owned, as [`Named`], or lent) after optimizer step `step`
    /// (from 0). The decay of step `t` is `min(decay, (1 + t) / (10 + t))`, so the first steps
    /// (and their random start) do not linger in the average. An error names a tensor whose size
    /// changed, and changes nothing.
    pub fn update<T: AsRef<[f32]>>(&mut self, step: u64, current: &[(String, Vec<usize>, T)]) -> Result<()> {
        let keep = self.keep_at(step);
        let averages = &mut self.model.tensors;
        if averages.is_empty() {
            *averages = current.iter().map(|(n, s, v)| (n.clone(), s.clone(), v.as_ref().to_vec())).collect();
            return Ok(());
        }
        let same = averages.len() == current.len()
            && averages.iter().zip(current).all(|(a, c)| a.0 == c.0 && a.2.len() == c.2.as_ref().len());
        if !same {
            let was = averages.iter().map(|(n, s, _)| format!("{n} {s:?}")).collect::<Vec<_>>().join(", ");
            let now = current.iter().map(|(n, s, _)| format!("{n} {s:?}")).collect::<Vec<_>>().join(", ");
            return Err(Error::input("a weight average's tensors", was, now));
        }
        // In pieces shared out between the CPU team's threads, as the optimizer's updates are.
        for ((_, _, avg), (_, _, now)) in averages.iter_mut().zip(current) {
            average_on_team(avg, now.as_ref(), keep);
        }
        Ok(())
    }

    /// How much of the average the update after step `step` keeps: `min(decay, (1 + t) / (10 +
    /// t))`.
    pub fn keep_at(&self, step: u64) -> f32 {
        let t = step as f32;
        self.decay.min((1.0 + t) / (10.0 + t))
    }

    /// Notes that the model keeps the averages beside its tensors from now on (it updated them
    /// in place): the ones here are dropped.
    pub fn kept_by_model(&mut self) {
        self.kept = true;
        self.model.tensors.clear();
    }

    /// Whether the model keeps the averages ([`Average::kept_by_model`]).
    pub fn is_kept_by_model(&self) -> bool {
        self.kept
    }

    /// Whether the average has begun (here or in the model).
    pub fn begun(&self) -> bool {
        self.kept || !self.model.tensors.is_empty()
    }

    /// The averages as a checkpoint of the model's own tensors (to restore a model from).
    pub fn as_model(&self) -> &Checkpoint {
        &self.model
    }

    /// `averages` under `avg.`-prefixed names, for a checkpoint beside the model's tensors.
    pub fn named(averages: &[Named]) -> Vec<Named> {
        averages.iter().map(|(n, s, v)| (format!("{PREFIX}{n}"), s.clone(), v.clone())).collect()
    }

    /// The weights a run with an average scores, from a checkpoint of it: each of the model's
    /// tensors replaced by its average where `ck` holds one (a `last/` written with an average
    /// that has begun; `best/` holds the average as the model's own tensors already).
    pub fn scored_weights(ck: &Checkpoint) -> Checkpoint {
        let averaged = |name: &str| ck.tensor(&format!("{PREFIX}{name}")).ok();
        let tensors = ck
            .tensors
            .iter()
            .filter(|(n, _, _)| !n.starts_with(PREFIX))
            .map(|(n, s, v)| (n.clone(), s.clone(), averaged(n).map_or_else(|| v.clone(), <[f32]>::to_vec)))
            .collect();
        Checkpoint { tensors, meta: ck.meta.clone() }
    }

    /// Takes the averages saved by [`Average::named`] from `ck`, one for each of the model's
    /// tensors `like` (an error names a missing one); with none saved, the average is empty.
    pub fn restore(&mut self, ck: &Checkpoint, like: &[Named]) -> Result<()> {
        self.kept = false;
        if !ck.tensors.iter().any(|(n, _, _)| n.starts_with(PREFIX)) {
            self.model.tensors.clear();
            return Ok(());
        }
        self.model.tensors = like
            .iter()
            .map(|(n, s, v)| Ok((n.clone(), s.clone(), ck.sized(&format!("{PREFIX}{n}"), v.len())?)))
            .collect::<Result<_>>()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(values: &[f32]) -> Vec<Named> {
        vec![("w".into(), vec![values.len()], values.to_vec())]
    }

    /// Each step moves the average `1 − min(decay, (1 + t) / (10 + t))` of the way to the new
    /// values: the first update copies them.
    #[test]
    fn the_average_follows_the_formula() {
        let mut avg = Average::new(0.5).unwrap();
        let mut want = 0.0f64;
        for t in 0..20u64 {
            let x = (t as f32 * 0.7).sin();
            avg.update(t, &one(&[x, 2.0 * x])).unwrap();
            let keep = if t == 0 { 0.0 } else { 0.5f64.min((1.0 + t as f64) / (10.0 + t as f64)) };
            want += (1.0 - keep) * (f64::from(x) - want);
            let got = &avg.tensors()[0].2;
            assert!((f64::from(got[0]) - want).abs() < 1e-6 && (f64::from(got[1]) - 2.0 * want).abs() < 2e-6);
        }
    }

    #[test]
    fn another_shape_or_decay_is_refused() {
        assert!(Average::new(1.0).is_err() && Average::new(-0.1).is_err() && Average::new(f32::NAN).is_err());
        let mut avg = Average::new(0.9).unwrap();
        avg.update(0, &one(&[1.0, 2.0])).unwrap();
        let err = avg.update(1, &one(&[1.0])).unwrap_err().to_string();
        assert!(err.contains("w [2]") && err.contains("w [1]"), "{err}");
        assert_eq!(avg.tensors()[0].2, [1.0, 2.0], "a refused update changed the average");
    }

    /// The averages saved beside a model's tensors come back; a checkpoint without them empties
    /// the average, and one with some missing is refused.
    #[test]
    fn averages_round_trip_through_a_checkpoint() {
        let mut avg = Average::new(0.9).unwrap();
        avg.update(0, &one(&[1.0, 2.0])).unwrap();
        avg.update(1, &one(&[3.0, 5.0])).unwrap();
        let mut tensors = one(&[7.0, 7.0]);
        tensors.extend(Average::named(avg.tensors()));
        let ck = Checkpoint { tensors, meta: serde_json::Value::Null };
        let mut back = Average::new(0.9).unwrap();
        back.restore(&ck, &one(&[0.0, 0.0])).unwrap();
        assert_eq!(back, avg);
        back.restore(&Checkpoint { tensors: one(&[7.0, 7.0]), meta: serde_json::Value::Null }, &one(&[0.0, 0.0]))
            .unwrap();
        assert!(back.tensors().is_empty());
        let err = back.restore(&ck, &[("v".into(), vec![2], vec![0.0; 2])]).unwrap_err().to_string();
        assert!(err.contains("avg.v"), "{err}");
    }
}
