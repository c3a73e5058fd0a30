//! A cell arbor does not ship, written by a user: a Tree-GRU (a GRU whose previous state is the
//! mean of the two children's, with a reset gate per child), with a softmax classifier of the
//! root as its head, trained on the synthetic treebank. No gradient is written: the builder
//! derives the backward pass of both.
//!
//! `cargo run --release --example tree_gru`

use arbor::data::{synthetic, TreeExample, PAD};
use arbor::head::softmax_cross_entropy;
use arbor::layers::Embedding;
use arbor::model::{Example, Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::{Builder, CpuBackend, Init, VertexFn};

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
/// class probabilities.
fn classifier(hidden: usize, classes: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("classifier", 0);
    let (h, label) = (f.pull("h", hidden), f.pull("label", classes));
    let logits = h.matmul(f.param("W", [hidden, classes], Init::Xavier)) + f.param("b", [1, classes], Init::Zeros);
    f.push("loss", softmax_cross_entropy(logits, label));
    f.push("p", logits.softmax());
    f.build()
}

/// A tree, its root's label as a one-hot row.
fn example(t: &TreeExample) -> Example<'_> {
    let mut target = vec![0.0; synthetic::CLASSES];
    target[t.labels[t.root()] as usize] = 1.0;
    Example { trees: vec![t.tree()], target }
}

fn main() -> arbor::Result<()> {
    let (train, test) = (synthetic::generate(4000, 12, 1), synthetic::generate(500, 12, 2));
    let (embed, hidden) = (32, 64);
    let mut rng = Rng::new(1);
    let (cell, head) = (tree_gru(embed, hidden)?, classifier(hidden, synthetic::CLASSES)?);
    println!("{cell}");
    let words = Embedding::new(synthetic::vocab().len(), embed, 0.1, &mut rng).with_padding(PAD);
    let mut model = Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)?;
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.01));
    let test_examples: Vec<Example<'_>> = test.iter().map(example).collect();
    for epoch in 1..=5 {
        for batch in train.chunks(25) {
            model.step(&batch.iter().map(example).collect::<Vec<_>>(), &mut opt, Some(5.0))?;
        }
        let p = model.infer(&test_examples)?.swap_remove(1);
        let right = p.chunks(synthetic::CLASSES).zip(&test_examples).filter(|(p, e)| {
            let best = p.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(k, _)| k);
            best.is_some_and(|k| e.target[k] == 1.0)
        });
        println!("epoch {epoch}: test root accuracy {:.4}", right.count() as f64 / test.len() as f64);
    }
    Ok(())
}
