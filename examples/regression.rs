//! Regression on a tree's root: a Tree-LSTM reads each synthetic sentence and a head of the
//! user's own predicts its sentiment as a real number (−1, 0 or +1), trained on the mean
//! squared error. No gradient is written: the head is declared in the IR like the cell.
//!
//! `cargo run --release --example regression`

use arbor::data::{synthetic, TreeExample, PAD};
use arbor::head::mean_squared_error;
use arbor::layers::Embedding;
use arbor::model::{Example, Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::{nn, Builder, CpuBackend, Init, VertexFn};

/// `prediction = tanh(h·W₁ + b₁)·w₂ + b₂` from the root's `h`; the loss is its squared error.
fn regression_head(hidden: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("regression", 0);
    let (h, target) = (f.pull("h", hidden), f.pull("target", 1));
    let w1 = f.param("W1", [hidden, 32], Init::Xavier);
    let b1 = f.param("b1", [1, 32], Init::Zeros);
    let w2 = f.param("w2", [32, 1], Init::Xavier);
    let b2 = f.param("b2", [1, 1], Init::Zeros);
    let prediction = (h.matmul(w1) + b1).tanh().matmul(w2) + b2;
    f.push("loss", mean_squared_error(prediction, target));
    f.push("prediction", prediction);
    f.build()
}

/// A tree with its root's sentiment (label 0, 1, 2 → −1, 0, +1) as the target.
fn example(t: &TreeExample) -> Example<'_> {
    Example { trees: vec![t.tree()], target: vec![t.labels[t.root()] as f32 - 1.0] }
}

fn main() -> arbor::Result<()> {
    let (train, test) = (synthetic::generate(4000, 12, 1), synthetic::generate(500, 12, 2));
    let (embed, hidden) = (32, 64);
    let mut rng = Rng::new(1);
    let words = Embedding::new(synthetic::vocab().len(), embed, 0.1, &mut rng).with_padding(PAD);
    let (cell, head) = (nn::tree_lstm(embed, hidden)?, regression_head(hidden)?);
    let mut model = Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)?;
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
    let test_examples: Vec<Example<'_>> = test.iter().map(example).collect();
    for epoch in 1..=5 {
        let mut loss = 0.0;
        for batch in train.chunks(25) {
            loss +=
                model.step(&batch.iter().map(example).collect::<Vec<_>>(), &mut opt, Some(5.0))?[0].iter().sum::<f32>();
        }
        let test_mse = model.infer(&test_examples)?[0].iter().sum::<f32>() / test.len() as f32;
        println!("epoch {epoch}: training MSE {:.4}, test MSE {test_mse:.4}", loss / train.len() as f32);
    }
    Ok(())
}
