//! Cross-validation: a fresh [`Run`] per fold, trained on the other folds through the one loop
//! and scored on its own fold, for any model.

use super::{fit_threads, Event, Learner, Run, Settings, Splits};
use crate::dist::DEFAULT_TIMEOUT;
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;
use serde_json::json;
use std::path::{Path, PathBuf};

/// Cross-validated scores.
#[derive(Clone, Debug, PartialEq)]
pub struct CvResult {
    /// Each fold's held-out score (the first of [`Learner::score`]: an accuracy for a
    /// classifier).
    pub fold_scores: Vec<f64>,
    /// Their mean.
    pub mean: f64,
    /// Their standard deviation.
    pub std: f64,
    /// Examples trained on per second of training steps.
    pub examples_per_s: f64,
    /// With [`Settings::test_curve`]: the mean over the folds (and an ensemble's members) of
    /// one run's held-out score after each epoch (as long as the shortest run; empty without).
    pub curve: Vec<f64>,
    /// With an ensemble ([`Folds::members`] above 1): the mean over the folds of its members'
    /// own held-out scores, each model alone, beside [`CvResult::mean`] of the pooled ones;
    /// none with one member.
    pub member_mean: Option<f64>,
}

/// How a cross-validation deals its folds and how many runs each fold trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Folds {
    /// Folds (at least 2, at most one per example).
    pub count: usize,
    /// Seed of the order the folds are dealt from ([`fold_indices`]).
    pub seed: u64,
    /// Runs trained per fold, each from its own start, whose models are scored together as an
    /// ensemble (1: one model, scored alone).
    pub members: usize,
}

/// Scores one fold's held-out examples with the models of its runs together (an ensemble's
/// members, as trained), returning the main score.
pub type FoldPool<'a, L, E> = dyn FnMut(&mut [Run<L>], &[E]) -> Result<f64> + 'a;

impl CvResult {
    /// The epoch (from 0) whose mean held-out score in [`CvResult::curve`] is highest, and that
    /// mean (the first such epoch); none without a curve. This chooses the epoch on the held-out
    /// folds themselves — the protocol behind published graph-classification tables such as
    /// GIN's (Xu et al., 2019), and optimistic: [`CvResult::mean`] chooses nothing.
    pub fn best_epoch(&self) -> Option<(usize, f64)> {
        self.curve.iter().copied().enumerate().fold(None, |best, (e, m)| match best {
            Some((_, b)) if b >= m => best,
            _ => Some((e, m)),
        })
    }
}

/// The folds of examples of the classes (or other strata) `strata`, one per example: an order
/// is drawn from `seed`, put class by class (keeping the drawn order within each), and dealt
/// round the folds, so every fold holds each class in proportion (stratified folds, as the
/// graph-classification literature deals them). With a single class, fold `k` holds every
/// `folds`-th example of the drawn order, from the `k`-th on.
pub fn fold_indices(strata: &[u32], folds: usize, seed: u64) -> Result<Vec<Vec<usize>>> {
    let len = strata.len();
    if folds < 2 || folds > len {
        return Err(Error::input(
            "cross-validation folds",
            format!("between 2 and the number of examples ({len})"),
            folds.to_string(),
        ));
    }
    let mut order = super::epoch_order(len, &mut Rng::new(seed));
    order.sort_by_key(|&i| strata[i]);
    Ok((0..folds).map(|k| order.iter().copied().skip(k).step_by(folds).collect()).collect())
}

/// Cross-validation over `data` in `folds.count` folds (drawn from `folds.seed`, each holding the
/// examples' `strata` in proportion, see [`fold_indices`]): for each fold `k`, the run
/// `new_run(k, 0)` makes trains on the other folds for `plan`'s epochs with no dev split, and the
/// model its last epoch left is scored on fold `k`. With `folds.members` above 1, the runs
/// `new_run(k, 0)`, `new_run(k, 1)`, … each train so, and `pool` scores fold `k` with their
/// models together (an ensemble; required then). With `plan.checkpoint`, fold `k`'s run keeps
/// its checkpoints in its `fold-k` folder there (see [`fold_dir`]; an ensemble's member `m` in
/// `fold-k/member-m`, see [`member_dir`]), its metadata saying which fold it held out (`fold`,
/// `folds`, `fold_seed`, `stratified`: whether the strata differ, `member` and `members`), so
/// the fold's score can be reproduced from it. `events` hears each fold's run (with its fold).
pub fn cross_validate<L, E>(
    data: &[E],
    strata: &[u32],
    folds: Folds,
    plan: &Settings,
    new_run: &mut dyn FnMut(usize, usize) -> Result<Run<L>>,
    pool: Option<&mut FoldPool<'_, L, E>>,
    events: &mut dyn FnMut(usize, Event),
) -> Result<CvResult>
where
    L: Learner<E>,
    E: Clone + Sync,
    Run<L>: Send,
{
    if strata.len() != data.len() {
        let expected = format!("one stratum per example ({})", data.len());
        return Err(Error::input("cross-validation strata", expected, strata.len().to_string()));
    }
    let Folds { count, seed, members } = folds;
    let mut pool = match (members, pool) {
        (0, _) => return Err(Error::input("ensemble members per fold", "at least 1", "0")),
        (1, _) => None,
        (_, None) => {
            return Err(Error::input("ensemble members per fold", "1 (no way to pool them given)", members.to_string()))
        }
        (_, Some(pool)) => Some(pool),
    };
    let held = fold_indices(strata, count, seed)?;
    let mut fold_of = vec![0; data.len()];
    for (k, fold) in held.iter().enumerate() {
        fold.iter().for_each(|&i| fold_of[i] = k);
    }
    let (mut fold_scores, mut seconds, mut seen) = (Vec::with_capacity(count), 0.0, 0);
    let (mut curves, mut member_scores) = (Vec::with_capacity(count * members), Vec::with_capacity(count * members));
    for (k, fold) in held.iter().enumerate() {
        let train: Vec<E> = (0..data.len()).filter(|&i| fold_of[i] != k).map(|i| data[i].clone()).collect();
        let test: Vec<E> = fold.iter().map(|&i| data[i].clone()).collect();
        let splits = Splits { train: &train, dev: &[], test: &test };
        let mut meta = if plan.meta.is_object() { plan.meta.clone() } else { json!({}) };
        (meta["fold"], meta["folds"], meta["fold_seed"]) = (json!(k), json!(count), json!(seed));
        meta["stratified"] = json!(strata.iter().any(|&s| s != strata[0]));
        let fold_ck = plan.checkpoint.as_deref().map(|dir| fold_dir(dir, k));
        let mut runs = Vec::with_capacity(members);
        for member in 0..members {
            let checkpoint =
                fold_ck.as_deref().map(|d| if members > 1 { member_dir(d, member) } else { d.to_path_buf() });
            (meta["member"], meta["members"]) = (json!(member), json!(members));
            let plan = Settings { checkpoint, meta: meta.clone(), ..plan.clone() };
            let mut run = new_run(k, member)?;
            let summary = fit_threads(&mut run, 1, DEFAULT_TIMEOUT, splits, &plan, &mut |e| events(k, e))?;
            (seconds, seen) = (seconds + summary.train_seconds, seen + summary.sentences);
            member_scores.push(run.test_acc);
            curves.push(summary.test_curve);
            runs.push(run);
        }
        fold_scores.push(match pool.as_mut() {
            Some(pool) => pool(&mut runs, &test)?,
            None => runs[0].test_acc,
        });
    }
    let mean_of = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let epochs = curves.iter().map(Vec::len).min().unwrap_or(0);
    let curve = (0..epochs).map(|e| mean_of(&curves.iter().map(|c| c[e]).collect::<Vec<_>>())).collect();
    let mean = mean_of(&fold_scores);
    let std = (fold_scores.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / count as f64).sqrt();
    let member_mean = (members > 1).then(|| mean_of(&member_scores));
    let examples_per_s = seen as f64 / seconds.max(1e-9);
    Ok(CvResult { fold_scores, mean, std, examples_per_s, curve, member_mean })
}

/// Where fold `k` of a cross-validation keeps its checkpoints in `dir`.
pub fn fold_dir(dir: &Path, k: usize) -> PathBuf {
    dir.join(format!("fold-{k}"))
}

/// Where member `m` of an ensemble keeps its checkpoints in its fold's folder `fold`.
pub fn member_dir(fold: &Path, m: usize) -> PathBuf {
    fold.join(format!("member-{m}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Folds partition the examples; stratified, each holds every class in proportion (within
    /// one); with one stratum they are the plain folds of the drawn order.
    #[test]
    fn folds_partition_and_stratify() {
        let strata: Vec<u32> = (0..50).map(|i| u32::from(i % 5 == 0)).collect();
        let held = fold_indices(&strata, 4, 9).expect("4 folds of 50");
        let mut all: Vec<usize> = held.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..50).collect::<Vec<_>>());
        for fold in &held {
            let ones = fold.iter().filter(|&&i| strata[i] == 1).count();
            assert!((2..=3).contains(&ones), "10 of class 1 over 4 folds: {ones} in {fold:?}");
        }
        let plain = fold_indices(&[7; 50], 4, 9).expect("4 folds of 50");
        let order = crate::trainer::epoch_order(50, &mut Rng::new(9));
        assert_eq!(plain[1], order.iter().copied().skip(1).step_by(4).collect::<Vec<_>>());
        assert!(fold_indices(&[0; 3], 4, 9).is_err());
    }

    /// The best epoch of a held-out curve is its highest mean, the first of equals; none
    /// without a curve.
    #[test]
    fn best_epoch_is_the_first_highest_mean() {
        let cv = |curve: Vec<f64>| CvResult {
            fold_scores: vec![],
            mean: 0.0,
            std: 0.0,
            examples_per_s: 0.0,
            curve,
            member_mean: None,
        };
        assert_eq!(cv(vec![0.5, 0.75, 0.625, 0.75]).best_epoch(), Some((1, 0.75)));
        assert_eq!(cv(vec![0.5]).best_epoch(), Some((0, 0.5)));
        assert_eq!(cv(vec![]).best_epoch(), None);
    }
}
