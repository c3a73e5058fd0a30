//! Ensembles: several trained classifiers scored together, each example's class chosen by the
//! members' mean probabilities (as in cross-validation with `--ensemble K`).

use crate::model::{AsExample, Model, Outputs};
use crate::trainer::{Run, Scores};
use crate::Backend;
use arbor_core::error::{Error, Result};

/// The members' outputs over the same data pooled: `name`'s rows of `width` class scores
/// (logits) become the logarithm of the members' mean softmax, so that their arg-max is the
/// class the ensemble's mean probability picks; every other output is the first member's.
pub fn pool_logits(members: &[Outputs], name: &str, width: usize) -> Result<Outputs> {
    let Some(first) = members.first() else {
        return Err(Error::input("an ensemble's outputs", "at least one member's", "none"));
    };
    let len = first.get(name)?.len();
    if width == 0 || len % width != 0 {
        return Err(Error::input(
            format!("head output `{name}`"),
            format!("rows of {width} class scores"),
            len.to_string(),
        ));
    }
    let mut mean = vec![0f64; len];
    for (m, outputs) in members.iter().enumerate() {
        let logits = outputs.get(name)?;
        if logits.len() != len {
            let expected = format!("{len} values, as the first member's");
            return Err(Error::input(format!("member {m}'s `{name}`"), expected, logits.len().to_string()));
        }
        for (row, sum) in logits.chunks(width).zip(mean.chunks_mut(width)) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f64> = row.iter().map(|&x| f64::from(x - max).exp()).collect();
            let total: f64 = exps.iter().sum();
            sum.iter_mut().zip(&exps).for_each(|(s, e)| *s += e / total);
        }
    }
    let count = members.len() as f64;
    let mut pooled = first.clone();
    pooled.set(name, mean.iter().map(|p| (p / count).ln() as f32).collect())?;
    Ok(pooled)
}

/// The scores on `data` ([`AsExample::score`]) of models whose head's outputs over it are
/// `members`: their `logits` pooled by [`pool_logits`], a row per example.
pub fn score_pooled<E: AsExample>(members: &[Outputs], data: &[E]) -> Result<Scores> {
    let len = members.first().map_or(Ok(0), |m| m.get("logits").map(<[f32]>::len))?;
    let width = if data.is_empty() { 1 } else { len / data.len() };
    E::score(&pool_logits(members, "logits", width)?, data)
}

/// The scores on `data` of the models of `runs` together ([`score_pooled`]): each run's model as
/// the run scores it (its weight average, where it keeps one).
pub fn score_runs<B: Backend, E: AsExample>(runs: &mut [Run<Model<B>>], data: &[E]) -> Result<Scores> {
    let members = runs.iter_mut().map(|run| run.averaged(|run| run.model_mut().infer_all(data)));
    score_pooled(&members.collect::<Result<Vec<_>>>()?, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outputs(logits: Vec<f32>) -> Outputs {
        let mut out = Outputs::named(vec!["loss".into(), "logits".into()]);
        out.extend(vec![vec![0.5; logits.len() / 2], logits]);
        out
    }

    /// The pooled scores are the log of the members' mean probabilities: a member sure of one
    /// class outvotes two that lean the other way a little, two that lean one way outvote one
    /// less sure of the other; one member pools to its own log-softmax; members that disagree
    /// in length, no members and rows that do not divide the values are refused.
    #[test]
    fn pooling_averages_probabilities() {
        let sure = outputs(vec![0.0, 6.0, 1.0, 0.0]);
        let lean = outputs(vec![0.3, 0.0, 0.0, 1.0]);
        let pooled = pool_logits(&[sure.clone(), lean.clone(), lean.clone()], "logits", 2).expect("three members");
        let p = pooled.get("logits").expect("pooled logits");
        let probs = |row: &[f32]| -> Vec<f64> {
            let e: Vec<f64> = row.iter().map(|&x| f64::from(x).exp()).collect();
            e.iter().map(|x| x / e.iter().sum::<f64>()).collect()
        };
        let expect = |k: usize, c: usize| {
            let rows = [[0.0, 6.0, 1.0, 0.0], [0.3, 0.0, 0.0, 1.0], [0.3, 0.0, 0.0, 1.0]];
            rows.iter().map(|r| probs(&r[2 * k..2 * k + 2])[c]).sum::<f64>() / 3.0
        };
        for (k, c) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            assert!((f64::from(p[2 * k + c]).exp() - expect(k, c)).abs() < 1e-6, "row {k} class {c}: {p:?}");
        }
        assert!(p[1] > p[0], "the sure member outvotes the two leaning ones: {p:?}");
        assert!(p[3] > p[2], "second row: two members leaning to class 1 outvote one as sure of 0: {p:?}");
        assert_eq!(pooled.get("loss").expect("loss kept"), sure.get("loss").expect("loss"));
        let alone = pool_logits(std::slice::from_ref(&lean), "logits", 2).expect("one member");
        assert!((f64::from(alone.get("logits").expect("logits")[0]) - (0.3 - (0.3f64.exp() + 1.0).ln())).abs() < 1e-6);
        assert!(pool_logits(&[sure, outputs(vec![0.0; 6])], "logits", 2).is_err());
        assert!(pool_logits(&[], "logits", 2).is_err());
        assert!(pool_logits(&[lean], "logits", 3).is_err());
    }
}
