//! Binary Tree-LSTM on the Stanford Sentiment Treebank (or, without the data, on the built-in
//! synthetic treebank), trained by the one loop (`Run`) with early stopping:
//! `cargo run --release --example tree_lstm_sst [EPOCHS] [CHECKPOINT_DIR]`. With a folder, the
//! run keeps `best/` and `last/` there, and a second run resumes from `last/`.

use arbor::checkpoint::Checkpoint;
use arbor::data::{data_dir, sst, synthetic, PAD};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::run_folder::{Existing, RunFolder};
use arbor::train::Classifier;
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
    let mut rng = Rng::new(1);
    let model = Classifier::new(arbor::nn::tree_lstm(100, 100)?, vocab, Some(PAD), classes, &mut rng)?;
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
    println!("test root accuracy {:.4} at the best dev epoch ({})", run.test_acc, run.best_epoch);
    Ok(())
}
