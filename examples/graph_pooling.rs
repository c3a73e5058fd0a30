//! Graph classification with a message-passing cell of one's own and a max-pool readout: each
//! MUTAG molecule is unrolled for a few steps of message passing (vertex `(v, t)` gathers its own
//! state and its neighbours' at `t − 1`), every vertex's state is max-pooled into one row per
//! molecule, and a head classifies it; the one loop (`Run`) trains it on four fifths of the
//! molecules and scores the last fifth. No gradient is written: the cell and the head are
//! declared in the IR, and the pooling's is exact.
//!
//! `cargo run --release --example graph_pooling`

use arbor::data::{data_dir, tu};
use arbor::head::{argmax, softmax_cross_entropy};
use arbor::layers::Embedding;
use arbor::model::{AsExample, Example, Feed, Model, Outputs, Tree};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, Event, Run, Scores, Settings, Splits};
use arbor::{Builder, CpuBackend, Init, InputGraph, VertexFn};
use std::time::Duration;

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

/// A molecule unrolled, with its node labels at every step and its class.
struct Molecule {
    graph: InputGraph,
    labels: Vec<u32>,
    class: usize,
    classes: usize,
}

impl Molecule {
    /// Molecule `g` of `data`; the edge to a node's own previous state gets a label of its own
    /// (the data set's edge-label count), apart from the bond types.
    fn new(g: &tu::GraphExample, data: &tu::TuDataset) -> arbor::Result<Molecule> {
        let classes = data.classes;
        Ok(Molecule {
            graph: g.unroll(STEPS, data.edge_label_count as u32)?,
            labels: g.node_labels.repeat(STEPS + 1),
            class: g.label as usize,
            classes,
        })
    }
}

impl AsExample for Molecule {
    /// The unrolled graph (the readout pools every vertex, so `root` is not read) and the
    /// class's one-hot row.
    fn example(&self) -> Example<'_> {
        let target = (0..self.classes).map(|c| f32::from(c == self.class)).collect();
        Example { trees: vec![Tree::new(&self.graph, &self.labels, 0)], target }
    }

    /// The accuracy of the head's `logits`, one row per molecule.
    fn score(outputs: &Outputs, data: &[Molecule]) -> arbor::Result<Scores> {
        let rows = outputs.get("logits")?.chunks(data.first().map_or(1, |m| m.classes));
        let right = rows.zip(data).filter(|(z, m)| argmax(z) == m.class).count();
        Ok(vec![("accuracy".into(), right as f64 / data.len() as f64)])
    }
}

fn main() -> arbor::Result<()> {
    // MUTAG from `ARBOR_DATA` (default `../shared/data`): this example has no synthetic fallback.
    let data = tu::read(&data_dir().join("mutag"), "MUTAG")?;
    let (features, hidden) = (16, 32);
    let mut rng = Rng::new(1);
    let mut molecules: Vec<Molecule> =
        data.graphs.iter().map(|g| Molecule::new(g, &data)).collect::<arbor::Result<_>>()?;
    rng.shuffle(&mut molecules);
    let (test, train) = molecules.split_at(molecules.len() / 5);
    let labels = Embedding::new(data.node_label_count, features, 0.5, &mut rng);
    let (cell, head) = (message_passing(features, hidden)?, classifier(hidden, data.classes)?);
    let model =
        Model::init(&CpuBackend::new(), labels, cell, vec![Feed::Words], head, &mut rng)?.with_readout(Readout::Max);
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adam, 0.005)), &rng);
    // No dev split: the held-out fifth is scored with the weights of the last epoch.
    let splits = Splits { train, dev: &[], test };
    let plan = Settings::new(60, 16);
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |e| {
        if let Event::EpochEnd { epoch, loss, .. } = e {
            if epoch % 10 == 0 {
                println!("epoch {epoch}: training loss {loss:.4}");
            }
        }
    })?;
    println!("held-out accuracy {:.3} after {} epochs", run.test_acc(), plan.epochs);
    Ok(())
}
