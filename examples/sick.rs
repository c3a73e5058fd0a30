//! Sentence relatedness on SICK (Tai et al. 2015): a child-sum Tree-LSTM over each sentence's
//! dependency tree (any number of dependents per word), `[|h_a − h_b|, h_a ⊙ h_b]` of the two
//! roots, 50 sigmoid units, a softmax over the scores 1..5 and the KL divergence to the gold
//! score's distribution — the cell and the head both declared in the IR, no gradient written by
//! hand.
//!
//! `cargo run --release --example sick -- [EPOCHS] [TRAIN_PAIRS]` (data: `$ARBOR_DATA/sick`).

use arbor::data::sick::{self, Pair};
use arbor::data::PAD;
use arbor::layers::Embedding;
use arbor::model::{Example, Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::{metrics, nn, CpuBackend};

/// Pearson's correlation of the model's expected scores with the gold scores of `pairs`.
fn pearson(model: &mut Model<CpuBackend>, pairs: &[Pair]) -> arbor::Result<f64> {
    Ok(metrics::pearson(&sick::predict(model, pairs)?, &sick::gold(pairs)))
}

fn main() -> arbor::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (epochs, limit) = (args.first().copied().unwrap_or(3), args.get(1).copied().unwrap_or(usize::MAX));
    let (embed, hidden) = (300, 150);
    let data = sick::read_splits(&arbor::data::data_dir().join("sick"), true)?;
    let mut rng = Rng::new(1);
    let words = Embedding::new(data.vocab.len(), embed, 0.1, &mut rng).with_padding(PAD);
    let (cell, head) = (nn::child_sum_tree_lstm_nary(embed, hidden)?, nn::relatedness_head(hidden, 50, sick::CLASSES)?);
    let feeds = vec![Feed::Words, Feed::ParentWords];
    let mut model = Model::init(&CpuBackend::new(), words, cell, feeds, head, &mut rng)?;
    let mut opt = Optimizer::new(Config { weight_decay: 1e-4, ..Config::new(Rule::Adagrad, 0.05) });
    let mut train: Vec<&Pair> = data.train.iter().take(limit).collect();
    let (mut best_dev, mut test) = (f64::MIN, f64::NAN);
    for epoch in 1..=epochs {
        rng.shuffle(&mut train);
        let mut loss = 0.0;
        for batch in train.chunks(25) {
            let examples: Vec<Example<'_>> = batch.iter().map(|p| p.example()).collect();
            loss += model.step(&examples, &mut opt, None)?[0].iter().sum::<f32>();
        }
        let dev = pearson(&mut model, &data.dev)?;
        println!("epoch {epoch}: mean KL {:.4}, dev Pearson {dev:.4}", loss / train.len() as f32);
        if dev > best_dev {
            (best_dev, test) = (dev, pearson(&mut model, &data.test)?);
        }
    }
    println!("test Pearson {test:.4} (at the best dev Pearson, {best_dev:.4})");
    Ok(())
}
