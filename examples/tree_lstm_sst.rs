//! Binary Tree-LSTM on the Stanford Sentiment Treebank (or, without the data, on the built-in
//! synthetic treebank): `cargo run --release --example tree_lstm_sst [EPOCHS]`.

use arbor::data::{data_dir, sst, synthetic, TreeExample, PAD};
use arbor::layers::LossOn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::Classifier;

fn main() -> arbor::Result<()> {
    let epochs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(3);
    let dir = data_dir().join("sst");
    let (train, test, vocab, classes): (Vec<TreeExample>, Vec<TreeExample>, usize, usize) =
        match sst::read_splits(&dir, false) {
            Ok(s) => (s.train, s.test, s.vocab.len(), sst::CLASSES),
            Err(e) => {
                eprintln!("no SST ({e}); using the synthetic treebank");
                (
                    synthetic::generate(4000, 12, 1),
                    synthetic::generate(500, 12, 2),
                    synthetic::vocab().len(),
                    synthetic::CLASSES,
                )
            }
        };
    let mut rng = Rng::new(1);
    let mut model = Classifier::new(arbor::nn::tree_lstm(100, 100)?, vocab, Some(PAD), classes, &mut rng)?;
    let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
    for epoch in 1..=epochs {
        let loss = model.epoch(&train, 25, LossOn::All, &mut opt, Some(5.0), &mut rng, &mut |_| {})?;
        println!("epoch {epoch}: loss {loss:.4}, test root accuracy {:.4}", model.accuracy(&test, 256)?);
    }
    Ok(())
}
