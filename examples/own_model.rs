//! A model of one's own, trained and saved: a cell arbor does not ship, a readout over every
//! vertex and a head of one's own, trained by the one loop (`Run`) on the synthetic treebank,
//! its checkpoints kept in a run folder with the vocabulary beside them. A second program,
//! `examples/own_model_classify.rs`, loads it from that folder alone and classifies new
//! sentences:
//!
//! ```text
//! cargo run --release --example own_model -- /tmp/my-model
//! cargo run --release --example own_model_classify -- /tmp/my-model "a good film" "not a good film"
//! ```

use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, PAD};
use arbor::head::softmax_cross_entropy;
use arbor::layers::{Embedding, LossOn};
use arbor::model::{Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::run_folder::{Existing, RunFolder};
use arbor::trainer::{Event, Run, Settings};
use arbor::{Builder, CpuBackend, Init, VertexFn};
use serde_json::json;
use std::path::PathBuf;

/// The cell: `h = tanh(x·W + [h₀, h₁]·U + b)`, the children's states side by side.
fn cell(embed: usize, hidden: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("concat-tanh", 2);
    let x = f.pull("x", embed);
    let children = f.gather(0, "h", hidden).concat(f.gather(1, "h", hidden));
    let w = f.param("W", [embed, hidden], Init::Xavier);
    let u = f.param("U", [2 * hidden, hidden], Init::Xavier);
    let h = (x.matmul(w) + children.matmul(u) + f.param("b", [1, hidden], Init::Zeros)).tanh();
    f.scatter("h", h);
    f.push("h", h);
    f.build()
}

/// The head: a hidden layer over the pooled row, then the class logits and their
/// cross-entropy to the one-hot label.
fn head(hidden: usize, classes: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("two-layer-classifier", 0);
    let (h, label) = (f.pull("h", hidden), f.pull("label", classes));
    let z = (h.matmul(f.param("W1", [hidden, hidden], Init::Xavier)) + f.param("b1", [1, hidden], Init::Zeros)).relu();
    let logits = z.matmul(f.param("W2", [hidden, classes], Init::Xavier)) + f.param("b2", [1, classes], Init::Zeros);
    f.push("loss", softmax_cross_entropy(logits, label));
    f.push("logits", logits);
    f.build()
}

fn main() -> arbor::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "own-model".into()));
    let trees = [synthetic::generate(3000, 12, 1), synthetic::generate(400, 12, 2)];
    let [train, dev] = trees.each_ref().map(|t| Labelled::all(t, LossOn::Root, synthetic::CLASSES));
    let (embed, hidden) = (32, 48);
    let mut rng = Rng::new(1);
    let vocab = synthetic::vocab();
    let words = Embedding::new(vocab.len(), embed, 0.1, &mut rng).with_padding(PAD);
    let (cell, head) = (cell(embed, hidden)?, head(hidden, synthetic::CLASSES)?);
    // The head reads each tree's mean over its vertices.
    let model =
        Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words], head, &mut rng)?.with_readout(Readout::Mean);
    let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adam, 0.01)), &rng);
    // The checkpoints hold the model (cell, head and readout as IR, and the learned values);
    // the vocabulary goes beside them, for the program that classifies new sentences.
    let plan = Settings { meta: json!({"vocab": vocab.words()}), ..Settings::new(4, 25).checkpoint(&dir) };
    let _folder = RunFolder::claim(&dir, Existing::Overwrite)?;
    let mut events = |e: Event| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
        }
    };
    let splits = arbor::trainer::Splits { train: &train, dev: &dev, test: &dev };
    let mut coll = arbor::dist::ThreadCollective::group(1, arbor::dist::DEFAULT_TIMEOUT).remove(0);
    run.fit(splits, &plan, &mut coll, &mut events)?;
    println!("saved to {} (best dev root accuracy {:.4})", dir.display(), run.best_dev());
    Ok(())
}
