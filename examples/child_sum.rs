//! Child-sum Tree-LSTM on the synthetic treebank, trained by the one loop on two workers:
//! `cargo run --release --example child_sum`.

use arbor::data::{synthetic, PAD};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::Classifier;
use arbor::trainer::{fit_threads, Event, Run, Settings, Splits};
use std::time::Duration;

fn main() -> arbor::Result<()> {
    let split = |n, seed| synthetic::generate(n, 12, seed);
    let (train, dev, test) = (split(4000, 1), split(500, 2), split(500, 3));
    let mut rng = Rng::new(1);
    let cell = arbor::nn::child_sum_tree_lstm(32, 64, 2)?;
    println!("{cell}");
    let model = Classifier::new(cell, synthetic::vocab().len(), Some(PAD), synthetic::CLASSES, &mut rng)?;
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adam, 0.01)), &rng);
    let splits = Splits { train: &train, dev: &dev, test: &test };
    // Two data-parallel workers, each with half of every minibatch of 25 trees.
    fit_threads(&mut run, 2, Duration::from_secs(60), splits, &Settings::new(5, 25), &mut |e| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
        }
    })?;
    println!("test root accuracy {:.4} at the best dev epoch ({})", run.test_acc, run.best_epoch);
    Ok(())
}
