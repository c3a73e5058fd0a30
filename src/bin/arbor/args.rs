//! The command line: subcommands and their flags.

use arbor::dist::schedule::Kind;
use arbor::nn::{CellDropout, CellKind};
use arbor::readout::Readout;
use arbor::trainer::Every;
use arbor::zoo::GraphCell;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "arbor", version, about = "Deep learning on trees, sequences and graphs")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Train a model. With no --data, trains the binary Tree-LSTM on the built-in synthetic treebank.
    Train(Box<TrainArgs>),
    /// Evaluate a checkpoint on the test split of its data.
    Eval(EvalArgs),
    /// Measure training or inference throughput on SST (or synthetic trees).
    Bench(BenchArgs),
    /// Classify new sentences with a checkpoint: one JSON line per sentence.
    Predict(PredictArgs),
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub(crate) enum Mode {
    /// Forward, backward, and the optimizer update.
    Train,
    /// Forward only (inference mode: nothing kept for backward).
    Infer,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
pub(crate) enum PrecisionArg {
    F32,
    Tf32,
    Bf16,
    F16,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub(crate) enum Device {
    Cpu,
    Cuda,
}

#[derive(Parser)]
pub(crate) struct BenchArgs {
    /// The model (ggnn is benchmarked by `arbor train --model ggnn`).
    #[arg(long, value_enum, default_value = "tree-lstm")]
    pub(crate) model: ModelArg,
    /// An SST directory; without it, the synthetic treebank (balanced binary trees for tree-fc).
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Trees per minibatch.
    #[arg(long, default_value_t = 64)]
    pub(crate) batch: usize,
    /// Hidden state width.
    #[arg(long, default_value_t = 150)]
    pub(crate) hidden: usize,
    /// Word vector width.
    #[arg(long, default_value_t = 300)]
    pub(crate) embed: usize,
    /// Training sentences in the timed run (the first N, cycled if needed).
    #[arg(long, default_value_t = 2000)]
    pub(crate) sentences: usize,
    /// What to time.
    #[arg(long, value_enum, default_value = "train")]
    pub(crate) mode: Mode,
    /// Where the loss is taken (train mode).
    #[arg(long, value_enum, default_value = "root")]
    pub(crate) loss: Loss,
    /// The compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    pub(crate) device: Device,
    /// Worker threads for matrix products (default: all cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Workers, each a model replica (on its own share of the cores, or on the same GPU). Training: every
    /// minibatch is split between them and their gradients summed (as `arbor train --workers`);
    /// inference: they take whole minibatches in turn.
    #[arg(long, default_value_t = 1)]
    pub(crate) workers: usize,
    /// Matrix-product inputs on the GPU: f32, tf32, bf16 or f16 (f16 training scales the loss);
    /// accumulation is always f32.
    #[arg(long, value_enum, default_value = "f32")]
    pub(crate) precision: PrecisionArg,
    /// Leaves of each synthetic tree for tree-fc without --data.
    #[arg(long, default_value_t = 32)]
    pub(crate) leaves: usize,
    /// Also report the host's time per step by activity (`profile_ms_per_step`: planning, lowering,
    /// uploads, issuing products, fused kernels, fills, scatters, row sums and attention, reads,
    /// the update; on a GPU, reads include waiting for it).
    #[arg(long)]
    pub(crate) profile: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ModelArg {
    /// Binary constituency Tree-LSTM (Tai et al. 2015).
    TreeLstm,
    /// Child-sum Tree-LSTM.
    ChildSum,
    /// An LSTM over each sentence as a chain (loss at the last word).
    VarLstm,
    /// Tree-FC: one fully connected layer over the children (the Cavs benchmark cell).
    TreeFc,
    /// Gated graph network for graph classification (TU data sets such as MUTAG).
    Ggnn,
    /// Graph isomorphism network (GIN) for graph classification, sum-pooled.
    Gin,
    /// Graph attention network (GAT) for graph classification.
    Gat,
    /// Sentence-pair relatedness on SICK: a child-sum Tree-LSTM over each dependency tree and
    /// the relatedness head of Tai et al. 2015
    Sick,
}

impl ModelArg {
    /// The name `--model` takes.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ModelArg::TreeLstm => "tree-lstm",
            ModelArg::ChildSum => "child-sum",
            ModelArg::VarLstm => "var-lstm",
            ModelArg::TreeFc => "tree-fc",
            ModelArg::Ggnn => "ggnn",
            ModelArg::Gin => "gin",
            ModelArg::Gat => "gat",
            ModelArg::Sick => "sick",
        }
    }

    /// The message-passing cell of a graph model (cross-validated on a TU data set).
    pub(crate) fn graph_cell(self) -> Option<GraphCell> {
        GraphCell::from_name(self.name())
    }

    pub(crate) fn model(self) -> CellKind {
        match self {
            ModelArg::TreeLstm => CellKind::TreeLstm,
            ModelArg::ChildSum | ModelArg::Sick => CellKind::ChildSum,
            ModelArg::VarLstm => CellKind::VarLstm,
            ModelArg::TreeFc | ModelArg::Ggnn | ModelArg::Gin | ModelArg::Gat => CellKind::TreeFc,
        }
    }
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub(crate) enum Loss {
    /// Loss on every tree's root.
    Root,
    /// Loss on every vertex (every phrase).
    All,
}

impl Loss {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Loss::Root => "root",
            Loss::All => "all",
        }
    }
}

/// `--checkpoint-every`: `auto`, or a number of steps (the bound of `auto` is set after
/// parsing, from `--checkpoint-overhead`).
/// `--stages`: a number of pipeline stages, or `auto` (the planner chooses, `arbor::dist::planner`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stages {
    /// This many stages.
    Count(usize),
    /// As many as the planner finds fastest.
    Auto,
}

impl std::fmt::Display for Stages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stages::Count(n) => write!(f, "{n}"),
            Stages::Auto => write!(f, "auto"),
        }
    }
}

fn stages(text: &str) -> Result<Stages, String> {
    match text {
        "auto" => Ok(Stages::Auto),
        n => n.parse().map(Stages::Count).map_err(|_| format!("`{n}` is neither `auto` nor a number of stages")),
    }
}

/// `--batch`: examples per minibatch, or `auto` (chosen as training goes,
/// `arbor::trainer::BatchSize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Batch {
    /// This many examples.
    Count(usize),
    /// Chosen as training goes, from [`AUTO_BATCH`].
    Auto,
}

/// The batch `--batch auto` starts at, and sets the learning rate for.
pub(crate) const AUTO_BATCH: usize = 25;

impl Batch {
    /// As a checkpoint records it: the number, or `"auto"`.
    pub(crate) fn to_json(self) -> serde_json::Value {
        match self {
            Batch::Count(n) => serde_json::json!(n),
            Batch::Auto => serde_json::json!("auto"),
        }
    }
}

fn batch_size(text: &str) -> Result<Batch, String> {
    match text {
        "auto" => Ok(Batch::Auto),
        n => n.parse().map(Batch::Count).map_err(|_| format!("`{n}` is neither `auto` nor a number of examples")),
    }
}

fn every(text: &str) -> Result<Every, String> {
    match text {
        "auto" => Ok(Every::Auto(f64::NAN)),
        n => n.parse().map(Every::Steps).map_err(|_| format!("`{n}` is neither `auto` nor a number of steps")),
    }
}

/// How a graph model pools a step's nodes.
#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub(crate) enum ReadoutArg {
    Sum,
    Mean,
    Max,
    Attention,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Opt {
    Adagrad,
    Adam,
    Adamw,
    Sgd,
}

#[derive(Parser, Clone)]
pub(crate) struct TrainArgs {
    /// The model.
    #[arg(long, value_enum, default_value = "tree-lstm")]
    pub(crate) model: ModelArg,
    /// An SST directory (train.txt, dev.txt, test.txt), a TU data set folder (ggnn, gin, gat) or the
    /// SICK folder (sick); without it, the synthetic treebank.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Passes over the training set (default 5; 100 per fold for the graph models, 10 for sick).
    #[arg(long)]
    pub(crate) epochs: Option<usize>,
    /// Cross-validation folds (ggnn; default 10).
    #[arg(long)]
    pub(crate) folds: Option<usize>,
    /// Message-passing steps (graph models; default 4).
    #[arg(long)]
    pub(crate) steps: Option<usize>,
    /// How a step's nodes are pooled (graph models; default sum for gin, mean for the others;
    /// attention: the cell scores each node and the softmax of the scores weighs them).
    #[arg(long, value_enum)]
    pub(crate) readout: Option<ReadoutArg>,
    /// Read every message-passing step, each pooled apart, not only the last (graph models:
    /// jumping knowledge, as GIN reads out).
    #[arg(long)]
    pub(crate) every_step: bool,
    /// Weights of their own for each message-passing step, as GIN's layers have, not one cell
    /// shared by every step (gin).
    #[arg(long)]
    pub(crate) per_step: bool,
    /// Label each node also by how many simple cycles of each length from 3 to N pass through it
    /// (graph models: GSN's substructure counts; 6 covers a molecule's 5- and 6-rings).
    #[arg(long, value_name = "N")]
    pub(crate) cycles: Option<usize>,
    /// Train K models per fold, each from its own initialisation and order, and score the fold's
    /// held-out graphs by their mean class probabilities (graph models: an ensemble; K times the
    /// training time; the members' own mean is reported beside it as `cv_acc_member_mean`).
    #[arg(long, value_name = "K")]
    pub(crate) ensemble: Option<usize>,
    /// Trees per minibatch; `auto`: chosen as training goes for the most goodput (Pollux: the
    /// gradient noise scale measured every few steps against a step-time model timed at the
    /// start; the learning rate scaled by √(batch / 25)), starting at 25 (tree and sequence
    /// models, one worker, one stage).
    #[arg(long = "batch", value_parser = batch_size, default_value = "25")]
    pub(crate) batch_arg: Batch,
    /// Hidden state width (default 64; 32 for the graph models, 150 for sick).
    #[arg(long)]
    pub(crate) hidden: Option<usize>,
    /// Word vector (or node-label vector) width (default 32; 16 for the graph models, 300 for sick).
    #[arg(long)]
    pub(crate) embed: Option<usize>,
    /// Where the loss is taken (tree and sequence models; default all).
    #[arg(long, value_enum)]
    pub(crate) loss: Option<Loss>,
    /// The optimizer.
    #[arg(long, value_enum, default_value = "adam")]
    pub(crate) optimizer: Opt,
    /// Learning rate (default 0.01; 0.005 for the graph models).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) lr: Option<f32>,
    /// Learning rate of the word vectors (default: --lr; not ggnn). A rare word's vector is
    /// otherwise moved as far as a shared weight on the few steps that see it.
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) embed_lr: Option<f32>,
    /// Weight decay.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) weight_decay: f32,
    /// Score (and keep as the best checkpoint) a moving average of the weights, at this decay
    /// per step (0.999: about the last thousand steps), instead of the last step's weights.
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) average: Option<f32>,
    /// Clip the joint gradient norm to this value (0: no clipping).
    #[arg(long, default_value_t = 5.0, allow_negative_numbers = true)]
    pub(crate) clip: f32,
    /// Dropout rate on every layer's pushed row (what the layer above or the classifier reads),
    /// in training (graph models: on the classifier's input; 0: none).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) dropout: f32,
    /// Dropout rate on the word vectors, in training (tree and sequence models; 0: none).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) input_dropout: f32,
    /// Dropout rate on the update of every layer's recurrent state (an LSTM's candidate before
    /// it enters the memory, Semeniuta et al. 2016), in training (tree and sequence models; 0:
    /// none).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) recurrent_dropout: f32,
    /// Word dropout α: in training, a word seen c times in the training split is replaced by the
    /// unknown word with probability α / (α + c), which trains the unknown word's vector for the
    /// words dev and test bring (tree and sequence models; 0: none).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) word_dropout: f32,
    /// Lowercase words (SST only).
    #[arg(long)]
    pub(crate) lowercase: bool,
    /// Initialise word vectors from a GloVe text file (its width must equal --embed).
    #[arg(long)]
    pub(crate) embeddings: Option<PathBuf>,
    /// Leave the tensor NAME as it is while the rest trains (e.g. `embedding`, the word vectors
    /// of --embeddings); repeat for more (one stage; not ggnn).
    #[arg(long, value_name = "NAME")]
    pub(crate) freeze: Vec<String>,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Keep checkpoints here: `best/` (best dev accuracy) and `last/` (end of the last epoch). The
    /// folder is locked while the run lasts; one holding another run's checkpoints is refused
    /// (see --resume and --overwrite).
    #[arg(long)]
    pub(crate) checkpoint: Option<PathBuf>,
    /// Continue from a checkpoint written by --checkpoint (its `last/` folder, or the folder itself),
    /// saving into the same folder unless --checkpoint names another.
    #[arg(long)]
    pub(crate) resume: Option<PathBuf>,
    /// Replace the checkpoints of another run found in the --checkpoint folder (without it, such a
    /// folder is refused).
    #[arg(long)]
    pub(crate) overwrite: bool,
    /// Write the loss and dev-accuracy curves to this SVG file.
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
    /// Also write `last/` between epochs' ends: every N steps, or `auto` — as often as keeps the
    /// snapshots within --checkpoint-overhead of the training time, measured as it trains
    /// (CheckFreq: snapshot in memory, persist in the background); with `auto` an epoch's end
    /// writes `last/` only where a snapshot is due, and `best/` writes count against the bound.
    #[arg(long, value_parser = every)]
    pub(crate) checkpoint_every: Option<Every>,
    /// The bound of `--checkpoint-every auto`: the snapshots' share of the training time.
    #[arg(long, default_value_t = 0.035, allow_negative_numbers = true)]
    pub(crate) checkpoint_overhead: f64,
    /// Stop after this many optimizer steps in all (writing `last/` there with --checkpoint).
    #[arg(long)]
    pub(crate) max_steps: Option<u64>,
    /// Stop early after this many epochs in a row without a better dev score (one stage; not
    /// ggnn).
    #[arg(long)]
    pub(crate) patience: Option<usize>,
    /// Multiply the learning rate by this factor after every epoch (one stage; graph models: in
    /// every fold).
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) lr_decay: Option<f32>,
    /// Data-parallel workers (threads of this process), each with a share of every minibatch
    /// (with --stages P: replicas of each stage, P × W workers in all).
    #[arg(long, default_value_t = 1)]
    pub(crate) workers: usize,
    /// Where the vertex functions and heads run, for every model (`cuda`: the first GPU).
    #[arg(long, value_enum, default_value = "cpu")]
    pub(crate) device: Device,
    /// Run as one rank of an MPI job (`mpirun -np N arbor train ... --distributed mpi`).
    #[arg(long, value_enum)]
    pub(crate) distributed: Option<Distributed>,
    /// Layers of the vertex function, stacked: layer k+1 pulls the row layer k pushed at the
    /// same vertex.
    #[arg(long, default_value_t = 1)]
    pub(crate) layers: usize,
    /// Pipeline stages (threads, or MPI ranks), each holding a contiguous share of the layers;
    /// trained by the same loop as one stage (checkpoints, --resume, --average). With --workers
    /// W, each stage is replicated on W workers (P × W threads, or MPI ranks), each replica
    /// taking a share of every minibatch. `auto`: the layers are timed on a few minibatches and
    /// the planner chooses the stages, their boundaries, the replicas and the micro-batches that
    /// give the shortest predicted step within --memory-budget (threads; the plan is printed and
    /// kept in the checkpoint).
    #[arg(long, value_parser = stages, default_value = "1")]
    pub(crate) stages: Stages,
    /// Megabytes of memory a worker may use, for `--stages auto` (default: the memory available
    /// where the model runs — the system's, or the GPU's free memory with --device cuda — shared
    /// among the plan's workers).
    #[arg(long)]
    pub(crate) memory_budget: Option<f64>,
    /// The pipeline schedule (default 1f1b; with --stages above 1).
    #[arg(long, value_enum)]
    pub(crate) schedule: Option<ScheduleArg>,
    /// Micro-batches per minibatch in a pipeline, balanced by vertex count (default 4; with
    /// --stages above 1).
    #[arg(long)]
    pub(crate) micro_batches: Option<usize>,
    /// Seconds a worker waits for a peer before the run ends with an error.
    #[arg(long, default_value_t = 120.0, allow_negative_numbers = true)]
    pub(crate) timeout: f64,
    /// Pause inside each checkpoint write, in milliseconds (for crash tests).
    #[arg(long, default_value_t = 0, hide = true)]
    pub(crate) persist_pause_ms: u64,
}

impl TrainArgs {
    /// Where the loss is taken: `--loss`, or every vertex.
    pub(crate) fn loss(&self) -> Loss {
        self.loss.unwrap_or(Loss::All)
    }

    /// Cross-validation folds: `--folds`, or 10.
    pub(crate) fn folds(&self) -> usize {
        self.folds.unwrap_or(10)
    }

    /// The pooling of a graph model's nodes: `--readout`, or `cell`'s.
    pub(crate) fn readout(&self, cell: GraphCell) -> Readout {
        match self.readout {
            Some(ReadoutArg::Sum) => Readout::Sum,
            Some(ReadoutArg::Mean) => Readout::Mean,
            Some(ReadoutArg::Max) => Readout::Max,
            Some(ReadoutArg::Attention) => Readout::Attention,
            None => cell.readout(),
        }
    }

    /// Message-passing steps: `--steps`, or 4.
    pub(crate) fn steps(&self) -> usize {
        self.steps.unwrap_or(4)
    }

    /// Micro-batches per minibatch of a pipeline: `--micro-batches`, or 4.
    /// The most pipeline stages the run may have: `--stages N`, or with `auto` one per layer.
    pub(crate) fn most_stages(&self) -> usize {
        match self.stages {
            Stages::Count(n) => n,
            Stages::Auto => self.layers,
        }
    }

    /// Examples per minibatch: `--batch`, or where it is `auto` the batch it starts at.
    pub(crate) fn batch(&self) -> usize {
        match self.batch_arg {
            Batch::Count(n) => n,
            Batch::Auto => AUTO_BATCH,
        }
    }

    pub(crate) fn micro_batches(&self) -> usize {
        self.micro_batches.unwrap_or(4)
    }

    /// The pipeline schedule: `--schedule`, or 1F1B.
    pub(crate) fn schedule(&self) -> ScheduleArg {
        self.schedule.unwrap_or(ScheduleArg::OneFOneB)
    }

    /// The cell's dropout rates by flag (each a rate in `[0, 1)`).
    pub(crate) fn dropout_rates(&self) -> [(&'static str, f32); 3] {
        [
            ("--dropout", self.dropout),
            ("--input-dropout", self.input_dropout),
            ("--recurrent-dropout", self.recurrent_dropout),
        ]
    }

    /// The dropout of stacked layer `k` (0 at the bottom): `--input-dropout` on the word vectors
    /// the bottom layer pulls, `--dropout` on every layer's pushed row (so a row between two
    /// layers is dropped once), `--recurrent-dropout` on every layer's recurrent update.
    pub(crate) fn cell_dropout(&self, k: usize) -> CellDropout {
        CellDropout {
            input: if k == 0 { self.input_dropout } else { 0.0 },
            output: self.dropout,
            recurrent: self.recurrent_dropout,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ScheduleArg {
    /// 1F1B with a flush after every minibatch (equals accumulating the micro-batches).
    #[value(name = "1f1b")]
    OneFOneB,
    /// PipeDream-2BW: two weight versions, gradients one step stale; it flushes only at an
    /// epoch's end and at a checkpoint.
    #[value(name = "2bw")]
    TwoBw,
}

impl ScheduleArg {
    pub(crate) fn kind(self) -> Kind {
        match self {
            ScheduleArg::OneFOneB => Kind::OneFOneBFlush,
            ScheduleArg::TwoBw => Kind::TwoBw,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            ScheduleArg::OneFOneB => "1f1b",
            ScheduleArg::TwoBw => "2bw",
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Distributed {
    /// MPI processes (needs a build with `--features mpi`).
    Mpi,
}

#[derive(Parser)]
pub(crate) struct PredictArgs {
    /// A checkpoint folder of a tree or sequence model, or of the sentence-pair model `sick` (as
    /// written by `train --checkpoint`; `best/` is used if present).
    #[arg(long)]
    pub(crate) checkpoint: PathBuf,
    /// Read the sentences from this file, one per line, instead of standard input.
    #[arg(long)]
    pub(crate) input: Option<PathBuf>,
    /// Where the model runs (`cuda`: the first GPU).
    #[arg(long, value_enum, default_value = "cpu")]
    pub(crate) device: Device,
    /// Sentences to classify, each one argument: plain words (`"a fine film"`, read as a
    /// right-branching tree), a bracketing without labels (`"((a fine) film)"`) or an SST tree.
    /// For a `sick` checkpoint, sentence pairs to score: `"A<TAB>B"` (each read as a chain), or
    /// tokens and heads as in the SICK files (`"toks<TAB>heads<TAB>toks<TAB>heads"`). Without
    /// them, the lines of --input or of standard input.
    pub(crate) sentences: Vec<String>,
}

#[derive(Parser)]
pub(crate) struct EvalArgs {
    /// A checkpoint folder (as written by `train --checkpoint`; `best/` is used if present).
    #[arg(long)]
    pub(crate) checkpoint: PathBuf,
    /// The data directory (default: the one the checkpoint was trained on).
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Where the vertex functions and heads run (`cuda`: the first GPU).
    #[arg(long, value_enum, default_value = "cpu")]
    pub(crate) device: Device,
}
