//! A cell arbor does not ship, written by a user: a Tree-GRU (a GRU whose previous state is the
//! mean of the two children's, with a reset gate per child), with a softmax classifier of the
//! root as its head, trained on the synthetic treebank by the one loop (`Run`). No gradient is
//! written: the builder derives the backward pass of both.
//!
//! `cargo run --release --example tree_gru`

use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, PAD};
use arbor::head::softmax_cross_entropy;
use arbor::layers::{Embedding, LossOn};
use arbor::model::{Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, Event, Run, Settings, Splits};
use arbor::{Builder, CpuBackend, Init, VertexFn};
use std::time::Duration;

/// `h = z ⊙ (h₀ + h₁)/2 + (1 − z) ⊙ tanh(x·W + [r₀ ⊙ h₀, r₁ ⊙ h₁]·U + b)`, with the update gate
/// `z` and the reset gates `r₀, r₁` from `x` and both children.
fn tree_gru(embed: usize, hidden: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("tree-gru", 2);
    let x = f.pull("x", embed);
    let (h0, h1) = (f.gather(0, "h", hidden), f.gather(1, "h", hidden));
    let children = h0.concat(h1);
    let wg = f.param("Wg", [embed, 3 * hidden], Init::Xavier);
    let ug = f.param("Ug", [2 * hidden, 3 * hidden], Init::Xavier);
    let bg = f.param("bg", [1, 3 * hidden], Init::Zeros);
    let gates = (x.matmul(wg) + children.matmul(ug) + bg).sigmoid();
    let (z, r0, r1) = (gates.slice(0, hidden), gates.slice(hidden, hidden), gates.slice(2 * hidden, hidden));
    let w = f.param("W", [embed, hidden], Init::Xavier);
    let u = f.param("U", [2 * hidden, hidden], Init::Xavier);
    let b = f.param("b", [1, hidden], Init::Zeros);
    let candidate = (x.matmul(w) + (r0 * h0).concat(r1 * h1).matmul(u) + b).tanh();
    let h = z * (0.5 * (h0 + h1)) + (1.0 - z) * candidate;
    f.scatter("h", h);
    f.push("h", h);
    f.build()
}

/// A softmax classifier of the root as a head: cross-entropy to the one-hot label, and the
/// logits (which the root accuracy is scored from).
fn classifier(hidden: usize, classes: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("classifier", 0);
    let (h, label) = (f.pull("h", hidden), f.pull("label", classes));
    let logits = h.matmul(f.param("W", [hidden, classes], Init::Xavier)) + f.param("b", [1, classes], Init::Zeros);
    f.push("loss", softmax_cross_entropy(logits, label));
    f.push("logits", logits);
    f.build()
}

fn main() -> arbor::Result<()> {
    let trees = [synthetic::generate(4000, 12, 1), synthetic::generate(500, 12, 2), synthetic::generate(500, 12, 3)];
    // Each tree with its root's label as the target (a one-hot row).
    let [train, dev, test] = trees.each_ref().map(|t| Labelled::all(t, LossOn::Root, synthetic::CLASSES));
    let (embed, hidden) = (32, 64);
    let mut rng = Rng::new(1);
    let (cell, head) = (tree_gru(embed, hidden)?, classifier(hidden, synthetic::CLASSES)?);
    println!("{cell}");
    let words = Embedding::new(synthetic::vocab().len(), embed, 0.1, &mut rng).with_padding(PAD);
    let model = Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)?;
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adam, 0.01)), &rng);
    let splits = Splits { train: &train, dev: &dev, test: &test };
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &Settings::new(5, 25), &mut |e| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
        }
    })?;
    println!("test root accuracy {:.4} at the best dev epoch ({})", run.test_acc(), run.best_epoch());
    Ok(())
}
