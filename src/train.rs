//! Training tree classifiers: embedding → vertex function (on the engine) → softmax classifier.

use crate::checkpoint::{Checkpoint, Named};
use crate::data::{TreeExample, PAD};
use crate::engine::Engine;
use crate::layers::{Embedding, LossOn, SoftmaxClassifier};
use crate::optim::{clip_grad_norm, Optimizer};
use crate::{CpuBackend, InputGraph, VertexFn};
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;

/// A tree classifier: word vectors pulled by every vertex, a vertex function over the tree, and
/// a softmax classifier over the pushed state.
pub struct TreeClassifier {
    /// The input layer.
    pub embed: Embedding,
    /// The vertex function on its engine.
    pub engine: Engine<CpuBackend>,
    /// The output layer.
    pub out: SoftmaxClassifier,
}

/// Numbers from one minibatch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Mean loss over the targets.
    pub loss: f32,
    /// Targets predicted right.
    pub correct: usize,
    /// Targets.
    pub count: usize,
    /// Vertices processed.
    pub vertices: usize,
}

struct Batch<'a> {
    graphs: Vec<&'a InputGraph>,
    words: Vec<u32>,
    labels: Vec<u32>,
}

fn batch<'a>(examples: &[&'a TreeExample]) -> Batch<'a> {
    Batch {
        graphs: examples.iter().map(|e| &e.graph).collect(),
        words: examples.iter().flat_map(|e| e.words.iter().copied()).collect(),
        labels: examples.iter().flat_map(|e| e.labels.iter().copied()).collect(),
    }
}

impl TreeClassifier {
    /// A classifier around `cell` (which must pull one `embed`-wide input and push one row).
    pub fn new(cell: VertexFn, vocab: usize, classes: usize, rng: &mut Rng) -> Result<TreeClassifier> {
        let embed_dim = cell.inputs().first().map_or(0, |p| p.shape.numel());
        let hidden = cell.outputs().first().map_or(0, |p| p.shape.numel());
        let embed = Embedding::new(vocab, embed_dim, 0.1, rng).with_padding(PAD);
        let params = cell.init_params(rng);
        let engine = Engine::new(CpuBackend::new(), cell, &params)?;
        Ok(TreeClassifier { embed, engine, out: SoftmaxClassifier::new(hidden, classes, rng) })
    }

    /// One optimizer step on a minibatch; `clip` bounds the joint gradient norm.
    pub fn train_step(
        &mut self,
        examples: &[&TreeExample],
        loss_on: LossOn,
        opt: &mut Optimizer,
        clip: Option<f32>,
    ) -> Result<StepStats> {
        let b = batch(examples);
        let targets = loss_on.select(&b.graphs, &b.labels)?;
        let x = self.embed.lookup(&b.words)?;
        let h = self.engine.forward(&b.graphs, &[&x])?;
        let mut step = self.out.loss(&h[0], &targets)?;
        let mut grads = self.engine.backward(&[&step.grad_input])?;
        let mut sparse = self.embed.sparse_grad(&b.words, &grads.pulls[0])?;
        if let Some(max) = clip {
            let mut all: Vec<&mut [f32]> = grads.params.iter_mut().map(Vec::as_mut_slice).collect();
            all.push(&mut step.grads.weight);
            all.push(&mut step.grads.bias);
            all.push(&mut sparse.values);
            clip_grad_norm(&mut all, max);
        }
        opt.begin_step();
        let mut params = self.engine.params()?;
        for (i, (p, g)) in params.iter_mut().zip(&grads.params).enumerate() {
            opt.dense(i, p, g);
        }
        self.engine.set_params(&params)?;
        let n = params.len();
        let (w, bias) = self.out.params_mut();
        opt.dense(n, w, &step.grads.weight);
        opt.dense(n + 1, bias, &step.grads.bias);
        let dim = self.embed.dim();
        opt.sparse(n + 2, self.embed.table_mut(), dim, &sparse);
        Ok(StepStats { loss: step.loss, correct: step.correct, count: step.count, vertices: b.words.len() })
    }

    /// Every learned tensor, named: `cell.<param>`, `classifier.weight`, `classifier.bias`,
    /// `embedding`.
    pub fn tensors(&self) -> Result<Vec<Named>> {
        let f = self.engine.function();
        let mut out: Vec<Named> = f
            .params()
            .iter()
            .zip(self.engine.params()?)
            .map(|(p, v)| (format!("cell.{}", p.name), p.shape.dims().to_vec(), v))
            .collect();
        let (w, b) = self.out.params();
        out.push(("classifier.weight".into(), vec![w.len() / self.out.classes(), self.out.classes()], w.to_vec()));
        out.push(("classifier.bias".into(), vec![b.len()], b.to_vec()));
        out.push(("embedding".into(), vec![self.embed.vocab(), self.embed.dim()], self.embed.table().to_vec()));
        Ok(out)
    }

    /// Restores every learned tensor from a checkpoint made by [`TreeClassifier::tensors`].
    pub fn restore(&mut self, ck: &Checkpoint) -> Result<()> {
        let f = self.engine.function().clone();
        let params: Vec<Vec<f32>> = f
            .params()
            .iter()
            .map(|p| ck.tensor(&format!("cell.{}", p.name)).map(<[f32]>::to_vec))
            .collect::<Result<_>>()?;
        self.engine.set_params(&params)?;
        let copy = |dst: &mut [f32], name: &str| -> Result<()> {
            let src = ck.tensor(name)?;
            if src.len() != dst.len() {
                return Err(Error::Input {
                    what: format!("checkpoint tensor `{name}`"),
                    expected: format!("{} values", dst.len()),
                    got: src.len().to_string(),
                });
            }
            dst.copy_from_slice(src);
            Ok(())
        };
        let (w, b) = self.out.params_mut();
        copy(w, "classifier.weight")?;
        copy(b, "classifier.bias")?;
        copy(self.embed.table_mut(), "embedding")
    }

    /// Root accuracy over `data`, in minibatches of `batch` trees, in inference mode.
    pub fn accuracy(&mut self, data: &[TreeExample], batch_size: usize) -> Result<f64> {
        let (mut correct, mut count) = (0, 0);
        for chunk in data.chunks(batch_size.max(1)) {
            let refs: Vec<&TreeExample> = chunk.iter().collect();
            let b = batch(&refs);
            let targets = LossOn::Root.select(&b.graphs, &b.labels)?;
            let x = self.embed.lookup(&b.words)?;
            let h = self.engine.infer(&b.graphs, &[&x])?;
            let predicted = self.out.predict(&h[0])?;
            for (p, t) in predicted.iter().zip(&targets) {
                if let Some(t) = t {
                    count += 1;
                    correct += usize::from(*p == *t as usize);
                }
            }
        }
        Ok(if count == 0 { 0.0 } else { correct as f64 / count as f64 })
    }
}
