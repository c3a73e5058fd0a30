//! Training-loop mechanics on the CPU backend: loss scaling (for half-precision products), where
//! a power-of-two scale changes no gradient and a step whose scaled gradients overflow is
//! skipped with the scale halved; and minibatches scheduled ahead, which change nothing.

use arbor::data::{synthetic, TreeExample, PAD};
use arbor::layers::LossOn;
use arbor::loss_scale::LossScaler;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::{Classifier, Readout};
use arbor::{nn, train, InputGraph};

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
