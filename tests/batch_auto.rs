//! An automatic batch size (`Settings::batch_auto`, `arbor train --batch auto`): the step that
//! measures the gradient noise updates as a plain step does and measures what the two
//! micro-batches' gradients say; a run changes its batch only where a decision is due, scales
//! the learning rate by the square-root rule, reports the trajectory, and resumed from a
//! checkpoint goes on exactly as the uninterrupted run.

use arbor::checkpoint::Checkpoint;
use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, TreeExample};
use arbor::layers::LossOn;
use arbor::model::{AsExample, Example, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{AutoBatch, Run, Settings, Splits};
use arbor::{nn, CpuBackend};

fn model(seed: u64) -> Model<CpuBackend> {
    let mut rng = Rng::new(seed);
    let cell = nn::tree_lstm(8, 8).expect("cell");
    arbor::zoo::tree_classifier(cell, synthetic::vocab().len(), synthetic::CLASSES, LossOn::All, &mut rng)
        .expect("model")
}

fn labelled(data: &[TreeExample]) -> Vec<Labelled<'_>> {
    Labelled::all(data, LossOn::All, synthetic::CLASSES)
}

fn values(m: &Model<CpuBackend>) -> Vec<f32> {
    m.tensors().expect("tensors").into_iter().flat_map(|(_, _, v)| v).collect()
}

fn relative(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    (d / b.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>()).sqrt()
}

/// The squared norm of every gradient of `examples` (loss divided by `denom`), from a copy.
fn squared_norm(m: &Model<CpuBackend>, examples: &[Example<'_>], denom: usize) -> f64 {
    let mut copy = m.replica().expect("a replica");
    let g = copy.gradients(examples, denom, None).expect("gradients");
    let dense = g.cells.iter().flatten().chain(&g.head).flatten();
    dense.chain(&g.words.values).map(|v| f64::from(*v).powi(2)).sum()
}

/// A measured step updates as the plain step on the whole minibatch does (to the order of the
/// micro-batches' sums), and its measurement is the micro-batches' and the minibatch's squared
/// gradient norms, each micro-batch's rescaled to its own mean.
#[test]
fn a_measured_step_updates_as_a_plain_step_and_measures_both_sizes() {
    let data = synthetic::generate(20, 8, 3);
    let data = labelled(&data);
    let examples: Vec<Example<'_>> = data.iter().map(Labelled::example).collect();
    let terms: Vec<usize> = data.iter().map(AsExample::terms).collect();
    let denom: usize = terms.iter().sum();
    let (mut measured, mut plain) = (model(1), model(1));
    let config = Config::new(Rule::Adam, 0.01);
    let stats = measured.step_measured(&examples, &terms, &mut Optimizer::new(config), None, 0).expect("a step");
    let mut grads = plain.gradients(&examples, denom, None).expect("gradients");
    plain.apply(&mut grads, &mut Optimizer::new(config), None).expect("a step");
    let rel = relative(&values(&measured), &values(&plain));
    assert!(rel < 1e-6, "the measured step's update differs by {rel}");
    assert_ne!(values(&measured), values(&model(1)), "nothing trained");
    let noise = stats.noise.expect("a measurement");
    let whole = squared_norm(&model(1), &examples, denom);
    assert!((noise.big - whole).abs() <= 1e-5 * whole, "{} vs {whole}", noise.big);
    let halves = [Model::<CpuBackend>::share(&examples, 0, 2), Model::<CpuBackend>::share(&examples, 1, 2)];
    let mut small = 0.0;
    let mut inv = 0.0;
    for h in halves {
        let mine: usize = terms[h.clone()].iter().sum();
        small += squared_norm(&model(1), &examples[h], mine) / 2.0;
        inv += 1.0 / mine as f64 / 2.0;
    }
    assert!((noise.small - small).abs() <= 1e-4 * small, "{} vs {small}", noise.small);
    assert!((noise.inv_small - inv).abs() < 1e-12 && noise.terms == denom as f64);
    assert!(noise.small > noise.big, "two micro-batches' gradients are noisier than their sum's");
    // Loss terms that do not match the examples are refused, not indexed past.
    let short = measured.step_measured(&examples, &terms[..3], &mut Optimizer::new(config), None, 1);
    assert!(short.is_err_and(|e| e.to_string().contains("one count per example")));
    // One example: stepped whole, nothing measured.
    let one = measured.step_measured(&examples[..1], &terms[..1], &mut Optimizer::new(config), None, 1);
    assert_eq!(one.expect("a step").noise, None);
}

fn auto() -> AutoBatch {
    AutoBatch { base: 8, min: 2, max: 32, pass_seconds: 4e-3, example_seconds: 1e-4, every: 5 }
}

/// Trains with an automatic batch size to `max_steps` (checkpointed in `dir`), resumed from
/// `dir` if asked; returns the run and the batch trajectory it reported.
fn fit(dir: &std::path::Path, max_steps: Option<u64>, resume: bool) -> (Run<Model<CpuBackend>>, Vec<(u64, usize)>) {
    let data = synthetic::generate(120, 8, 5);
    let data = labelled(&data);
    let splits = Splits { train: &data[..90], dev: &data[90..], test: &data[90..] };
    let plan = Settings { batch_auto: Some(auto()), max_steps, ..Settings::new(3, 8).checkpoint(dir) };
    let mut run = Run::new(model(2), Optimizer::new(Config::new(Rule::Adam, 0.01)), &Rng::new(7));
    if resume {
        let ck = Checkpoint::load(&dir.join("last")).expect("a checkpoint");
        run.resume(&ck, &plan.meta).expect("resumes");
    }
    let summary = run.fit_local(splits, &plan).expect("trains");
    (run, summary.batch_trajectory)
}

/// The batch moves only on decision steps, by at most a factor of 2, within the bounds, starting
/// at the base; the learning rate follows it; and a run stopped and resumed mid-epoch ends bitwise
/// where the uninterrupted run does, with the same trajectory.
#[test]
fn the_batch_moves_on_decisions_and_a_resumed_run_goes_on_alike() {
    let root = std::env::temp_dir().join(format!("arbor-batch-auto-{}", std::process::id()));
    std::fs::remove_dir_all(&root).ok();
    let (straight, trajectory) = fit(&root.join("a"), None, false);
    assert_eq!(trajectory.first(), Some(&(0, 8)), "{trajectory:?}");
    assert!(trajectory.len() > 1, "the batch never moved: {trajectory:?}");
    for w in trajectory.windows(2) {
        let ((_, a), (step, b)) = (w[0], w[1]);
        assert!(step % 5 == 0 && a != b && b <= 2 * a && 2 * b >= a && (2..=32).contains(&b), "{trajectory:?}");
    }
    let last = trajectory.last().expect("a batch").1;
    let factor = straight.optimizer().lr_factor;
    assert!((factor - (last as f32 / 8.0).sqrt()).abs() < 1e-6, "learning rate × {factor} at batch {last}");
    let steps = straight.position().steps;
    fit(&root.join("b"), Some(steps / 2 + 3), false);
    let (resumed, again) = fit(&root.join("b"), None, true);
    assert_eq!(again, trajectory, "the resumed run's batches");
    assert_eq!(resumed.position(), straight.position());
    assert!(values(resumed.model()) == values(straight.model()), "the resumed run ends elsewhere");
    std::fs::remove_dir_all(&root).ok();
}

/// An automatic batch size is refused where it cannot measure one model's gradient noise.
#[test]
fn an_automatic_batch_needs_one_worker() {
    let data = synthetic::generate(20, 8, 5);
    let data = labelled(&data);
    let splits = Splits { train: &data, dev: &data, test: &data };
    let plan = Settings { batch_auto: Some(auto()), ..Settings::new(1, 8) };
    let mut run = Run::new(model(2), Optimizer::new(Config::new(Rule::Adam, 0.01)), &Rng::new(7));
    let err = arbor::trainer::fit_threads(&mut run, 2, std::time::Duration::from_secs(30), splits, &plan, &mut |_| {});
    let msg = err.expect_err("two workers").to_string();
    assert!(msg.contains("one worker"), "{msg}");
}
