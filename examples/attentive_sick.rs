//! Sentence relatedness on SICK with an attentive child-sum Tree-LSTM: each word attends over its
//! dependents, scoring each dependent's key — made from its state and its dependency relation —
//! against a query made from the word's own vector (`gather_softmax`: a softmax over the actual
//! dependents, shifted by the largest score, no `exp` or division written by hand). The relation
//! reaches the dependent as a one-hot row of its parent edge's label (`Feed::ParentEdge`, the
//! labels `sick::read` puts on the trees from `a.rels`/`b.rels`). The forget gates, memory cell
//! and head are those of Tai et al. (2015), as in `examples/sick.rs`.
//!
//! `cargo run --release --example attentive_sick -- [EPOCHS] [TRAIN_PAIRS]` (data:
//! `$ARBOR_DATA/sick`).

use arbor::data::{sick, PAD};
use arbor::layers::Embedding;
use arbor::model::{Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, Event, Run, Settings, Splits};
use arbor::{nn, Builder, CpuBackend, Init, VertexFn};
use std::time::Duration;

/// The cell: pulls the word `x`, its head's word `x_parent` and its relation to the head
/// (one-hot, `relations` wide); scatters `h`, `fc = f ⊙ c` (the forget gate at the parent) and
/// the key `k` its head scores.
fn attentive_child_sum(embed: usize, hidden: usize, relations: usize) -> arbor::Result<VertexFn> {
    let f = Builder::new("attentive-child-sum", 0);
    let (x, x_parent, relation) = (f.pull("x", embed), f.pull("x_parent", embed), f.pull("relation", relations));
    let param = |name: &str, rows: usize, cols: usize| f.param(name, [rows, cols], Init::Xavier);
    // The word's query against its dependents' keys: what it attends to depends on the word.
    let query = x.matmul(param("Wq", embed, hidden));
    let attended = f.gather_softmax(query, "k", "h", hidden);
    let gates = x.matmul(param("W", embed, 3 * hidden))
        + attended.matmul(param("U", hidden, 3 * hidden))
        + f.param("b", [1, 3 * hidden], Init::Zeros);
    let gate = |k: usize| gates.slice(k * hidden, hidden);
    let (i, o, u) = (gate(0).sigmoid(), gate(1).sigmoid(), gate(2).tanh());
    let c = i * u + f.gather_sum("fc", hidden);
    let h = o * c.tanh();
    let forget = x_parent.matmul(param("Wf", embed, hidden))
        + h.matmul(param("Uf", hidden, hidden))
        + f.param("bf", [1, hidden], Init::Zeros);
    f.scatter("h", h);
    f.scatter("fc", forget.sigmoid() * c);
    f.scatter("k", (h.matmul(param("Wk", hidden, hidden)) + relation.matmul(param("Wr", relations, hidden))).tanh());
    f.push("h", h);
    f.build()
}

fn main() -> arbor::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (epochs, limit) = (args.first().copied().unwrap_or(3), args.get(1).copied().unwrap_or(usize::MAX));
    let (embed, hidden) = (300, 150);
    let data = sick::read_splits(&arbor::data::data_dir().join("sick"), true)?;
    let mut rng = Rng::new(1);
    let words = Embedding::new(data.vocab.len(), embed, 0.1, &mut rng).with_padding(PAD);
    let cell = attentive_child_sum(embed, hidden, sick::RELATIONS.len())?;
    let head = nn::relatedness_head(hidden, 50, sick::CLASSES)?;
    let feeds = vec![Feed::Words, Feed::ParentWords, Feed::ParentEdge(sick::RELATIONS.len())];
    let model = Model::init(&CpuBackend::new(), words, cell, feeds, head, &mut rng)?;
    let opt = Optimizer::new(Config { weight_decay: 1e-4, ..Config::new(Rule::Adagrad, 0.05) });
    let mut run = Run::new(model, opt, &rng);
    let train = &data.train[..limit.min(data.train.len())];
    let splits = Splits { train, dev: &data.dev, test: &data.test };
    let plan = Settings { clip: None, ..Settings::new(epochs, 25) };
    fit_threads(&mut run, 1, Duration::from_secs(60), splits, &plan, &mut |e| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: mean KL {loss:.4}, dev Pearson {dev:.4}");
        }
    })?;
    let scores: Vec<String> = run.test_scores().iter().map(|(name, v)| format!("{name} {v:.4}")).collect();
    println!("test {} (at the best dev Pearson, {:.4})", scores.join(", "), run.best_dev());
    Ok(())
}
