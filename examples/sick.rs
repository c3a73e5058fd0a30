//! Sentence relatedness on SICK (Tai et al. 2015): a child-sum Tree-LSTM over each sentence's
//! dependency tree (any number of dependents per word), `[|h_a − h_b|, h_a ⊙ h_b]` of the two
//! roots, 50 sigmoid units, a softmax over the scores 1..5 and the KL divergence to the gold
//! score's distribution — the cell and the head both declared in the IR, no gradient written by
//! hand — trained by the one loop (`Run`), which keeps the test scores of the best dev Pearson.
//!
//! `cargo run --release --example sick -- [EPOCHS] [TRAIN_PAIRS]` (data: `$ARBOR_DATA/sick`).

use arbor::data::{sick, PAD};
use arbor::layers::Embedding;
use arbor::model::{Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, Event, Run, Settings, Splits};
use arbor::{nn, CpuBackend};
use std::time::Duration;

fn main() -> arbor::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (epochs, limit) = (args.first().copied().unwrap_or(3), args.get(1).copied().unwrap_or(usize::MAX));
    let (embed, hidden) = (300, 150);
    let data = sick::read_splits(&arbor::data::data_dir().join("sick"), true)?;
    let mut rng = Rng::new(1);
    let words = Embedding::new(data.vocab.len(), embed, 0.1, &mut rng).with_padding(PAD);
    let (cell, head) = (nn::child_sum_tree_lstm_nary(embed, hidden)?, nn::relatedness_head(hidden, 50, sick::CLASSES)?);
    let feeds = vec![Feed::Words, Feed::ParentWords];
    let model = Model::init(&CpuBackend::new(), words, cell, feeds, head, &mut rng)?;
    let opt = Optimizer::new(Config { weight_decay: 1e-4, ..Config::new(Rule::Adagrad, 0.05) });
    let mut run = Run::new(model, opt, &rng);
    // A `Pair` scores Pearson's correlation (which picks the best epoch), Spearman's and the MSE.
    let train = &data.train[..limit.min(data.train.len())];
    let splits = Splits { train, dev: &data.dev, test: &data.test };
    let plan = Settings { clip: None, ..Settings::new(epochs, 25) };
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |e| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: mean KL {loss:.4}, dev Pearson {dev:.4}");
        }
    })?;
    let scores: Vec<String> = run.test_scores().iter().map(|(name, v)| format!("{name} {v:.4}")).collect();
    println!("test {} (at the best dev Pearson, {:.4})", scores.join(", "), run.best_dev());
    Ok(())
}
