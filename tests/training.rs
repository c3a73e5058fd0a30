//! Training reaches accuracy: on the synthetic treebank, and a short run on SST (the data is found
//! through ARBOR_DATA, default ../shared/data).

use arbor::data::{sst, synthetic, TreeExample, PAD};
use arbor::layers::LossOn;
use arbor::nn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::Classifier;

/// Trains for `epochs` and returns the mean loss of the first and the last epoch.
fn fit(model: &mut Classifier, train: &[TreeExample], epochs: usize, opt: &mut Optimizer, seed: u64) -> (f64, f64) {
    let mut rng = Rng::new(seed);
    let losses: Vec<f64> = (0..epochs)
        .map(|_| model.epoch(train, 25, LossOn::All, opt, Some(5.0), &mut rng, &mut |_| {}).unwrap())
        .collect();
    (losses[0], losses[epochs - 1])
}

#[test]
fn tree_lstm_learns_the_synthetic_composition_rule() {
    let train = synthetic::generate(1500, 10, 1);
    let test = synthetic::generate(300, 10, 99);
    let mut rng = Rng::new(3);
    let mut model = Classifier::new(
        nn::tree_lstm(16, 32).unwrap(),
        synthetic::vocab().len(),
        Some(PAD),
        synthetic::CLASSES,
        &mut rng,
    )
    .unwrap();
    let before = model.accuracy(&test, 100).unwrap();
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
    let (first, last) = fit(&mut model, &train, 4, &mut opt, 5);
    let after = model.accuracy(&test, 100).unwrap();
    assert!(last < 0.5 * first, "loss {first} → {last}");
    assert!(after >= 0.9, "root accuracy {before} → {after}");
}

#[test]
fn tree_lstm_trains_on_sst() {
    let dir = arbor::data::data_dir().join("sst");
    let splits = sst::read_splits(&dir, false)
        .unwrap_or_else(|e| panic!("SST data not found ({e}); set ARBOR_DATA to the folder holding sst/"));
    let train = splits.train;
    let mut rng = Rng::new(1);
    let mut model =
        Classifier::new(nn::tree_lstm(32, 32).unwrap(), splits.vocab.len(), Some(PAD), sst::CLASSES, &mut rng).unwrap();
    let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
    let (first, last) = fit(&mut model, &train, 2, &mut opt, 2);
    let acc = model.accuracy(&splits.test, 256).unwrap();
    assert!(last < first, "loss did not fall: {first} → {last}");
    // Stated bar for this short run (2 epochs, 32-wide model); chance is ~0.2 and the
    // majority class ~0.29.
    assert!(acc >= 0.40, "fine-grained test root accuracy {acc}");
}
