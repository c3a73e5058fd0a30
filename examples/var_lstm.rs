//! Var-LSTM: an LSTM over each SST sentence as a chain graph, classified at its last word
//! (synthetic sentences without the data), trained by the one loop with a learning rate that
//! decays per epoch: `cargo run --release --example var_lstm`.

use arbor::data::labelled::Labelled;
use arbor::data::{data_dir, sst, synthetic, TreeExample};
use arbor::layers::LossOn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, Event, Run, Settings, Splits};
use std::time::Duration;

fn main() -> arbor::Result<()> {
    let (train, dev, test, vocab, classes) = match sst::read_splits(&data_dir().join("sst"), false) {
        Ok(s) => (s.train, s.dev, s.test, s.vocab.len(), sst::CLASSES),
        Err(_) => {
            let split = |n, seed| synthetic::generate(n, 12, seed);
            (split(4000, 1), split(500, 2), split(500, 3), synthetic::vocab().len(), synthetic::CLASSES)
        }
    };
    let chains = [&train, &dev, &test].map(|d| d.iter().map(TreeExample::to_chain).collect::<Vec<_>>());
    // The loss at each sentence's last word (the chain's root) only.
    let [train, dev, test] = chains.each_ref().map(|c| Labelled::all(c, LossOn::Root, classes));
    let mut rng = Rng::new(1);
    let model = arbor::zoo::tree_classifier(arbor::nn::var_lstm(100, 100)?, vocab, classes, LossOn::Root, &mut rng)?;
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adam, 0.002)), &rng);
    // The rate shrinks by a fifth per epoch.
    let plan = Settings::new(3, 25).lr_decay(0.8);
    let splits = Splits { train: &train, dev: &dev, test: &test };
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |e| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: loss {loss:.4}, dev accuracy {dev:.4}");
        }
    })?;
    println!("test accuracy {:.4} at the best dev epoch ({})", run.test_acc(), run.best_epoch());
    Ok(())
}
