//! Binary Tree-LSTM on the Stanford Sentiment Treebank (or, without the data, on the built-in
//! synthetic treebank), trained by the one loop (`Run`) with early stopping:
//! `cargo run --release --example tree_lstm_sst [EPOCHS] [CHECKPOINT_DIR]`. With a folder, the
//! run keeps `best/` and `last/` there, and a second run resumes from `last/`.

use arbor::checkpoint::Checkpoint;
use arbor::data::labelled::Labelled;
use arbor::data::{data_dir, sst, synthetic};
use arbor::layers::LossOn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::run_folder::{Existing, RunFolder};
use arbor::trainer::{fit_threads, Event, Run, Settings, Splits};
use std::time::Duration;

fn main() -> arbor::Result<()> {
    let mut args = std::env::args().skip(1);
    let epochs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let folder = args.next().map(std::path::PathBuf::from);
    let (train, dev, test, vocab, classes) = match sst::read_splits(&data_dir().join("sst"), false) {
        Ok(s) => (s.train, s.dev, s.test, s.vocab.len(), sst::CLASSES),
        Err(e) => {
            eprintln!("no SST ({e}); using the synthetic treebank");
            let split = |n, seed| synthetic::generate(n, 12, seed);
            (split(4000, 1), split(500, 2), split(500, 3), synthetic::vocab().len(), synthetic::CLASSES)
        }
    };
    // A target at every vertex (every phrase of a sentence is labelled): the loss is their mean.
    let [train, dev, test] = [&train, &dev, &test].map(|t| Labelled::all(t, LossOn::All, classes));
    let mut rng = Rng::new(1);
    let model = arbor::zoo::tree_classifier(arbor::nn::tree_lstm(100, 100)?, vocab, classes, LossOn::All, &mut rng)?;
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adagrad, 0.05)), &rng);
    // Minibatches of 25 trees; stop after 3 epochs without a better dev accuracy.
    let mut plan = Settings::new(epochs, 25).patience(3);
    // The folder is held while the run lasts; a run found there is resumed.
    let _held = match &folder {
        Some(dir) => {
            plan = plan.checkpoint(dir);
            let held = RunFolder::claim(dir, Existing::Resume)?;
            if dir.join("last").is_dir() {
                run.resume(&Checkpoint::load(&dir.join("last"))?, &plan.meta)?;
            }
            Some(held)
        }
        None => None,
    };
    let splits = Splits { train: &train, dev: &dev, test: &test };
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |e| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
        }
    })?;
    // `root_accuracy`, then `phrase_accuracy` (over every vertex).
    let scores: Vec<String> = run.test_scores().iter().map(|(name, v)| format!("{name} {v:.4}")).collect();
    println!("test {} at the best dev epoch ({})", scores.join(", "), run.best_epoch());
    Ok(())
}
