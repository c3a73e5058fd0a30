//! Pipeline parallelism for a [`Model`] of stacked vertex functions ([`Model::stack`]: layer
//! `k + 1` pulls the row layer `k` pushed at the same vertex), cut into stages of whole layers
//! ([`Part::split`]). Stage 0 holds the word vectors, the last stage the head; every stage runs
//! on its own worker of a [`Collective`](crate::dist::Collective) (a thread or an MPI rank) and passes the rows of every
//! vertex forward and their gradients back. Examples are any [`AsExample`](crate::model::AsExample): trees with a label
//! per vertex ([`Labelled`](crate::data::labelled::Labelled)), sentence pairs, graphs with a
//! pooled readout.
//!
//! A minibatch is cut into micro-batches of about equal vertex counts; the stages run them in
//! the order of a [`schedule`](crate::dist::schedule) (1F1B with a flush, or PipeDream-2BW). A stage
//! keeps one engine per micro-batch it may hold at once, so a micro-batch's backward pass finds
//! its forward's values — and the weights its forward saw — untouched.
//!
//! A [`Stage`] is a [`Learner`](crate::trainer::Learner) whose workers each hold a part: it
//! trains in [`Run::fit`](crate::trainer::Run::fit), the one loop, with its checkpoints (every
//! stage's tensors gathered into one checkpoint of the whole model, named as the model names
//! them, so `Model::load` reads it), exact resume and weight averages.

use crate::dist::schedule::Kind;
use crate::engine::Engine;
use crate::head::Head;
use crate::layers::Embedding;
use crate::model::{Feed, Model};
use crate::readout::Readout;
use crate::{Backend, DropoutKey, VertexFn};
use arbor_core::error::{Error, Result};
use serde_json::Value;

mod learner;
mod stage;
pub use stage::{MinibatchGrads, Stage};

/// One layer of a model: a function (a vertex function, or the head) and its parameters.
#[derive(Clone)]
pub struct Layer {
    /// The function.
    pub f: VertexFn,
    /// Its parameters, in the function's order.
    pub params: Vec<Vec<f32>>,
    /// The seed its dropout masks are drawn from.
    pub seed: u64,
}

impl Layer {
    fn of<B: Backend>(engine: &Engine<B>) -> Result<Layer> {
        Ok(Layer { f: engine.function().clone(), params: engine.params()?, seed: engine.dropout_key().seed })
    }

    /// An engine running this layer on `backend`.
    fn engine<B: Backend>(&self, backend: B) -> Result<Engine<B>> {
        let mut e = Engine::new(backend, self.f.clone(), &self.params)?;
        e.set_dropout_key(DropoutKey { seed: self.seed, ..DropoutKey::default() });
        Ok(e)
    }

    /// A head running this layer on `backend`.
    fn head<B: Backend>(&self, backend: B) -> Result<Head<B>> {
        let mut h = Head::new(backend, self.f.clone(), &self.params)?;
        h.engine().set_dropout_key(DropoutKey { seed: self.seed, ..DropoutKey::default() });
        Ok(h)
    }
}

/// The part of a [`Model`] that one pipeline stage holds, as plain values.
#[derive(Clone)]
pub struct Part {
    /// The word vectors and what feeds each input of the bottom layer (first stage only).
    pub input: Option<(Embedding, Vec<Feed>)>,
    /// The index of its first layer in the whole model (its tensors are named after it).
    pub first: usize,
    /// Its vertex-function layers, bottom first.
    pub layers: Vec<Layer>,
    /// The head (last stage only).
    pub head: Option<Layer>,
    /// How the head reads the top layer.
    pub readout: Readout,
    /// Graphs per example.
    pub graphs: usize,
    /// What builds the whole model again (`model::ModelSpec` as JSON), for its checkpoints.
    pub spec: Option<Value>,
}

impl Part {
    /// Cuts `model` into `stages` parts of whole layers, as even as the layer count allows
    /// (copies of its learned values).
    pub fn split<B: Backend>(model: &Model<B>, stages: usize) -> Result<Vec<Part>> {
        let n = model.cells().len();
        if stages == 0 || stages > n {
            return Err(Error::input(
                "pipeline stages",
                format!("between 1 and the number of layers ({n})"),
                stages.to_string(),
            ));
        }
        let sizes: Vec<usize> = (0..stages).map(|s| (s + 1) * n / stages - s * n / stages).collect();
        Part::split_at(model, &sizes)
    }

    /// Cuts `model` into parts of `sizes[s]` whole layers each, bottom first (a plan's stages,
    /// [`crate::dist::planner::TrainPlan::stages`]; each at least one layer, all of them in all).
    pub fn split_at<B: Backend>(model: &Model<B>, sizes: &[usize]) -> Result<Vec<Part>> {
        let n = model.cells().len();
        if sizes.is_empty() || sizes.contains(&0) || sizes.iter().sum::<usize>() != n {
            return Err(Error::input(
                "pipeline stages",
                format!("stages of one layer or more, {n} layers in all"),
                format!("{sizes:?}"),
            ));
        }
        let mut layers = model.cells().iter().map(Layer::of).collect::<Result<Vec<_>>>()?.into_iter();
        let head = Layer {
            f: model.head().function().clone(),
            params: model.head().params()?,
            seed: model.head().dropout_key().seed,
        };
        let words = model.embedding().clone().with_table(model.word_vectors()?)?;
        let (mut input, mut head) = (Some((words, model.feeds().to_vec())), Some(head));
        let last = sizes.len() - 1;
        let mut first = 0;
        Ok(sizes
            .iter()
            .enumerate()
            .map(|(s, &count)| {
                first += count;
                Part {
                    input: if s == 0 { input.take() } else { None },
                    first: first - count,
                    layers: layers.by_ref().take(count).collect(),
                    head: if s == last { head.take() } else { None },
                    readout: model.readout(),
                    graphs: model.graphs_per_example(),
                    spec: Some(model.spec().to_json()),
                }
            })
            .collect())
    }

    /// The model that `parts` (in order, as [`Part::split`] cut them) make up, each engine on a
    /// replica of `backend`.
    pub fn join<B: Backend>(parts: Vec<Part>, backend: &B) -> Result<Model<B>> {
        let mut input = None;
        let (mut cells, mut head, mut readout) = (Vec::new(), None, Readout::Root);
        for part in parts {
            input = input.or(part.input);
            head = head.or(part.head);
            readout = part.readout;
            for l in &part.layers {
                cells.push(l.engine(backend.replica()?)?);
            }
        }
        let missing = |what: &str| Error::input("pipeline parts", format!("{what} on one of them"), "none");
        let (embedding, feeds) = input.ok_or_else(|| missing("the word vectors"))?;
        let head = head.ok_or_else(|| missing("the head"))?.head(backend.replica()?)?;
        Model::assemble(embedding, cells, feeds, head, readout)
    }

    /// Every learned value, in order: the word vectors, each layer's parameters, the head's.
    pub fn values(&self) -> Vec<f32> {
        let mut out = self.input.as_ref().map(|(e, _)| e.table().to_vec()).unwrap_or_default();
        for l in self.layers.iter().chain(&self.head) {
            l.params.iter().for_each(|p| out.extend(p));
        }
        out
    }
}

/// How a pipeline runs a minibatch: its schedule and the micro-batches it is cut into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipeSettings {
    /// The schedule.
    pub kind: Kind,
    /// Micro-batches per minibatch (at least the number of stages for 2BW).
    pub micro_batches: usize,
}

impl PipeSettings {
    /// Checks the plan against the number of stages and the examples per minibatch: at least
    /// one micro-batch, no more than a minibatch has examples, and for 2BW at least one per
    /// stage.
    pub fn check(&self, stages: usize, batch: usize) -> Result<()> {
        let m = self.micro_batches;
        if m == 0 || m > batch.max(1) || (self.kind == Kind::TwoBw && m < stages) {
            return Err(Error::input(
                "--micro-batches",
                format!(
                    "at least 1, at most the examples of a minibatch (--batch {batch}), and at least the number of stages ({stages}) for 2BW"
                ),
                m.to_string(),
            ));
        }
        Ok(())
    }
}
