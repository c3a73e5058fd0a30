//! Training-loop mechanics on the CPU backend: loss scaling (for half-precision products), where
//! a power-of-two scale changes no gradient and a step whose scaled gradients overflow is
//! skipped with the scale halved; minibatches scheduled ahead, which change nothing; and a
//! moving average of the weights, which is scored while the trained values go on training.

use arbor::data::{synthetic, TreeExample, PAD};
use arbor::layers::LossOn;
use arbor::loss_scale::LossScaler;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::{Classifier, Readout};
use arbor::trainer::{fit_threads, Run, Settings, Splits};
use arbor::{nn, train, InputGraph};
use std::time::Duration;

fn model(seed: u64) -> Classifier {
    let mut rng = Rng::new(seed);
    let cell = nn::tree_lstm(8, 8).unwrap();
    Classifier::new(cell, synthetic::vocab().len(), Some(PAD), synthetic::CLASSES, &mut rng).unwrap()
}

fn params(m: &Classifier) -> Vec<Vec<f32>> {
    m.tensors().unwrap().into_iter().map(|(_, _, values)| values).collect()
}

/// Ten steps with a loss scale of 2^12 give bitwise the parameters of ten unscaled steps.
#[test]
fn a_power_of_two_scale_changes_nothing() {
    let data = synthetic::generate(40, 8, 3);
    let batches: Vec<Vec<&TreeExample>> = data.chunks(4).map(|c| c.iter().collect()).collect();
    let run = |scale: Option<LossScaler>| {
        let mut m = model(7);
        m.loss_scale = scale;
        let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
        for b in &batches {
            m.train_step(b, LossOn::All, &mut opt, Some(5.0)).unwrap();
        }
        (params(&m), m.loss_scale)
    };
    let (plain, _) = run(None);
    let (scaled, scaler) = run(Some(LossScaler::new(4096.0, 0)));
    assert_eq!(scaler.map(|s| (s.scale(), s.skipped())), Some((4096.0, 0)));
    assert_eq!(plain, scaled);
}

/// Gradients that overflow once scaled skip the step: the parameters stay as they were and
/// the scale halves; the next step with a finite gradient is applied.
#[test]
fn an_overflowing_step_is_skipped_and_the_scale_halves() {
    let data = synthetic::generate(4, 8, 5);
    let examples: Vec<&TreeExample> = data.iter().collect();
    let mut m = model(3);
    m.loss_scale = Some(LossScaler::new(2f32.powi(100), 0));
    let mut opt = Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 0.1));
    let before = params(&m);
    let graphs: Vec<&InputGraph> = examples.iter().map(|e| &e.graph).collect();
    let words: Vec<u32> = examples.iter().flat_map(|e| e.words.iter().copied()).collect();
    let labels: Vec<u32> = examples.iter().flat_map(|e| e.labels.iter().copied()).collect();
    let targets = LossOn::All.select(&graphs, &labels).unwrap();
    let out = m.output_pass(&graphs, &words, Readout::Vertices(&targets), None).unwrap();
    let huge: Vec<f32> = out.push_grad.iter().map(|g| g * 1e30).collect();
    let (cell, embedding) = m.input_pass(&huge, out.push_rows.as_deref()).unwrap();
    assert!(cell.iter().flatten().any(|x| !x.is_finite()), "the scaled backward pass overflowed");
    let mut grads = train::StepGrads { stats: out.stats, cell, classifier: out.classifier, embedding };
    assert!(!m.apply(&mut grads, &mut opt, None).unwrap(), "the step was applied");
    assert_eq!(params(&m), before);
    let scaler = m.loss_scale.unwrap();
    assert_eq!((scaler.scale(), scaler.skipped()), (2f32.powi(99), 1));

    m.train_step(&examples, LossOn::All, &mut opt, None).unwrap();
    assert_ne!(params(&m), before, "a finite step is applied");
}

/// Training minibatches with each one scheduled while the one before runs gives bitwise the
/// parameters and numbers of plain steps.
#[test]
fn planning_ahead_changes_nothing() {
    let data = synthetic::generate(30, 8, 11);
    let batches: Vec<Vec<&TreeExample>> = data.chunks(4).map(|c| c.iter().collect()).collect();
    let (mut plain, mut ahead) = (model(5), model(5));
    let (mut opt_plain, mut opt_ahead) =
        (Optimizer::new(Config::new(Rule::Adagrad, 0.05)), Optimizer::new(Config::new(Rule::Adagrad, 0.05)));
    let want: Vec<_> =
        batches.iter().map(|b| plain.train_step(b, LossOn::Root, &mut opt_plain, Some(5.0)).unwrap()).collect();
    let mut got = Vec::new();
    ahead.train_batches(&batches, LossOn::Root, &mut opt_ahead, Some(5.0), &mut |s, _| got.push(*s)).unwrap();
    assert_eq!(got, want);
    assert_eq!(params(&ahead), params(&plain));
}

/// A run that averages its weights trains bitwise as one that does not, on one worker or two;
/// its dev scores are the average's, and `best/` holds the average of the best epoch.
#[test]
fn a_weight_average_is_scored_while_training_goes_on_unchanged() {
    let data = synthetic::generate(150, 8, 13);
    let splits = Splits { train: &data[..100], dev: &data[100..125], test: &data[125..] };
    let dir = std::env::temp_dir().join(format!("arbor-average-{}", std::process::id()));
    let plan = Settings::new(3, 10).checkpoint(&dir);
    let fit = |average: Option<f32>, workers: usize| {
        let mut run = Run::new(model(5), Optimizer::new(Config::new(Rule::Adam, 0.02)), &Rng::new(2));
        if let Some(decay) = average {
            run = run.with_average(decay).unwrap();
        }
        let summary = fit_threads(&mut run, workers, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();
        (run, summary)
    };
    let (plain, plain_summary) = fit(None, 1);
    let (averaged, summary) = fit(Some(0.9), 1);
    assert_eq!(params(&averaged.model), params(&plain.model), "averaging changed training");
    let avg = averaged.average.as_ref().expect("the run averages");
    let trained = params(&averaged.model);
    assert!(avg.tensors().iter().zip(&trained).any(|(a, t)| a.2 != *t), "the average is the last step");
    // Scored: the model restored from the average gives the last epoch's dev accuracy.
    let mut scored = model(5);
    scored.restore(avg.as_model()).unwrap();
    assert_eq!(Some(scored.accuracy(splits.dev, 256).unwrap()), summary.dev_curve.last().copied());
    assert_ne!(summary.dev_curve, plain_summary.dev_curve, "the dev scores are the trained values'");
    // Kept: `best/` holds the average of the best epoch, whose dev accuracy is the best.
    let best = arbor::checkpoint::Checkpoint::load(&dir.join("best")).unwrap();
    let mut kept = model(5);
    kept.restore(&best).unwrap();
    assert_eq!(kept.accuracy(splits.dev, 256).unwrap(), averaged.best_dev);
    assert_eq!(kept.accuracy(splits.test, 256).unwrap(), averaged.test_acc);
    // Two workers keep the same average.
    let (two, _) = fit(Some(0.9), 2);
    let close = two
        .average
        .unwrap()
        .tensors()
        .iter()
        .zip(avg.tensors())
        .all(|(a, b)| a.2.iter().zip(&b.2).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs())));
    assert!(close, "two workers' average differs from one's");
    std::fs::remove_dir_all(&dir).ok();
}

/// A one-layer [`Model`](arbor::model::Model) reading every vertex of labelled trees trains as
/// the [`Classifier`] with the same values does: both divide a minibatch's summed loss by its
/// labelled vertices ([`AsExample::terms`](arbor::model::AsExample::terms)), so plain SGD, which
/// feels the loss's scale, takes the same steps and reports the same losses.
#[test]
fn a_model_reading_every_vertex_trains_as_the_classifier() {
    use arbor::data::labelled::Labelled;
    use arbor::head::softmax_classifier;
    use arbor::model::{Feed, Model};
    use arbor::readout::Readout as ModelReadout;
    use arbor::CpuBackend;

    let data = synthetic::generate(60, 8, 21);
    let labelled = Labelled::all(&data, LossOn::All, synthetic::CLASSES);
    let plan = Settings { clip: None, ..Settings::new(2, 6) };
    let sgd = || Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 0.5));
    let classifier = model(7);
    let mut m = Model::init(
        &CpuBackend::new(),
        classifier.embed.clone(),
        nn::tree_lstm(8, 8).unwrap(),
        vec![Feed::Words],
        softmax_classifier(8, synthetic::CLASSES).unwrap(),
        &mut Rng::new(0),
    )
    .unwrap()
    .with_readout(ModelReadout::Vertices);
    m.cells[0].set_params(&classifier.engine.params().unwrap()).unwrap();
    m.head.engine().set_params(&classifier.out.params().unwrap()).unwrap();

    let mut one = Run::new(classifier, sgd(), &Rng::new(4));
    let splits = Splits { train: &data[..40], dev: &data[40..50], test: &data[50..] };
    let expected = fit_threads(&mut one, 1, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();
    let mut run = Run::new(m, sgd(), &Rng::new(4));
    let splits = Splits { train: &labelled[..40], dev: &labelled[40..50], test: &labelled[50..] };
    let got = fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();

    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * (1.0 + b.abs());
    assert!(
        got.loss_curve.iter().zip(&expected.loss_curve).all(|(&a, &b)| close(a, b)),
        "losses {:?}, the classifier's {:?}",
        got.loss_curve,
        expected.loss_curve
    );
    let classifier = one.model;
    let trained = [classifier.engine.params().unwrap(), classifier.out.params().unwrap()];
    let mine = [run.model.cells[0].params().unwrap(), run.model.head.params().unwrap()];
    for (a, b) in mine.iter().flatten().flatten().zip(trained.iter().flatten().flatten()) {
        assert!(close(f64::from(*a), f64::from(*b)), "parameter {a}, the classifier's {b}");
    }
    let (a, b) = (run.model.embedding.table(), classifier.embed.table());
    assert!(a.iter().zip(b).all(|(x, y)| close(f64::from(*x), f64::from(*y))), "word vectors differ");
}

/// Epoch hooks: a run stops after the epoch its hook says, `patience` stops after that many
/// epochs without a better dev score, and a learning-rate schedule of 0 from epoch 2 leaves the
/// weights of epoch 1; a resumed run asks the hook again and trains nothing after a stop.
#[test]
fn epoch_hooks_stop_a_run_and_schedule_its_learning_rate() {
    use arbor::trainer::{EpochEnd, Next};
    let data = synthetic::generate(60, 8, 21);
    let splits = Splits { train: &data[..40], dev: &data[40..50], test: &data[50..] };
    let fit = |plan: &Settings| {
        let mut run = Run::new(model(7), Optimizer::new(Config::new(Rule::Adam, 0.02)), &Rng::new(3));
        let summary = fit_threads(&mut run, 1, Duration::from_secs(60), splits, plan, &mut |_| {}).unwrap();
        (run, summary)
    };
    let (run, summary) = fit(&Settings::new(10, 10).stop_when(|e| e.epoch == 3));
    assert_eq!((summary.loss_curve.len(), run.pos.epoch, run.pos.steps), (3, 4, 12));
    assert_eq!(run.last_epoch.map(|e| e.epoch), Some(3));
    // Resumed from that state, the hook is asked again before anything is trained.
    let (mut again, plan) = (run, Settings::new(10, 10).stop_when(|e| e.epoch == 3));
    let summary = fit_threads(&mut again, 1, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();
    assert!(summary.loss_curve.is_empty() && again.pos.steps == 12);
    let patience = Settings::new(10, 10).patience(2);
    let hook = patience.on_epoch.as_ref().unwrap();
    let end = |epoch, best_epoch| EpochEnd { epoch, loss: 0.1, dev: 0.5, best_dev: 0.6, best_epoch };
    assert_eq!((hook(&end(4, 3)), hook(&end(5, 3)), hook(&end(2, 0))), (Next::Continue, Next::Stop, Next::Stop));
    // A rate of 0 from epoch 2: two epochs leave the weights one epoch trained.
    let (one, _) = fit(&Settings::new(1, 10));
    let frozen =
        Settings { lr_schedule: Some(std::sync::Arc::new(|e| if e >= 2 { 0.0 } else { 1.0 })), ..Settings::new(2, 10) };
    let (two, _) = fit(&frozen);
    assert_eq!(one.model.tensors().unwrap(), two.model.tensors().unwrap());
    let (decayed, _) = fit(&Settings::new(2, 10).lr_decay(0.5));
    let (plain, _) = fit(&Settings::new(2, 10));
    assert_ne!(decayed.model.tensors().unwrap(), plain.model.tensors().unwrap());
    assert_eq!(fit(&Settings::new(2, 10).lr_decay(1.0)).0.model.tensors().unwrap(), plain.model.tensors().unwrap());
}

/// A run whose settings record nothing about the model (`Settings::new`) still writes
/// checkpoints that hold its position, so a run resumes from them.
#[test]
fn checkpoints_of_default_settings_resume() {
    let data = synthetic::generate(40, 8, 22);
    let splits = Splits { train: &data[..30], dev: &data[30..], test: &data[30..] };
    let dir = std::env::temp_dir().join(format!("arbor-default-settings-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let plan = Settings::new(1, 10).checkpoint(&dir);
    let fresh = || Run::new(model(8), Optimizer::new(Config::new(Rule::Adam, 0.02)), &Rng::new(4));
    let mut run = fresh();
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();
    let mut resumed = fresh();
    resumed.resume(&arbor::checkpoint::Checkpoint::load(&dir.join("last")).unwrap(), &plan.meta).unwrap();
    assert_eq!((resumed.pos, resumed.best_epoch), (run.pos, run.best_epoch));
    std::fs::remove_dir_all(&dir).ok();
}
