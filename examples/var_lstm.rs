//! Var-LSTM: an LSTM over each SST sentence as a chain graph, classified at its last word
//! (synthetic sentences without the data): `cargo run --release --example var_lstm`.

use arbor::data::{data_dir, sst, synthetic, TreeExample, PAD};
use arbor::layers::LossOn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::Classifier;

fn main() -> arbor::Result<()> {
    let (train, test, vocab, classes) = match sst::read_splits(&data_dir().join("sst"), false) {
        Ok(s) => (s.train, s.test, s.vocab.len(), sst::CLASSES),
        Err(_) => (
            synthetic::generate(4000, 12, 1),
            synthetic::generate(500, 12, 2),
            synthetic::vocab().len(),
            synthetic::CLASSES,
        ),
    };
    let chains = |d: &[TreeExample]| d.iter().map(TreeExample::to_chain).collect::<Vec<_>>();
    let (train, test) = (chains(&train), chains(&test));
    let mut rng = Rng::new(1);
    let mut model = Classifier::new(arbor::nn::var_lstm(100, 100)?, vocab, Some(PAD), classes, &mut rng)?;
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.002));
    for epoch in 1..=3 {
        let loss = model.epoch(&train, 25, LossOn::Root, &mut opt, Some(5.0), &mut rng, &mut |_| {})?;
        println!("epoch {epoch}: loss {loss:.4}, test accuracy {:.4}", model.accuracy(&test, 256)?);
    }
    Ok(())
}
