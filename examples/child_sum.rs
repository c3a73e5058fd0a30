//! Child-sum Tree-LSTM on the synthetic treebank: `cargo run --release --example child_sum`.

use arbor::data::{synthetic, PAD};
use arbor::layers::LossOn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::Classifier;

fn main() -> arbor::Result<()> {
    let (train, test) = (synthetic::generate(4000, 12, 1), synthetic::generate(500, 12, 2));
    let mut rng = Rng::new(1);
    let cell = arbor::nn::child_sum_tree_lstm(32, 64, 2)?;
    println!("{cell}");
    let mut model = Classifier::new(cell, synthetic::vocab().len(), Some(PAD), synthetic::CLASSES, &mut rng)?;
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
    for epoch in 1..=5 {
        let loss = model.epoch(&train, 25, LossOn::All, &mut opt, Some(5.0), &mut rng, &mut |_| {})?;
        println!("epoch {epoch}: loss {loss:.4}, test root accuracy {:.4}", model.accuracy(&test, 256)?);
    }
    Ok(())
}
