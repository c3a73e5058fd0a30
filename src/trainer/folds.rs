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
}

/// The folds of `len` examples: fold `k` holds every `folds`-th example of an order drawn from
/// `seed`, from the `k`-th on.
pub fn fold_indices(len: usize, folds: usize, seed: u64) -> Result<Vec<Vec<usize>>> {
    if folds < 2 || folds > len {
        return Err(Error::input(
            "cross-validation folds",
            format!("between 2 and the number of examples ({len})"),
            folds.to_string(),
        ));
    }
    let order = super::epoch_order(len, &mut Rng::new(seed));
    Ok((0..folds).map(|k| order.iter().copied().skip(k).step_by(folds).collect()).collect())
}

/// `folds`-fold cross-validation over `data` (folds drawn from `seed`, see [`fold_indices`]):
/// for each fold `k`, the run `new_run(k)` makes trains on the other folds for `plan`'s epochs
/// with no dev split, and the model its last epoch left is scored on fold `k`. With
/// `plan.checkpoint`, fold `k`'s run keeps its checkpoints in its `fold-k` folder there (see
/// [`fold_dir`]), its metadata saying which fold it held out (`fold`, `folds`, `fold_seed`), so
/// the fold's score can be reproduced from it. `events` hears each fold's run (with its fold).
pub fn cross_validate<L, E>(
    data: &[E],
    folds: usize,
    seed: u64,
    plan: &Settings,
    new_run: &mut dyn FnMut(usize) -> Result<Run<L>>,
    events: &mut dyn FnMut(usize, Event),
) -> Result<CvResult>
where
    L: Learner<E>,
    E: Clone + Sync,
    Run<L>: Send,
{
    let held = fold_indices(data.len(), folds, seed)?;
    let mut fold_of = vec![0; data.len()];
    for (k, fold) in held.iter().enumerate() {
        fold.iter().for_each(|&i| fold_of[i] = k);
    }
    let (mut fold_scores, mut seconds, mut seen) = (Vec::with_capacity(folds), 0.0, 0);
    for (k, fold) in held.iter().enumerate() {
        let train: Vec<E> = (0..data.len()).filter(|&i| fold_of[i] != k).map(|i| data[i].clone()).collect();
        let test: Vec<E> = fold.iter().map(|&i| data[i].clone()).collect();
        let mut run = new_run(k)?;
        let splits = Splits { train: &train, dev: &[], test: &test };
        let mut meta = if plan.meta.is_object() { plan.meta.clone() } else { json!({}) };
        (meta["fold"], meta["folds"], meta["fold_seed"]) = (json!(k), json!(folds), json!(seed));
        let checkpoint = plan.checkpoint.as_deref().map(|dir| fold_dir(dir, k));
        let plan = Settings { checkpoint, meta, ..plan.clone() };
        let summary = fit_threads(&mut run, 1, DEFAULT_TIMEOUT, splits, &plan, &mut |e| events(k, e))?;
        (seconds, seen) = (seconds + summary.train_seconds, seen + summary.sentences);
        fold_scores.push(run.test_acc);
    }
    let mean = fold_scores.iter().sum::<f64>() / folds as f64;
    let std = (fold_scores.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / folds as f64).sqrt();
    Ok(CvResult { fold_scores, mean, std, examples_per_s: seen as f64 / seconds.max(1e-9) })
}

/// Where fold `k` of a cross-validation keeps its checkpoints in `dir`.
pub fn fold_dir(dir: &Path, k: usize) -> PathBuf {
    dir.join(format!("fold-{k}"))
}
