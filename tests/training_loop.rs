//! Training-loop mechanics on the CPU backend: loss scaling (for half-precision products), where
//! a power-of-two scale changes no gradient and a step whose scaled gradients overflow is
//! skipped with the scale halved; minibatches scheduled ahead, which change nothing; and a
//! moving average of the weights, which is scored while the trained values go on training.

use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, TreeExample, PAD};
use arbor::layers::LossOn;
use arbor::loss_scale::LossScaler;
use arbor::model::{AsExample, Example, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::run_folder::{Existing, RunFolder};
use arbor::trainer::{fit_threads, Run, Settings, Splits};
use arbor::{nn, CpuBackend, InputGraph};
use std::time::Duration;

/// A Tree-LSTM classifier of the synthetic treebank reading the vertices that `loss_on` puts
/// the loss on.
fn model_on(seed: u64, loss_on: LossOn) -> Model<CpuBackend> {
    let mut rng = Rng::new(seed);
    let cell = nn::tree_lstm(8, 8).unwrap();
    arbor::zoo::tree_classifier(cell, synthetic::vocab().len(), synthetic::CLASSES, loss_on, &mut rng).unwrap()
}

/// [`model_on`] with the loss on every vertex.
fn model(seed: u64) -> Model<CpuBackend> {
    model_on(seed, LossOn::All)
}

fn params(m: &Model<CpuBackend>) -> Vec<Vec<f32>> {
    m.tensors().unwrap().into_iter().map(|(_, _, values)| values).collect()
}

/// Every tree of `data` with the loss on every vertex.
fn labelled(data: &[TreeExample]) -> Vec<Labelled<'_>> {
    Labelled::all(data, LossOn::All, synthetic::CLASSES)
}

/// One optimizer step on `batch` as the training loop takes it: the loss summed over the
/// minibatch divided by its loss-carrying vertices. Returns the head's outputs.
fn step(m: &mut Model<CpuBackend>, batch: &[Labelled<'_>], opt: &mut Optimizer, clip: Option<f32>) -> Vec<Vec<f32>> {
    let examples: Vec<Example<'_>> = batch.iter().map(Labelled::example).collect();
    let denom = batch.iter().map(AsExample::terms).sum();
    let mut grads = m.gradients(&examples, denom, None).unwrap();
    assert!(m.apply(&mut grads, opt, clip).unwrap(), "the step was skipped");
    grads.outputs
}

/// Ten steps with a loss scale of 2^12 give bitwise the parameters of ten unscaled steps.
#[test]
fn a_power_of_two_scale_changes_nothing() {
    let data = synthetic::generate(40, 8, 3);
    let data = labelled(&data);
    let run = |scale: Option<LossScaler>| {
        let mut m = model(7);
        if let Some(scale) = scale {
            m = m.with_loss_scale(scale);
        }
        let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
        for b in data.chunks(4) {
            step(&mut m, b, &mut opt, Some(5.0));
        }
        (params(&m), m.loss_scale())
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
    let data = labelled(&data);
    let mut m = model(3);
    m = m.with_loss_scale(LossScaler::new(2f32.powi(100), 0));
    let mut opt = Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 0.1));
    let before = params(&m);
    // Targets of 1e30 (in place of 1) give the gradient entering the backward pass, scaled by
    // 2^100, a size no f32 holds.
    let huge: Vec<Example<'_>> = data
        .iter()
        .map(|e| {
            let mut e = e.example();
            e.target.iter_mut().for_each(|t| *t *= 1e30);
            e
        })
        .collect();
    let denom = data.iter().map(AsExample::terms).sum();
    let unscaled = model(3).gradients(&huge, denom, None).unwrap();
    assert!(unscaled.cells.iter().flatten().flatten().all(|x| x.is_finite()), "unscaled, the gradients are finite");
    let mut grads = m.gradients(&huge, denom, None).unwrap();
    assert!(grads.cells.iter().flatten().flatten().any(|x| !x.is_finite()), "the scaled backward pass overflowed");
    assert!(!m.apply(&mut grads, &mut opt, None).unwrap(), "the step was applied");
    assert_eq!(params(&m), before);
    let scaler = m.loss_scale().unwrap();
    assert_eq!((scaler.scale(), scaler.skipped()), (2f32.powi(99), 1));

    step(&mut m, &data, &mut opt, None);
    assert_ne!(params(&m), before, "a finite step is applied");
}

/// Training minibatches with each one scheduled while the one before runs gives bitwise the
/// parameters and numbers of plain steps.
#[test]
fn planning_ahead_changes_nothing() {
    let data = synthetic::generate(30, 8, 11);
    let root = Labelled::all(&data, LossOn::Root, synthetic::CLASSES);
    let batches: Vec<&[Labelled<'_>]> = root.chunks(4).collect();
    let (mut plain, mut ahead) = (model_on(5, LossOn::Root), model_on(5, LossOn::Root));
    let (mut opt_plain, mut opt_ahead) =
        (Optimizer::new(Config::new(Rule::Adagrad, 0.05)), Optimizer::new(Config::new(Rule::Adagrad, 0.05)));
    let want: Vec<_> = batches.iter().map(|b| step(&mut plain, b, &mut opt_plain, Some(5.0))).collect();
    let mut got = Vec::new();
    let graphs = |k: usize| Ok(batches[k].iter().map(|e| &e.tree.graph).collect::<Vec<&InputGraph>>());
    arbor::trainer::plan_each(&ahead.planner(), batches.len(), &graphs, &mut |k, planned| {
        let examples: Vec<Example<'_>> = batches[k].iter().map(Labelled::example).collect();
        let denom = batches[k].iter().map(AsExample::terms).sum();
        let mut grads = ahead.gradients(&examples, denom, Some(planned))?;
        assert!(ahead.apply(&mut grads, &mut opt_ahead, Some(5.0))?);
        got.push(grads.outputs);
        Ok(true)
    })
    .unwrap();
    assert_eq!(got, want);
    assert_eq!(params(&ahead), params(&plain));
}

/// A run that averages its weights trains bitwise as one that does not, on one worker or two;
/// its dev scores are the average's, and `best/` holds the average of the best epoch.
#[test]
fn a_weight_average_is_scored_while_training_goes_on_unchanged() {
    let data = synthetic::generate(150, 8, 13);
    let data = labelled(&data);
    let splits = Splits { train: &data[..100], dev: &data[100..125], test: &data[125..] };
    let dir = std::env::temp_dir().join(format!("arbor-average-{}", std::process::id()));
    let plan = Settings::new(3, 10).checkpoint(&dir);
    let fit = |average: Option<f32>, workers: usize| {
        // Each run replaces the one before in the folder.
        let _folder = RunFolder::claim(&dir, Existing::Overwrite).unwrap();
        let mut run = Run::new(model(5), Optimizer::new(Config::new(Rule::Adam, 0.02)), &Rng::new(2));
        if let Some(decay) = average {
            run = run.with_average(decay).unwrap();
        }
        let summary = fit_threads(&mut run, workers, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();
        (run, summary)
    };
    // Root accuracy: the score that picks the best epoch.
    let accuracy = |m: &mut Model<CpuBackend>, data: &[Labelled<'_>]| {
        let scores = m.score(data).unwrap();
        assert_eq!(scores[0].0, "root_accuracy");
        scores[0].1
    };
    let (plain, plain_summary) = fit(None, 1);
    let (averaged, summary) = fit(Some(0.9), 1);
    assert_eq!(params(averaged.model()), params(plain.model()), "averaging changed training");
    assert!(averaged.average().is_some_and(|a| a.begun()), "the run averages");
    let avg = averaged.average_tensors().unwrap();
    let trained = params(averaged.model());
    assert!(avg.iter().zip(&trained).any(|(a, t)| a.2 != *t), "the average is the last step");
    // Scored: the model restored from the average gives the last epoch's dev accuracy.
    let mut scored = model(5);
    scored.restore(&arbor::checkpoint::Checkpoint { tensors: avg.clone(), meta: serde_json::Value::Null }).unwrap();
    assert_eq!(Some(accuracy(&mut scored, splits.dev)), summary.dev_curve.last().copied());
    assert_ne!(summary.dev_curve, plain_summary.dev_curve, "the dev scores are the trained values'");
    // Kept: `best/` holds the average of the best epoch, whose dev accuracy is the best.
    let best = arbor::checkpoint::Checkpoint::load(&dir.join("best")).unwrap();
    let mut kept = model(5);
    kept.restore(&best).unwrap();
    assert_eq!(accuracy(&mut kept, splits.dev), averaged.best_dev());
    assert_eq!(accuracy(&mut kept, splits.test), averaged.test_acc());
    // Two workers keep the same average.
    let (two, _) = fit(Some(0.9), 2);
    let two = two.average_tensors().unwrap();
    assert_eq!(two.len(), avg.len());
    let close =
        two.iter().zip(&avg).all(|(a, b)| a.2.iter().zip(&b.2).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs())));
    assert!(close, "two workers' average differs from one's");
    std::fs::remove_dir_all(&dir).ok();
}

/// The preset classifier reading every vertex is the model one assembles by hand (the same
/// draws: word vectors with the padding row, cell, head), and the one training loop trains it
/// on the mean loss over each minibatch's labelled vertices
/// ([`AsExample::terms`](arbor::model::AsExample::terms)): plain SGD, which feels the loss's
/// scale, takes bitwise the steps and reports bitwise the losses of a loop by hand that draws
/// the same orders and divides each minibatch's summed loss by the labelled vertices counted
/// from the labels.
#[test]
fn a_model_reading_every_vertex_trains_on_the_mean_over_labelled_vertices() {
    use arbor::head::softmax_classifier;
    use arbor::layers::Embedding;
    use arbor::model::Feed;
    use arbor::readout::Readout;
    use arbor::trainer::epoch_order;

    let classes = synthetic::CLASSES;
    let data = synthetic::generate(60, 8, 21);
    let all = labelled(&data);
    let plan = Settings { clip: None, ..Settings::new(2, 6) };
    let sgd = || Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 0.5));
    let preset = model(7);
    let mut rng = Rng::new(7);
    let words = Embedding::new(synthetic::vocab().len(), 8, 0.1, &mut rng).with_padding(PAD);
    let cell = nn::tree_lstm(8, 8).unwrap();
    let head = softmax_classifier(8, classes).unwrap();
    let mut by_hand = Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)
        .unwrap()
        .with_readout(Readout::Vertices);
    assert_eq!(params(&by_hand), params(&preset), "the preset draws other values");

    let mut run = Run::new(preset, sgd(), &Rng::new(4));
    let train = 40;
    let splits = Splits { train: &all[..train], dev: &all[40..50], test: &all[50..] };
    let got = fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();

    let mut opt = sgd();
    let mut order_rng = Rng::new(4);
    let mut losses = Vec::new();
    // Minibatches where the mean over labelled vertices is the mean over examples.
    let mut alike = 0;
    for _ in 0..plan.epochs {
        let order = epoch_order(train, &mut order_rng);
        let mut sum = 0.0;
        for chunk in order.chunks(plan.batch) {
            let examples: Vec<Example<'_>> = chunk.iter().map(|&i| all[i].example()).collect();
            let labelled: usize =
                chunk.iter().map(|&i| data[i].labels.iter().filter(|&&l| (l as usize) < classes).count()).sum();
            alike += usize::from(labelled == chunk.len());
            let mut grads = by_hand.gradients(&examples, labelled, None).unwrap();
            let loss: f32 = grads.outputs[by_hand.head().loss_output()].iter().sum();
            sum += f64::from(loss / labelled as f32);
            assert!(by_hand.apply(&mut grads, &mut opt, None).unwrap());
        }
        losses.push(sum / order.chunks(plan.batch).len() as f64);
    }
    assert_eq!(alike, 0, "a minibatch of one labelled vertex per tree tells the two means apart");
    assert_eq!(got.loss_curve, losses, "the run's losses");
    assert_eq!(params(run.model()), params(&by_hand), "the run's steps");
}

/// Epoch hooks: a run stops after the epoch its hook says, `patience` stops after that many
/// epochs without a better dev score, and a learning-rate schedule of 0 from epoch 2 leaves the
/// weights of epoch 1; a resumed run asks the hook again and trains nothing after a stop.
/// Targets that do not fit the readout are refused before anything runs, and a target per vertex
/// under the root readout says which readout it needs; a batch size of 0 is refused, not taken
/// as 1.
#[test]
fn targets_that_miss_the_readout_and_a_batch_of_zero_are_refused() {
    let data = synthetic::generate(8, 6, 3);
    let all = labelled(&data);
    // A model reading the roots, given a target per vertex (`LossOn::All` examples).
    let mut roots = model_on(3, LossOn::Root);
    let before = params(&roots);
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
    let examples: Vec<Example<'_>> = all.iter().map(|e| e.example()).collect();
    let e = roots.step(&examples, &mut opt, None).unwrap_err().to_string();
    assert!(e.contains("target of example 0 of the minibatch") && e.contains("readout `root`"), "{e}");
    assert!(e.contains("Model::with_readout(Readout::Vertices)"), "{e}");
    assert_eq!(params(&roots), before, "nothing trained");
    // A root target of the wrong width, without the hint.
    let at_roots = Labelled::all(&data, LossOn::Root, synthetic::CLASSES);
    let (fine, mut short) = (at_roots[0].example(), at_roots[1].example());
    short.target.pop();
    let e = roots.step(&[fine, short], &mut opt, None).unwrap_err().to_string();
    assert!(e.contains("target of example 1") && !e.contains("with_readout"), "{e}");
    let mut run = Run::new(model(3), Optimizer::new(Config::new(Rule::Adam, 0.01)), &Rng::new(3));
    let e = run.fit_local(Splits { train: &all, dev: &all, test: &all }, &Settings::new(1, 0)).unwrap_err();
    assert!(e.to_string().contains("batch size: expected at least 1 example, got 0"), "{e}");
    let e = run.fit_local(Splits { train: &all, dev: &all, test: &all }, &Settings::new(0, 4)).unwrap_err();
    assert!(e.to_string().contains("epochs: expected at least 1"), "{e}");
}

/// Optimizer settings no update can follow — a learning rate that is not a number, from the
/// start or from a schedule, a negative weight decay — end a step or a run with an error naming
/// them, and change no parameter (a NaN rate once panicked inside the engine's update).
#[test]
fn optimizer_settings_no_update_can_follow_are_refused() {
    let data = synthetic::generate(8, 6, 3);
    let all = labelled(&data);
    let examples: Vec<Example<'_>> = all.iter().map(|e| e.example()).collect();
    let mut m = model(3);
    let before = params(&m);
    for (config, named) in [
        (Config::new(Rule::Adam, f32::NAN), "learning rate of the optimizer"),
        (Config::new(Rule::Sgd { momentum: 0.0 }, f32::NAN), "learning rate of the optimizer"),
        (Config { weight_decay: -0.1, ..Config::new(Rule::Adagrad, 0.1) }, "weight decay of the optimizer"),
    ] {
        let e = m.step(&examples, &mut Optimizer::new(config), None).unwrap_err().to_string();
        assert!(e.contains(named), "{e}");
    }
    let e =
        m.step(&examples, &mut Optimizer::new(Config::new(Rule::Adam, 0.1)).with_lr("embedding", f32::INFINITY), None);
    assert!(e.unwrap_err().to_string().contains("learning rate of tensor `embedding`"));
    assert_eq!(params(&m), before, "nothing trained");
    let mut run = Run::new(model(3), Optimizer::new(Config::new(Rule::Adam, 0.01)), &Rng::new(3));
    let plan = Settings { lr_schedule: Some(std::sync::Arc::new(|_| f32::NAN)), ..Settings::new(2, 4) };
    let e = run.fit_local(Splits { train: &all, dev: &all, test: &all }, &plan).unwrap_err().to_string();
    assert!(e.contains("learning-rate factor"), "{e}");
}

#[test]
fn epoch_hooks_stop_a_run_and_schedule_its_learning_rate() {
    use arbor::trainer::{EpochEnd, Next};
    let data = synthetic::generate(60, 8, 21);
    let data = labelled(&data);
    let splits = Splits { train: &data[..40], dev: &data[40..50], test: &data[50..] };
    let fit = |plan: &Settings| {
        let mut run = Run::new(model(7), Optimizer::new(Config::new(Rule::Adam, 0.02)), &Rng::new(3));
        let summary = fit_threads(&mut run, 1, Duration::from_secs(60), splits, plan, &mut |_| {}).unwrap();
        (run, summary)
    };
    let (run, summary) = fit(&Settings::new(10, 10).stop_when(|e| e.epoch == 3));
    assert_eq!((summary.loss_curve.len(), run.position().epoch, run.position().steps), (3, 4, 12));
    assert_eq!(run.last_epoch().map(|e| e.epoch), Some(3));
    // Resumed from that state, the hook is asked again before anything is trained.
    let (mut again, plan) = (run, Settings::new(10, 10).stop_when(|e| e.epoch == 3));
    let summary = fit_threads(&mut again, 1, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();
    assert!(summary.loss_curve.is_empty() && again.position().steps == 12);
    let patience = Settings::new(10, 10).patience(2);
    let hook = patience.on_epoch.as_ref().unwrap();
    let end = |epoch, best_epoch| EpochEnd { epoch, loss: 0.1, dev: 0.5, best_dev: 0.6, best_epoch };
    assert_eq!((hook(&end(4, 3)), hook(&end(5, 3)), hook(&end(2, 0))), (Next::Continue, Next::Stop, Next::Stop));
    // A rate of 0 from epoch 2: two epochs leave the weights one epoch trained.
    let (one, _) = fit(&Settings::new(1, 10));
    let frozen =
        Settings { lr_schedule: Some(std::sync::Arc::new(|e| if e >= 2 { 0.0 } else { 1.0 })), ..Settings::new(2, 10) };
    let (two, _) = fit(&frozen);
    assert_eq!(one.model().tensors().unwrap(), two.model().tensors().unwrap());
    let (decayed, _) = fit(&Settings::new(2, 10).lr_decay(0.5));
    let (plain, _) = fit(&Settings::new(2, 10));
    assert_ne!(decayed.model().tensors().unwrap(), plain.model().tensors().unwrap());
    assert_eq!(fit(&Settings::new(2, 10).lr_decay(1.0)).0.model().tensors().unwrap(), plain.model().tensors().unwrap());
}

/// A run whose settings record nothing about the model (`Settings::new`) still writes
/// checkpoints that hold its position, so a run resumes from them.
#[test]
fn checkpoints_of_default_settings_resume() {
    let data = synthetic::generate(40, 8, 22);
    let data = labelled(&data);
    let splits = Splits { train: &data[..30], dev: &data[30..], test: &data[30..] };
    let dir = std::env::temp_dir().join(format!("arbor-default-settings-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let plan = Settings::new(1, 10).checkpoint(&dir);
    let fresh = || Run::new(model(8), Optimizer::new(Config::new(Rule::Adam, 0.02)), &Rng::new(4));
    let mut run = fresh();
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |_| {}).unwrap();
    let mut resumed = fresh();
    resumed.resume(&arbor::checkpoint::Checkpoint::load(&dir.join("last")).unwrap(), &plan.meta).unwrap();
    assert_eq!((resumed.position(), resumed.best_epoch()), (run.position(), run.best_epoch()));
    std::fs::remove_dir_all(&dir).ok();
}

/// The weight average the engines keep beside the tensors (`Model::average_in_place`, what a
/// run uses) is, bit for bit, the host's `Average` of the same steps' tensors; set from those
/// averages, another model keeps averaging alike.
#[test]
fn the_average_kept_in_the_engines_is_the_hosts() {
    use arbor::average::Average;
    let data = synthetic::generate(40, 8, 17);
    let data = labelled(&data);
    let mut m = model(3);
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.02));
    let mut host = Average::new(0.9).unwrap();
    let mut other = model(3);
    for (t, batch) in data.chunks(8).enumerate() {
        let examples: Vec<Example<'_>> = batch.iter().map(AsExample::example).collect();
        m.step(&examples, &mut opt, Some(5.0)).unwrap();
        let keep = host.keep_at(t as u64);
        m.average_in_place(keep).unwrap();
        host.update(t as u64, &m.tensors_lent().unwrap()).unwrap();
        let kept = m.averaged().unwrap().expect("the average has begun");
        assert_eq!(kept, host.tensors(), "step {t}");
        if t == 2 {
            other.set_averaged(&kept).unwrap();
        } else if t > 2 {
            other
                .restore(&arbor::checkpoint::Checkpoint {
                    tensors: m.tensors().unwrap(),
                    meta: serde_json::Value::Null,
                })
                .unwrap();
            other.average_in_place(keep).unwrap();
            assert_eq!(other.averaged().unwrap().unwrap(), kept, "step {t}, set from step 2's averages");
        }
    }
    assert!(host.tensors().iter().zip(params(&m)).any(|(a, p)| a.2 != p), "the average is the last step");
    other.set_averaged(&[]).unwrap();
    assert!(other.averaged().unwrap().is_none(), "forgotten");
}

/// A run told to write into a folder that holds another run's checkpoints, with no claim on it,
/// is refused and leaves them as they were; the run that wrote them goes on there, and a claim
/// that overwrites lets a new run in.
#[test]
fn a_run_does_not_write_over_another_runs_checkpoints() {
    let data = synthetic::generate(20, 6, 3);
    let all = labelled(&data);
    let splits = || Splits { train: &all[..12], dev: &all[12..16], test: &all[16..] };
    let dir = std::env::temp_dir().join(format!("arbor-unclaimed-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let plan = Settings::new(1, 4).checkpoint(&dir);
    let mut first = Run::new(model(3), Optimizer::new(Config::new(Rule::Adam, 0.01)), &Rng::new(3));
    first.fit_local(splits(), &plan).unwrap();
    let best = std::fs::read(dir.join("best/meta.json")).unwrap();
    let mut second = Run::new(model(4), Optimizer::new(Config::new(Rule::Adam, 0.01)), &Rng::new(4));
    let e = second.fit_local(splits(), &plan).unwrap_err().to_string();
    assert!(e.contains("another run's checkpoints") && e.contains("Existing::Overwrite"), "{e}");
    assert_eq!(std::fs::read(dir.join("best/meta.json")).unwrap(), best, "the first run's best/ as it was");
    first.fit_local(splits(), &Settings::new(2, 4).checkpoint(&dir)).unwrap();
    let held = RunFolder::claim(&dir, Existing::Overwrite).unwrap();
    second.fit_local(splits(), &plan).unwrap();
    drop(held);
    // A folder with no checkpoint in it is named as such when a model is loaded from it.
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let e = Model::load(&dir, &CpuBackend::new()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("no checkpoint here"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
