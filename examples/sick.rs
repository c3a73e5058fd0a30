//! Sentence relatedness on SICK (Tai et al. 2015): a child-sum Tree-LSTM over each sentence's
//! dependency tree (any number of dependents per word), `[|h_a − h_b|, h_a ⊙ h_b]` of the two roots, 50 sigmoid units, a softmax
//! over the scores 1..5 and the KL divergence to the gold score's distribution — the cell and
//! the head both declared in the IR, no gradient written by hand.
//!
//! `cargo run --release --example sick -- [EPOCHS] [TRAIN_PAIRS]` (data: `$ARBOR_DATA/sick`).

use arbor::core::rng::Rng;
use arbor::data::sick::{self, Pair};
use arbor::data::PAD;
use arbor::dist::data_parallel::merge;
use arbor::head::{kl_divergence, Head};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::{Builder, CpuBackend, Engine, Init, InputGraph, Pull, SparseGrad, VertexFn};

const EMBED: usize = 300;
const HIDDEN: usize = 150;

/// The relatedness head: pushes the loss and the score distribution `q`.
fn head() -> arbor::Result<VertexFn> {
    let f = Builder::new("relatedness", 0);
    let (ha, hb, p) = (f.pull("ha", HIDDEN), f.pull("hb", HIDDEN), f.pull("target", sick::CLASSES));
    let w = f.param("W", [2 * HIDDEN, 50], Init::Xavier);
    let b = f.param("b", [1, 50], Init::Zeros);
    let v = f.param("V", [50, sick::CLASSES], Init::Xavier);
    let log_q = ((ha - hb).abs().concat(ha * hb).matmul(w) + b).sigmoid().matmul(v).log_softmax();
    f.push("loss", kl_divergence(log_q, p));
    f.push("q", log_q.exp());
    f.build()
}

/// The model: the cell's engine, the head, the word vectors.
struct Model {
    cells: Engine<CpuBackend>,
    head: Head<CpuBackend>,
    table: Vec<f32>,
}

impl Model {
    /// Runs a minibatch (both sentences of every pair through the cell, the roots through the
    /// head); with `opt`, also a training step. Returns the losses and predicted scores.
    fn run(&mut self, pairs: &[&Pair], opt: Option<&mut Optimizer>) -> arbor::Result<(Vec<f32>, Vec<f32>)> {
        let sentences: Vec<&sick::Sentence> = pairs.iter().flat_map(|p| [&p.a, &p.b]).collect();
        let graphs: Vec<&InputGraph> = sentences.iter().map(|s| &s.graph).collect();
        let ids: Vec<u32> = sentences.iter().flat_map(|s| s.words.iter().copied()).collect();
        // Each token's head word (the padding row at a root) for its forget gate there, and
        // where the roots are.
        let (mut head_ids, mut roots, mut at) = (vec![PAD; ids.len()], Vec::new(), 0);
        for s in &sentences {
            for v in 0..s.graph.len() {
                s.graph.children(v).iter().for_each(|&c| head_ids[at + c as usize] = s.words[v]);
            }
            roots.push(at + s.root);
            at += s.graph.len();
        }
        let pulls = [
            Pull::Lookup { table: &self.table, ids: &ids, padding: None },
            Pull::Lookup { table: &self.table, ids: &head_ids, padding: Some(PAD) },
        ];
        let h = self.cells.forward_rows(&graphs, &pulls, &roots)?.swap_remove(0);
        let (ha, hb): (Vec<&[f32]>, Vec<&[f32]>) =
            (h.chunks(HIDDEN).step_by(2).collect(), h.chunks(HIDDEN).skip(1).step_by(2).collect());
        let target: Vec<f32> = pairs.iter().flat_map(|p| sick::target_distribution(p.score)).collect();
        let mut out = self.head.forward(&[&ha.concat(), &hb.concat(), &target])?;
        let scores =
            out[1].chunks(sick::CLASSES).map(|q| q.iter().enumerate().map(|(k, q)| (k + 1) as f32 * q).sum()).collect();
        if let Some(opt) = opt {
            let hg = self.head.backward(1.0 / pairs.len() as f32)?;
            let dh: Vec<f32> =
                hg.pulls[0].chunks(HIDDEN).zip(hg.pulls[1].chunks(HIDDEN)).flat_map(|(a, b)| [a, b].concat()).collect();
            let cg = self.cells.backward_rows(&roots, &[&dh])?;
            opt.begin_step();
            let names =
                |f: &VertexFn, of: &str| f.params().iter().map(|p| format!("{of}.{}", p.name)).collect::<Vec<_>>();
            let cell_names = names(self.cells.function(), "cell");
            self.cells.update_params(|ps| {
                ps.into_iter().zip(&cg.params).zip(&cell_names).for_each(|((p, g), n)| opt.dense(n, p, g))
            })?;
            let head_names = names(self.head.engine().function(), "head");
            self.head.engine().update_params(|ps| {
                ps.into_iter().zip(&hg.params).zip(&head_names).for_each(|((p, g), n)| opt.dense(n, p, g))
            })?;
            let words: Vec<SparseGrad> = cg.tables.into_iter().flatten().collect();
            opt.sparse("embedding", &mut self.table, EMBED, &merge(&words, EMBED));
        }
        Ok((out.swap_remove(0), scores))
    }
}

/// Pearson's correlation of `a` and `b`.
fn pearson(a: &[f32], b: &[f32]) -> f64 {
    let mean = |x: &[f32]| x.iter().map(|&v| f64::from(v)).sum::<f64>() / x.len() as f64;
    let (ma, mb) = (mean(a), mean(b));
    let (mut ab, mut aa, mut bb) = (0.0, 0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x) - ma, f64::from(y) - mb);
        (ab, aa, bb) = (ab + x * y, aa + x * x, bb + y * y);
    }
    ab / (aa * bb).sqrt()
}

fn main() -> arbor::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (epochs, limit) = (args.first().copied().unwrap_or(3), args.get(1).copied().unwrap_or(usize::MAX));
    let data = sick::read_splits(&arbor::data::data_dir().join("sick"), true)?;
    let mut rng = Rng::new(1);
    let cell = arbor::nn::child_sum_tree_lstm_nary(EMBED, HIDDEN)?;
    let head = head()?;
    let table = (0..data.vocab.len() * EMBED).map(|_| (rng.uniform() - 0.5) * 0.2).collect();
    let (cell_params, head_params) = (cell.init_params(&mut rng), head.init_params(&mut rng));
    let mut model = Model {
        cells: Engine::new(CpuBackend::new(), cell, &cell_params)?,
        head: Head::new(CpuBackend::new(), head, &head_params)?,
        table,
    };
    let mut opt = Optimizer::new(Config { weight_decay: 1e-4, ..Config::new(Rule::Adagrad, 0.05) });
    let mut train: Vec<&Pair> = data.train.iter().take(limit).collect();
    let evaluate = |model: &mut Model, pairs: &[Pair]| -> arbor::Result<f64> {
        let (mut got, gold): (Vec<f32>, Vec<f32>) = (Vec::new(), pairs.iter().map(|p| p.score).collect());
        for chunk in pairs.chunks(256) {
            got.extend(model.run(&chunk.iter().collect::<Vec<_>>(), None)?.1);
        }
        Ok(pearson(&got, &gold))
    };
    let (mut best_dev, mut test) = (f64::MIN, f64::NAN);
    for epoch in 1..=epochs {
        rng.shuffle(&mut train);
        let mut loss = 0.0;
        for batch in train.chunks(25) {
            loss += model.run(batch, Some(&mut opt))?.0.iter().sum::<f32>();
        }
        let dev = evaluate(&mut model, &data.dev)?;
        println!("epoch {epoch}: mean KL {:.4}, dev Pearson {dev:.4}", loss / train.len() as f32);
        if dev > best_dev {
            (best_dev, test) = (dev, evaluate(&mut model, &data.test)?);
        }
    }
    println!("test Pearson {test:.4} (at the best dev Pearson, {best_dev:.4})");
    Ok(())
}
