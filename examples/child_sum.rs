//! Child-sum Tree-LSTM on the synthetic treebank, trained by the one loop on two workers:
//! `cargo run --release --example child_sum`.

use arbor::data::labelled::Labelled;
use arbor::data::synthetic;
use arbor::layers::LossOn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, Event, Run, Settings, Splits};
use std::time::Duration;

fn main() -> arbor::Result<()> {
    let trees = [synthetic::generate(4000, 12, 1), synthetic::generate(500, 12, 2), synthetic::generate(500, 12, 3)];
    // A target at every vertex: the loss is the mean over every labelled phrase.
    let [train, dev, test] = trees.each_ref().map(|t| Labelled::all(t, LossOn::All, synthetic::CLASSES));
    let mut rng = Rng::new(1);
    let cell = arbor::nn::child_sum_tree_lstm(32, 64, 2)?;
    println!("{cell}");
    let model = arbor::zoo::tree_classifier(cell, synthetic::vocab().len(), synthetic::CLASSES, LossOn::All, &mut rng)?;
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adam, 0.01)), &rng);
    let splits = Splits { train: &train, dev: &dev, test: &test };
    // Two data-parallel workers, each with half of every minibatch of 25 trees.
    fit_threads(&mut run, 2, Duration::from_secs(60), splits, &Settings::new(5, 25), &mut |e| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
        }
    })?;
    // `root_accuracy`, then `phrase_accuracy` (over every vertex).
    let scores: Vec<String> = run.test_scores().iter().map(|(name, v)| format!("{name} {v:.4}")).collect();
    println!("test {} at the best dev epoch ({})", scores.join(", "), run.best_epoch());
    Ok(())
}
