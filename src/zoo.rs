//! The zoo's models as presets: each builds a [`Model`] (word or node-label vectors, cells, a
//! readout and a softmax classifier) that trains through [`Run`] like a
//! model of one's own.

use crate::data::tu::{TuDataset, Unrolled};
use crate::head::softmax_classifier;
use crate::layers::Embedding;
use crate::model::{Feed, Model};
use crate::optim::{Config, Optimizer};
use crate::readout::Readout;
use crate::trainer::{cross_validate, CvResult, Event, Folds, Run, Settings};
use crate::{Backend, DropoutKey, VertexFn};
use arbor_core::error::{Error, Result};
use arbor_core::rng::Rng;
use serde_json::{json, Value};
use std::path::PathBuf;

/// A classifier of `cells` stacked bottom first (each above the first pulls the row the one
/// below pushes, all pushing rows of one width) over `words`, on replicas of `backend`: a
/// softmax classifier over `classes` reads the top cell's rows with `readout`. Parameters are
/// drawn from `rng` (the bottom cell's, the head's, then each layer's above); each layer's
/// dropout masks are keyed by `seed`.
pub fn classifier<B: Backend>(
    backend: &B,
    words: Embedding,
    cells: Vec<VertexFn>,
    classes: usize,
    readout: Readout,
    seed: u64,
    rng: &mut Rng,
) -> Result<Model<B>> {
    let width = cells.last().map_or(0, crate::model::width_out);
    let mut cells = cells.into_iter();
    let bottom = cells.next().ok_or_else(|| Error::input("classifier", "at least one vertex function", "none"))?;
    let head = softmax_classifier(width, classes)?;
    let mut model = Model::init(backend, words, bottom, vec![Feed::Words], head, rng)?;
    for f in cells {
        model = model.stack(f, rng)?;
    }
    for e in model.cells_mut() {
        e.set_dropout_key(DropoutKey { seed: seed.wrapping_add(e.dropout_key().seed), ..e.dropout_key() });
    }
    Ok(model.with_readout(readout))
}

/// The classifier of one `cell` over a treebank's `vocab` words (word [`PAD`](crate::data::PAD)
/// is no word: its vector stays zero) on the CPU, reading the vertices that `loss_on` puts the
/// loss on ([`Labelled`](crate::data::labelled::Labelled) examples): word vectors as wide as the
/// cell's input, drawn from `rng`, then the cell's and the head's parameters.
pub fn tree_classifier(
    cell: VertexFn,
    vocab: usize,
    classes: usize,
    loss_on: crate::layers::LossOn,
    rng: &mut Rng,
) -> Result<Model<crate::CpuBackend>> {
    let readout = crate::data::labelled::Labelled::readout(loss_on);
    tree_classifier_on(&crate::CpuBackend::new(), vec![cell], vocab, classes, readout, rng)
}

/// [`tree_classifier`] of stacked `cells` on replicas of `backend`, reading with `readout`.
pub fn tree_classifier_on<B: Backend>(
    backend: &B,
    cells: Vec<VertexFn>,
    vocab: usize,
    classes: usize,
    readout: Readout,
    rng: &mut Rng,
) -> Result<Model<B>> {
    let dim = cells.first().and_then(|c| c.inputs().first()).map_or(0, |x| x.shape.numel());
    let words = Embedding::new(vocab, dim, 0.1, rng).with_padding(crate::data::PAD);
    classifier(backend, words, cells, classes, readout, 0, rng)
}

/// The cell of graph classification: a message-passing layer unrolled over the steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GraphCell {
    /// A gated graph network ([`nn::ggnn`](crate::nn::ggnn)).
    #[default]
    Ggnn,
    /// A graph isomorphism network layer ([`nn::gin`](crate::nn::gin)).
    Gin,
    /// A graph attention layer ([`nn::gat`](crate::nn::gat)).
    Gat,
}

impl GraphCell {
    /// Every cell.
    pub const ALL: [GraphCell; 3] = [GraphCell::Ggnn, GraphCell::Gin, GraphCell::Gat];

    /// Its name (`ggnn`, `gin`, `gat`), as the CLI and checkpoints call it.
    pub fn name(self) -> &'static str {
        match self {
            GraphCell::Ggnn => "ggnn",
            GraphCell::Gin => "gin",
            GraphCell::Gat => "gat",
        }
    }

    /// The cell named `name`, if any.
    pub fn from_name(name: &str) -> Option<GraphCell> {
        GraphCell::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Its vertex function over `features`-wide node vectors and `hidden`-wide states, on
    /// graphs of `edge_labels` edge labels (0: unlabelled; GIN weighs each label's neighbours
    /// apart, the others read every edge alike), pushing also a score per vertex for
    /// [`Readout::Attention`].
    pub fn function(self, features: usize, hidden: usize, edge_labels: usize, readout: Readout) -> Result<VertexFn> {
        let scores = readout.scores();
        match self {
            GraphCell::Ggnn => crate::nn::ggnn_scored(features, hidden, scores),
            GraphCell::Gin => crate::nn::gin_scored(features, hidden, edge_labels as u32, scores),
            GraphCell::Gat => crate::nn::gat_scored(features, hidden, scores),
        }
    }

    /// How the final step is pooled: summed for GIN (as its authors read out), the mean for
    /// the others.
    pub fn readout(self) -> Readout {
        match self {
            GraphCell::Gin => Readout::Sum,
            GraphCell::Ggnn | GraphCell::Gat => Readout::Mean,
        }
    }
}

/// Settings of graph classification by cross-validation ([`cross_validate_graphs`]).
#[derive(Clone, Debug)]
pub struct GraphTraining {
    /// The message-passing cell.
    pub cell: GraphCell,
    /// Message-passing steps.
    pub steps: usize,
    /// Node-feature (label vector) width.
    pub features: usize,
    /// Hidden state width.
    pub hidden: usize,
    /// How a step's nodes are pooled ([`GraphCell::readout`] by default; with
    /// [`Readout::Attention`] the cell pushes a score per node).
    pub readout: Readout,
    /// Read every step, not only the last: each step's nodes pooled apart, the rows concatenated
    /// for the classifier (jumping knowledge, as GIN reads out; the unrolled graph still runs
    /// once).
    pub every_step: bool,
    /// Weights of their own for each message-passing step (GIN's layers), not one cell shared
    /// by every step (gin only).
    pub per_step: bool,
    /// Dropout on the classifier's input.
    pub dropout: f32,
    /// Passes over each fold's training graphs.
    pub epochs: usize,
    /// Graphs per minibatch.
    pub batch: usize,
    /// Folds.
    pub folds: usize,
    /// Models trained per fold, each from its own initialisation and order, that score its
    /// held-out graphs together by their mean class probabilities (an ensemble; 1 by default:
    /// one model).
    pub ensemble: usize,
    /// Seed for the split, the initialisation and the order.
    pub seed: u64,
    /// Optimizer settings.
    pub optimizer: Config,
    /// Gradient-norm bound.
    pub clip: Option<f32>,
    /// Multiply the learning rate by this factor after every epoch ([`Settings::lr_decay`]);
    /// none by default.
    pub lr_decay: Option<f32>,
    /// Score each fold with an exponential moving average of the weights of this decay per
    /// step ([`Run::with_average`]); none by default.
    pub average: Option<f32>,
    /// Keep each fold's checkpoints in a folder of its own here (`fold-0`, `fold-1`, …; see
    /// [`trainer::fold_dir`](crate::trainer::fold_dir)); none by default.
    pub checkpoint: Option<PathBuf>,
    /// What each fold's checkpoint records beside the run's state, the fold and the settings
    /// here (e.g. where the data is, for `arbor eval`).
    pub meta: Value,
}

impl GraphTraining {
    /// The settings `arbor train --model` uses for `cell`: 4 steps, 16-wide features, 32-wide
    /// states, the cell's readout of the last step, 100 epochs of Adam at 0.005 on minibatches
    /// of 25, gradients clipped to norm 5, 10 folds, seed 1.
    pub fn new(cell: GraphCell) -> GraphTraining {
        GraphTraining {
            cell,
            steps: 4,
            features: 16,
            hidden: 32,
            readout: cell.readout(),
            every_step: false,
            per_step: false,
            dropout: 0.0,
            epochs: 100,
            batch: 25,
            folds: 10,
            ensemble: 1,
            seed: 1,
            optimizer: Config::new(crate::optim::Rule::Adam, 0.005),
            clip: Some(5.0),
            lr_decay: None,
            average: None,
            checkpoint: None,
            meta: Value::Null,
        }
    }

    /// The cell's vertex function on graphs of `edge_labels` edge labels (with weights per step,
    /// [`crate::nn::gin_per_step_scored`], which pulls [`Feed::Height`] as a second input).
    fn function(&self, edge_labels: usize) -> Result<VertexFn> {
        let (features, hidden, labels) = (self.features, self.hidden, edge_labels as u32);
        match (self.per_step, self.cell) {
            (false, cell) => cell.function(features, hidden, edge_labels, self.readout),
            (true, GraphCell::Gin) => {
                crate::nn::gin_per_step_scored(features, hidden, labels, self.steps, self.readout.scores())
            }
            (true, cell) => Err(Error::input("weights per message-passing step", "the gin cell", cell.name())),
        }
    }

    /// What the cell pulls: the node-label vectors, and the step's one-hot row for weights per
    /// step.
    fn feeds(&self) -> Vec<Feed> {
        let step = self.per_step.then_some(Feed::Height(self.steps + 1));
        [Feed::Words].into_iter().chain(step).collect()
    }

    /// The steps whose nodes the classifier reads: every step, or the last.
    fn steps_read(&self) -> usize {
        if self.every_step {
            self.steps + 1
        } else {
            1
        }
    }
}

/// A message-passing classifier of the graphs of `data` as `cfg` says: node label vectors, the
/// cell, the last step's nodes (or every step's, each apart) pooled by `cfg.readout`, a softmax
/// classifier over the rows read (dropout `cfg.dropout` on them).
pub fn graph_classifier<B: Backend>(
    backend: &B,
    data: &TuDataset,
    cfg: &GraphTraining,
    rng: &mut Rng,
) -> Result<Model<B>> {
    let labels = Embedding::new(data.node_label_count, cfg.features, 0.1, rng);
    let f = cfg.function(data.edge_label_count)?;
    let head = crate::head::pooled_classifier(cfg.hidden, cfg.steps_read(), data.classes, cfg.dropout)?;
    Ok(Model::init(backend, labels, f, cfg.feeds(), head, rng)?.with_readout(cfg.readout))
}

/// Refuses graph training that would not fit in memory, before anything is allocated: the
/// model (node-label vectors, cell, classifier), every graph unrolled over `cfg.steps` and the
/// values of the largest minibatch.
fn check_graph_training(data: &TuDataset, cfg: &GraphTraining) -> Result<()> {
    let cell = cfg.function(data.edge_label_count)?;
    let labels = (data.node_label_count * cfg.features) as u128 + (cfg.hidden * data.classes) as u128;
    crate::memory::check_model("--hidden and --embed", crate::memory::param_floats(&cell) + labels, 1)?;
    let steps = cfg.steps as u128 + 1;
    // A vertex of an unrolled graph: its slot list, its label id and its child slots.
    let unrolled: u128 = data
        .graphs
        .iter()
        .map(|g| 36 * g.node_labels.len() as u128 + 4 * g.neighbours.iter().map(|n| n.len() as u128).sum::<u128>())
        .sum::<u128>()
        * steps;
    let mut sizes: Vec<usize> = data.graphs.iter().map(|g| g.node_labels.len()).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let largest: u128 = sizes.iter().take(cfg.batch.max(1)).map(|&n| n as u128).sum::<u128>() * steps;
    let values = largest * crate::memory::vertex_floats(&cell) * 4;
    crate::memory::check(
        "--steps, --hidden, --embed and --batch",
        unrolled.saturating_add(values),
        "unrolled graphs and a minibatch's values",
    )
}

/// Cross-validated accuracy of a fresh [`graph_classifier`] of `cfg.cell` per fold on replicas of `backend`, each trained
/// through [`Run`], with the held-out curve ([`CvResult::curve`]); `progress` is told `(fold, epoch)` after every
/// epoch.
pub fn cross_validate_graphs<B: Backend>(
    backend: &B,
    data: &TuDataset,
    cfg: &GraphTraining,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CvResult>
where
    Run<Model<B>>: Send,
{
    let n = data.graphs.len();
    if cfg.folds < 2 || cfg.folds > n {
        let expected = format!("between 2 and the number of graphs ({n})");
        return Err(Error::input("cross-validation folds", expected, cfg.folds.to_string()));
    }
    if let Some(d) = cfg.lr_decay {
        Settings::check_lr_decay("learning-rate decay", d)?;
    }
    check_graph_training(data, cfg)?;
    let graphs = Unrolled::all(data, cfg.steps, cfg.every_step)?;
    let mut meta = if cfg.meta.is_object() { cfg.meta.clone() } else { json!({}) };
    (meta["model"], meta["message_steps"], meta["seed"]) = (json!(cfg.cell.name()), json!(cfg.steps), json!(cfg.seed));
    (meta["every_step"], meta["per_step"], meta["lr_decay"]) =
        (json!(cfg.every_step), json!(cfg.per_step), json!(cfg.lr_decay));
    let checkpoint = cfg.checkpoint.clone();
    // The held-out curve costs a scoring of one fold per epoch; it chooses nothing.
    let plan = Settings { clip: cfg.clip, checkpoint, meta, test_curve: true, ..Settings::new(cfg.epochs, cfg.batch) };
    let plan = match cfg.lr_decay {
        Some(decay) => plan.lr_decay(decay),
        None => plan,
    };
    let mut rng = Rng::new(cfg.seed);
    let mut new_run = |_fold: usize, _member: usize| {
        let model = graph_classifier(backend, data, cfg, &mut rng)?;
        let order = Rng::new(rng.next_u64());
        let run = Run::new(model, Optimizer::new(cfg.optimizer), &order);
        match cfg.average {
            Some(decay) => run.with_average(decay),
            None => Ok(run),
        }
    };
    let mut events = |fold: usize, e: Event| {
        if let Event::EpochEnd { epoch, .. } = e {
            progress(fold, epoch);
        }
    };
    // Folds hold the classes in proportion.
    let classes: Vec<u32> = data.graphs.iter().map(|g| g.label).collect();
    let folds = Folds { count: cfg.folds, seed: cfg.seed, members: cfg.ensemble };
    let mut pool = |runs: &mut [Run<Model<B>>], test: &[Unrolled]| {
        Ok(crate::ensemble::score_runs(runs, test)?.first().map_or(f64::NAN, |s| s.1))
    };
    cross_validate(&graphs, &classes, folds, &plan, &mut new_run, Some(&mut pool), &mut events)
}
