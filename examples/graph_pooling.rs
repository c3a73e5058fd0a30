//! Graph classification with a message-passing cell of one's own and a max-pool readout: each
//! MUTAG molecule is unrolled for a few steps of message passing (vertex `(v, t)` gathers its own
//! state and its neighbours' at `t − 1`), every vertex's state is max-pooled into one row per
//! molecule, and a head classifies it. No gradient is written: the cell and the head are
//! declared in the IR, and the pooling's is exact.
//!
//! `cargo run --release --example graph_pooling`

use arbor::data::{data_dir, tu};
use arbor::head::softmax_cross_entropy;
use arbor::layers::Embedding;
use arbor::model::{Example, Feed, Model, Tree};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::{Builder, CpuBackend, Init, InputGraph, VertexFn};

const STEPS: usize = 3;

/// `h = tanh(x·V + h_prev·U + (Σ neighbours' h)·W + b)`: slot 0 is the node itself one step
/// earlier, `gather_sum` adds every child (itself included, so it is subtracted).
fn message_passing(features: usize, hidden: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("message-passing", 1);
    let x = f.pull("x", features);
    let prev = f.gather(0, "h", hidden);
    let neighbours = f.gather_sum("h", hidden) - prev;
    let param = |name: &str, rows: usize| f.param(name, [rows, hidden], Init::Xavier);
    let h = (x.matmul(param("V", features))
        + prev.matmul(param("U", hidden))
        + neighbours.matmul(param("W", hidden))
        + f.param("b", [1, hidden], Init::Zeros))
    .tanh();
    f.scatter("h", h);
    f.push("h", h);
    f.build()
}

/// Logits of the classes from the pooled row, with dropout; the loss is their cross-entropy.
fn classifier(hidden: usize, classes: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("classifier", 0);
    let (h, target) = (f.pull("h", hidden), f.pull("target", classes));
    let logits =
        h.dropout(0.2).matmul(f.param("W", [hidden, classes], Init::Xavier)) + f.param("b", [1, classes], Init::Zeros);
    f.push("loss", softmax_cross_entropy(logits, target));
    f.push("logits", logits);
    f.build()
}

/// A molecule unrolled, with its node labels at every step and its class one-hot.
struct Molecule {
    graph: InputGraph,
    labels: Vec<u32>,
    target: Vec<f32>,
}

impl Molecule {
    fn new(g: &tu::GraphExample, classes: usize) -> Molecule {
        let target = (0..classes).map(|c| f32::from(c == g.label as usize)).collect();
        Molecule { graph: g.unroll(STEPS), labels: g.node_labels.repeat(STEPS + 1), target }
    }

    fn example(&self) -> Example<'_> {
        // The readout pools every vertex, so `root` is not read.
        Example { trees: vec![Tree::new(&self.graph, &self.labels, 0)], target: self.target.clone() }
    }
}

fn main() -> arbor::Result<()> {
    let data = tu::read(&data_dir().join("mutag"), "MUTAG")?;
    let (features, hidden) = (16, 32);
    let mut rng = Rng::new(1);
    let mut molecules: Vec<Molecule> = data.graphs.iter().map(|g| Molecule::new(g, data.classes)).collect();
    rng.shuffle(&mut molecules);
    let (test, train) = molecules.split_at(molecules.len() / 5);
    let labels = Embedding::new(data.node_label_count, features, 0.5, &mut rng);
    let (cell, head) = (message_passing(features, hidden)?, classifier(hidden, data.classes)?);
    let mut model =
        Model::init(&CpuBackend::new(), labels, cell, vec![Feed::Words], head, &mut rng)?.with_readout(Readout::Max);
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.005));
    let test_examples: Vec<Example<'_>> = test.iter().map(Molecule::example).collect();
    let mut order: Vec<usize> = (0..train.len()).collect();
    for epoch in 1..=60 {
        rng.shuffle(&mut order);
        let mut loss = 0.0;
        for batch in order.chunks(16) {
            let examples: Vec<Example<'_>> = batch.iter().map(|&i| train[i].example()).collect();
            loss += model.step(&examples, &mut opt, Some(5.0))?[0].iter().sum::<f32>();
        }
        if epoch % 10 == 0 {
            let logits = model.infer(&test_examples)?.swap_remove(1);
            let argmax = |z: &[f32]| (0..z.len()).fold(0, |best, c| if z[c] > z[best] { c } else { best });
            let correct = logits.chunks(data.classes).zip(test).filter(|(z, m)| m.target[argmax(z)] == 1.0).count();
            let accuracy = correct as f32 / test.len() as f32;
            println!("epoch {epoch}: training loss {:.4}, test accuracy {accuracy:.3}", loss / train.len() as f32);
        }
    }
    Ok(())
}
