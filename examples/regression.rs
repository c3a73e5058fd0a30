//! Regression on a tree's root: a Tree-LSTM reads each synthetic sentence and a head of the
//! user's own predicts its sentiment as a real number (−1, 0 or +1), trained by the one loop
//! (`Run`) on the mean squared error. No gradient is written: the head is declared in the IR
//! like the cell, and the example type says what a tree's target is and how predictions score.
//!
//! `cargo run --release --example regression`

use arbor::data::{synthetic, TreeExample, PAD};
use arbor::head::mean_squared_error;
use arbor::layers::Embedding;
use arbor::model::{AsExample, Example, Feed, Model, Outputs};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, Event, Run, Scores, Settings, Splits};
use arbor::{metrics, nn, Builder, CpuBackend, Init, VertexFn};
use std::time::Duration;

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
struct Sentiment<'a>(&'a TreeExample);

impl Sentiment<'_> {
    fn target(&self) -> f32 {
        self.0.labels[self.0.root()] as f32 - 1.0
    }
}

impl AsExample for Sentiment<'_> {
    fn example(&self) -> Example<'_> {
        Example { trees: vec![self.0.tree()], target: vec![self.target()] }
    }

    /// The negated mean squared error of the head's `prediction`s (higher is better: it picks
    /// the best epoch).
    fn score(outputs: &Outputs, data: &[Self]) -> arbor::Result<Scores> {
        let predicted: Vec<f64> = outputs.get("prediction")?.iter().map(|&p| f64::from(p)).collect();
        let gold: Vec<f64> = data.iter().map(|s| f64::from(s.target())).collect();
        Ok(vec![("negated_mse".into(), -metrics::mean_squared_error(&predicted, &gold))])
    }
}

fn main() -> arbor::Result<()> {
    let trees = [synthetic::generate(4000, 12, 1), synthetic::generate(500, 12, 2), synthetic::generate(500, 12, 3)];
    let [train, dev, test] = trees.each_ref().map(|t| t.iter().map(Sentiment).collect::<Vec<_>>());
    let (embed, hidden) = (32, 64);
    let mut rng = Rng::new(1);
    let words = Embedding::new(synthetic::vocab().len(), embed, 0.1, &mut rng).with_padding(PAD);
    let (cell, head) = (nn::tree_lstm(embed, hidden)?, regression_head(hidden)?);
    let model = Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)?;
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adam, 0.01)), &rng);
    let splits = Splits { train: &train, dev: &dev, test: &test };
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &Settings::new(5, 25), &mut |e| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: training MSE {loss:.4}, dev MSE {:.4}", -dev);
        }
    })?;
    println!("test MSE {:.4} at the best dev epoch ({})", -run.test_acc(), run.best_epoch());
    Ok(())
}
