//! Training reaches accuracy: on the synthetic treebank, and a short run on SST (the data is found
//! through ARBOR_DATA, default ../shared/data).

use arbor::data::labelled::Labelled;
use arbor::data::{sst, synthetic, TreeExample};
use arbor::layers::LossOn;
use arbor::model::Model;
use arbor::nn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{Run, Settings, Splits};
use arbor::CpuBackend;

/// Trains `model` with the loss on every vertex for `epochs` through [`Run`] and returns it with
/// the mean loss of the first and the last epoch.
fn fit(
    model: Model<CpuBackend>,
    train: &[TreeExample],
    classes: usize,
    epochs: usize,
    opt: Optimizer,
    seed: u64,
) -> (Model<CpuBackend>, f64, f64) {
    let mut run = Run::new(model, opt, &Rng::new(seed));
    let train = Labelled::all(train, LossOn::All, classes);
    let plan = Settings { clip: Some(5.0), ..Settings::new(epochs, 25) };
    let summary = run.fit_local(Splits { train: &train, dev: &[], test: &[] }, &plan).unwrap();
    let losses = summary.loss_curve;
    (run.into_model(), losses[0], losses[epochs - 1])
}

/// Root accuracy on `test`.
fn accuracy(model: &mut Model<CpuBackend>, test: &[TreeExample], classes: usize) -> f64 {
    model.score(&Labelled::all(test, LossOn::All, classes)).unwrap()[0].1
}

#[test]
fn tree_lstm_learns_the_synthetic_composition_rule() {
    let train = synthetic::generate(1500, 10, 1);
    let test = synthetic::generate(300, 10, 99);
    let mut rng = Rng::new(3);
    let (vocab, classes) = (synthetic::vocab().len(), synthetic::CLASSES);
    let mut model =
        arbor::zoo::tree_classifier(nn::tree_lstm(16, 32).unwrap(), vocab, classes, LossOn::All, &mut rng).unwrap();
    let before = accuracy(&mut model, &test, classes);
    let opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
    let (mut model, first, last) = fit(model, &train, classes, 4, opt, 5);
    let after = accuracy(&mut model, &test, classes);
    assert!(last < 0.5 * first, "loss {first} → {last}");
    assert!(after >= 0.9, "root accuracy {before} → {after}");
}

#[test]
fn tree_lstm_trains_on_sst() {
    let dir = arbor::data::data_dir().join("sst");
    let splits = sst::read_splits(&dir, false)
        .unwrap_or_else(|e| panic!("SST data not found ({e}); set ARBOR_DATA to the folder holding sst/"));
    let mut rng = Rng::new(1);
    let cell = nn::tree_lstm(32, 32).unwrap();
    let model = arbor::zoo::tree_classifier(cell, splits.vocab.len(), sst::CLASSES, LossOn::All, &mut rng).unwrap();
    let opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
    let (mut model, first, last) = fit(model, &splits.train, sst::CLASSES, 2, opt, 2);
    let acc = accuracy(&mut model, &splits.test, sst::CLASSES);
    assert!(last < first, "loss did not fall: {first} → {last}");
    // Stated bar for this short run (2 epochs, 32-wide model); chance is ~0.2 and the
    // majority class ~0.29.
    assert!(acc >= 0.40, "fine-grained test root accuracy {acc}");
}
