//! The `arbor` command: train and evaluate models from the command line.

use arbor::checkpoint::Checkpoint;
use arbor::core::rng::Rng;
use arbor::cuda::Precision;
use arbor::data::{glove, sst, synthetic, tu, TreeExample, Vocab, PAD};
use arbor::dist::pipeline::{PipeSettings, Stack, Stage};
use arbor::dist::schedule::Kind;
use arbor::dist::{Collective, ThreadCollective};
use arbor::layers::LossOn;
use arbor::loss_scale::LossScaler;
use arbor::nn::Model;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::plot::{self, Series};
use arbor::train::{cross_validate, Classifier, GraphTraining};
use arbor::trainer::{fit_threads, on_threads, train_steps, Event, Run, Settings, Splits, Summary};
use arbor::{Backend, Error, Result};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(name = "arbor", version, about = "Deep learning on trees, sequences and graphs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model. With no --data, trains the binary Tree-LSTM on the built-in synthetic treebank.
    Train(Box<TrainArgs>),
    /// Evaluate a checkpoint on the test split of its data.
    Eval(EvalArgs),
    /// Measure training or inference throughput on SST (or synthetic trees).
    Bench(BenchArgs),
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Mode {
    /// Forward, backward, and the optimizer update.
    Train,
    /// Forward only (inference mode: nothing kept for backward).
    Infer,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
enum PrecisionArg {
    F32,
    Tf32,
    Bf16,
    F16,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Device {
    Cpu,
    Cuda,
}

#[derive(Parser)]
struct BenchArgs {
    /// The model (ggnn is benchmarked by `arbor train --model ggnn`).
    #[arg(long, value_enum, default_value = "tree-lstm")]
    model: ModelArg,
    /// An SST directory; without it, the synthetic treebank (balanced binary trees for tree-fc).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Trees per minibatch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Hidden state width.
    #[arg(long, default_value_t = 150)]
    hidden: usize,
    /// Word vector width.
    #[arg(long, default_value_t = 300)]
    embed: usize,
    /// Training sentences in the timed run (the first N, cycled if needed).
    #[arg(long, default_value_t = 2000)]
    sentences: usize,
    /// What to time.
    #[arg(long, value_enum, default_value = "train")]
    mode: Mode,
    /// Where the loss is taken (train mode).
    #[arg(long, value_enum, default_value = "root")]
    loss: Loss,
    /// The compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Worker threads for matrix products (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Workers (CPU only), each a model replica on its own share of the cores. Training: every
    /// minibatch is split between them and their gradients summed (as `arbor train --workers`);
    /// inference: they take whole minibatches in turn.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Matrix-product inputs on the GPU: f32, tf32, bf16 or f16 (f16 training scales the loss);
    /// accumulation is always f32.
    #[arg(long, value_enum, default_value = "f32")]
    precision: PrecisionArg,
    /// Leaves of each synthetic tree for tree-fc without --data.
    #[arg(long, default_value_t = 32)]
    leaves: usize,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModelArg {
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
}

impl ModelArg {
    fn model(self) -> Model {
        match self {
            ModelArg::TreeLstm => Model::TreeLstm,
            ModelArg::ChildSum => Model::ChildSum,
            ModelArg::VarLstm => Model::VarLstm,
            ModelArg::TreeFc | ModelArg::Ggnn => Model::TreeFc,
        }
    }
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Loss {
    /// Loss on every tree's root.
    Root,
    /// Loss on every vertex (every phrase).
    All,
}

impl Loss {
    fn name(self) -> &'static str {
        match self {
            Loss::Root => "root",
            Loss::All => "all",
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Opt {
    Adagrad,
    Adam,
    Adamw,
    Sgd,
}

#[derive(Parser)]
struct TrainArgs {
    /// The model.
    #[arg(long, value_enum, default_value = "tree-lstm")]
    model: ModelArg,
    /// An SST directory (train.txt, dev.txt, test.txt); without it, the synthetic treebank.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Passes over the training set (default 5; 100 per fold for ggnn).
    #[arg(long)]
    epochs: Option<usize>,
    /// Cross-validation folds (ggnn).
    #[arg(long, default_value_t = 10)]
    folds: usize,
    /// Message-passing steps (ggnn).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Trees per minibatch.
    #[arg(long, default_value_t = 25)]
    batch: usize,
    /// Hidden state width (default 64; 32 for ggnn).
    #[arg(long)]
    hidden: Option<usize>,
    /// Word vector (or node-label vector) width (default 32; 16 for ggnn).
    #[arg(long)]
    embed: Option<usize>,
    /// Where the loss is taken.
    #[arg(long, value_enum, default_value = "all")]
    loss: Loss,
    /// The optimizer.
    #[arg(long, value_enum, default_value = "adam")]
    optimizer: Opt,
    /// Learning rate (default 0.01; 0.005 for ggnn).
    #[arg(long)]
    lr: Option<f32>,
    /// Weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,
    /// Clip the joint gradient norm to this value (0: no clipping).
    #[arg(long, default_value_t = 5.0)]
    clip: f32,
    /// Lowercase words (SST only).
    #[arg(long)]
    lowercase: bool,
    /// Initialise word vectors from a GloVe text file (its width must equal --embed).
    #[arg(long)]
    embeddings: Option<PathBuf>,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keep checkpoints here: `best/` (best dev accuracy) and `last/` (end of the last epoch).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Continue from a checkpoint written by --checkpoint (its `last/` folder, or the folder itself).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Write the loss and dev-accuracy curves to this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also write `last/` every this many steps (CheckFreq: snapshot in memory, persist in the
    /// background).
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Stop after this many optimizer steps in all (writing `last/` there with --checkpoint).
    #[arg(long)]
    max_steps: Option<u64>,
    /// Data-parallel workers (threads of this process), each with a share of every minibatch.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Run as one rank of an MPI job (`mpirun -np N arbor train ... --distributed mpi`).
    #[arg(long, value_enum)]
    distributed: Option<Distributed>,
    /// Layers of the vertex function, stacked: layer k+1 pulls the row layer k pushed at the
    /// same vertex.
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// Pipeline stages (threads, or MPI ranks), each holding a contiguous share of the layers.
    #[arg(long, default_value_t = 1)]
    stages: usize,
    /// The pipeline schedule.
    #[arg(long, value_enum, default_value = "1f1b")]
    schedule: ScheduleArg,
    /// Micro-batches per minibatch in a pipeline (balanced by vertex count).
    #[arg(long, default_value_t = 4)]
    micro_batches: usize,
    /// Seconds a worker waits for a peer before the run ends with an error.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Pause inside each checkpoint write, in milliseconds (for crash tests).
    #[arg(long, default_value_t = 0, hide = true)]
    persist_pause_ms: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum ScheduleArg {
    /// 1F1B with a flush after every minibatch (equals accumulating the micro-batches).
    #[value(name = "1f1b")]
    OneFOneB,
    /// PipeDream-2BW: no flush, two weight versions, gradients one step stale.
    #[value(name = "2bw")]
    TwoBw,
}

impl ScheduleArg {
    fn kind(self) -> Kind {
        match self {
            ScheduleArg::OneFOneB => Kind::OneFOneBFlush,
            ScheduleArg::TwoBw => Kind::TwoBw,
        }
    }

    fn name(self) -> &'static str {
        match self {
            ScheduleArg::OneFOneB => "1f1b",
            ScheduleArg::TwoBw => "2bw",
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Distributed {
    /// MPI processes (needs a build with `--features mpi`).
    Mpi,
}

#[derive(Parser)]
struct EvalArgs {
    /// A checkpoint folder (as written by `train --checkpoint`; `best/` is used if present).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The data directory (default: the one the checkpoint was trained on).
    #[arg(long)]
    data: Option<PathBuf>,
}

/// Has glibc's malloc keep freed memory for reuse. Every training step allocates and frees the
/// same large gradient buffers; by default glibc hands such memory back to the kernel (unmapping
/// large blocks, trimming worker threads' heaps), so each step faults it back in page by page
/// (`perf stat -e page-faults arbor bench --workers 2`: about 700 faults per step without this,
/// none with it).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's thresholds; it runs before any other thread.
    unsafe {
        // Blocks up to 32 MiB come from the heap, and up to 1 GiB of free heap stays mapped.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() {
    keep_freed_memory();
    let cli = Cli::parse();
    let result = arbor::isa::requested().and_then(|_| match cli.command {
        Command::Train(args) => train(&args),
        Command::Eval(args) => eval(&args),
        Command::Bench(args) => bench(&args),
    });
    if let Err(e) = result {
        eprintln!("arbor: {e}");
        std::process::exit(1);
    }
}

struct Data {
    name: String,
    train: Vec<TreeExample>,
    dev: Vec<TreeExample>,
    test: Vec<TreeExample>,
    vocab: Vocab,
    classes: usize,
}

/// The synthetic treebank of `seed`, or the SST splits in `dir`; sentences as chains for `model`.
fn load(dir: Option<&Path>, seed: u64, lowercase: bool, model: Model) -> Result<Data> {
    let mut data = match dir {
        None => Data {
            name: "synthetic".into(),
            train: synthetic::generate(4000, 12, seed),
            dev: synthetic::generate(500, 12, seed + 1_000_003),
            test: synthetic::generate(500, 12, seed + 2_000_003),
            vocab: synthetic::vocab(),
            classes: synthetic::CLASSES,
        },
        Some(dir) => {
            if !dir.is_dir() {
                return Err(Error::Io { path: dir.display().to_string(), msg: "not a directory".into() });
            }
            let s = sst::read_splits(dir, lowercase)?;
            Data {
                name: dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()).display().to_string(),
                train: s.train,
                dev: s.dev,
                test: s.test,
                vocab: s.vocab,
                classes: sst::CLASSES,
            }
        }
    };
    if model.chains() {
        for split in [&mut data.train, &mut data.dev, &mut data.test] {
            *split = split.iter().map(TreeExample::to_chain).collect();
        }
    }
    Ok(data)
}

fn bar(len: usize, msg: String) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} trees, {per_sec}, eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg);
    pb
}

fn meta_usize(meta: &Value, key: &str) -> Result<usize> {
    meta[key]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| Error::input("checkpoint metadata", format!("a number `{key}`"), meta[key].to_string()))
}

/// The sizes and rates of a run: the flags, or the model's defaults.
struct Sizes {
    epochs: usize,
    hidden: usize,
    embed: usize,
    lr: f32,
}

impl Sizes {
    fn of(args: &TrainArgs) -> Sizes {
        let graph = matches!(args.model, ModelArg::Ggnn);
        Sizes {
            epochs: args.epochs.unwrap_or(if graph { 100 } else { 5 }),
            hidden: args.hidden.unwrap_or(if graph { 32 } else { 64 }),
            embed: args.embed.unwrap_or(if graph { 16 } else { 32 }),
            lr: args.lr.unwrap_or(if graph { 0.005 } else { 0.01 }),
        }
    }
}

fn optimizer(args: &TrainArgs, lr: f32) -> Config {
    let rule = match args.optimizer {
        Opt::Adagrad => Rule::Adagrad,
        Opt::Adam => Rule::Adam,
        Opt::Adamw => Rule::AdamW,
        Opt::Sgd => Rule::Sgd { momentum: 0.9 },
    };
    Config { weight_decay: args.weight_decay, ..Config::new(rule, lr) }
}

/// A training run's progress on stderr: a bar per epoch and a line per finished epoch, whose
/// curves are also drawn to `plot`.
struct Progress<'a> {
    epochs: usize,
    plot: Option<&'a Path>,
    bar: Option<ProgressBar>,
    loss: Vec<f64>,
    dev: Vec<f64>,
}

impl Progress<'_> {
    fn on(&mut self, e: Event) {
        match e {
            Event::EpochStart { epoch, done, total } => {
                let b = bar(total, format!("epoch {epoch}/{}", self.epochs));
                b.set_position(done as u64);
                self.bar = Some(b);
            }
            Event::Trees(n) => {
                if let Some(b) = &self.bar {
                    b.inc(n as u64);
                }
            }
            Event::EpochEnd { epoch, loss, dev } => {
                self.finish();
                eprintln!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
                self.loss.push(loss);
                self.dev.push(dev);
                if let Some(path) = self.plot {
                    let series = [
                        Series { name: "training loss", values: &self.loss },
                        Series { name: "dev root accuracy", values: &self.dev },
                    ];
                    if let Err(e) = plot::write_svg(path, &series) {
                        eprintln!("arbor: {e}");
                    }
                }
            }
        }
    }

    fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

/// What every way of training a tree or sequence model starts from.
struct Setup<'a> {
    args: &'a TrainArgs,
    sizes: Sizes,
    kind: Model,
    data: Data,
    rng: Rng,
    loss_on: LossOn,
    timeout: Duration,
}

impl Setup<'_> {
    fn splits(&self) -> Splits<'_> {
        Splits { train: &self.data.train, dev: &self.data.dev, test: &self.data.test }
    }

    /// Fills an embedding table from --embeddings, if given (the padding row stays zero).
    fn pretrained(&self, table: &mut [f32]) -> Result<()> {
        let Some(file) = &self.args.embeddings else { return Ok(()) };
        let embed = self.sizes.embed;
        let found = glove::read_into(file, &self.data.vocab, embed, table)?;
        table[PAD as usize * embed..(PAD as usize + 1) * embed].fill(0.0);
        eprintln!("arbor: {found} of {} words have vectors in {}", self.data.vocab.len(), file.display());
        Ok(())
    }

    fn announce(&self, how: &str) {
        let d = &self.data;
        eprintln!(
            "arbor: training {} on {} ({} train / {} dev / {} test trees, vocabulary {}, {how})",
            self.kind.name(),
            d.name,
            d.train.len(),
            d.dev.len(),
            d.test.len(),
            d.vocab.len(),
        );
    }
}

fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

fn train(args: &TrainArgs) -> Result<()> {
    let sizes = Sizes::of(args);
    let Sizes { epochs, hidden, embed, .. } = sizes;
    if args.batch == 0 || epochs == 0 || hidden == 0 || embed == 0 || args.layers == 0 || args.stages == 0 {
        return Err(Error::input(
            "arguments",
            "--batch, --epochs, --hidden, --embed, --layers and --stages above 0",
            format!("{} {epochs} {hidden} {embed} {} {}", args.batch, args.layers, args.stages),
        ));
    }
    if matches!(args.model, ModelArg::Ggnn) {
        return train_graphs(args, &sizes);
    }
    let kind = args.model.model();
    let data = load(args.data.as_deref(), args.seed, args.lowercase, kind)?;
    let loss_on = match (args.loss, kind.chains()) {
        // A chain has one label: the sentence's.
        (Loss::Root, _) | (_, true) => LossOn::Root,
        (Loss::All, false) => LossOn::All,
    };
    let timeout = Duration::try_from_secs_f64(args.timeout).map_err(|_| {
        Error::input("--timeout", "a number of seconds from 0 to about 1.8e19", args.timeout.to_string())
    })?;
    let setup = Setup { args, sizes, kind, data, rng: Rng::new(args.seed), loss_on, timeout };
    let mut progress = Progress { epochs, plot: args.plot.as_deref(), bar: None, loss: Vec::new(), dev: Vec::new() };
    let mut events = |e: Event| progress.on(e);
    let report = if args.layers > 1 || args.stages > 1 {
        train_pipeline(setup, &mut events)?
    } else {
        train_data_parallel(setup, &mut events)?
    };
    progress.finish();
    if let Some(Value::Object(fields)) = report {
        let mut summary = json!({
            "model": kind.name(),
            "data": load_name(args),
            "epochs": epochs,
            "batch": args.batch,
            "hidden": hidden,
            "embed": embed,
        });
        if let Some(m) = summary.as_object_mut() {
            m.extend(fields);
        }
        println!("{summary}");
    }
    Ok(())
}

/// The data set's name as the summary spells it.
fn load_name(args: &TrainArgs) -> String {
    args.data.as_ref().map_or_else(|| "synthetic".into(), |d| d.display().to_string())
}

/// The summary's numbers of a finished run.
fn outcome(summary: &Summary, steps: u64, best_dev: f64, test_acc: f64) -> Value {
    json!({
        "steps": steps,
        "train_seconds": (summary.train_seconds * 1000.0).round() / 1000.0,
        "sent_per_s": (summary.sentences as f64 / summary.train_seconds.max(1e-9)).round(),
        "dev_acc": best_dev,
        "test_acc": test_acc,
    })
}

/// Trains one model data-parallel (one worker, threads, or MPI ranks); returns the summary's
/// fields on the worker that reports them.
fn train_data_parallel(mut setup: Setup<'_>, events: &mut dyn FnMut(Event)) -> Result<Option<Value>> {
    let args = setup.args;
    let Sizes { epochs, hidden, embed, lr } = setup.sizes;
    let cell = setup.kind.cell(embed, hidden)?;
    let (vocab, classes) = (setup.data.vocab.len(), setup.data.classes);
    let mut model = Classifier::new(cell, vocab, Some(PAD), classes, &mut setup.rng)?;
    setup.pretrained(model.embed.table_mut())?;
    let mut run = Run::new(model, Optimizer::new(optimizer(args, lr)), &setup.rng);
    let data = &setup.data;
    let plan = Settings {
        epochs,
        batch: args.batch,
        loss_on: setup.loss_on,
        clip: (args.clip > 0.0).then_some(args.clip),
        checkpoint: args.checkpoint.clone(),
        checkpoint_every: args.checkpoint_every,
        max_steps: args.max_steps,
        persist_pause: Duration::from_millis(args.persist_pause_ms),
        meta: json!({
            "model": setup.kind.name(), "embed": embed, "hidden": hidden, "classes": classes,
            "data": data.name, "seed": args.seed, "lowercase": args.lowercase, "vocab": data.vocab.words(),
            "batch": args.batch, "loss": args.loss.name(), "optimizer": format!("{:?}", optimizer(args, lr)),
            "clip": args.clip, "embeddings": args.embeddings.as_ref().map(|f| f.display().to_string()),
        }),
    };
    if let Some(dir) = &args.resume {
        let dir = if dir.join("last").is_dir() { dir.join("last") } else { dir.clone() };
        run.resume(&Checkpoint::load(&dir)?, &plan.meta)?;
        eprintln!("arbor: resuming from {} at epoch {}, step {}", dir.display(), run.pos.epoch, run.pos.steps);
    }
    let (summary, lead, workers) = match args.distributed {
        None => {
            setup.announce(&plural(args.workers, "worker"));
            let summary = fit_threads(&mut run, args.workers, setup.timeout, setup.splits(), &plan, events)?;
            (summary, true, args.workers)
        }
        Some(Distributed::Mpi) => on_mpi(setup.timeout, |coll| {
            let (rank, size) = (coll.rank(), coll.size());
            if rank == 0 {
                setup.announce(&plural(size, "MPI rank"));
            }
            let mut quiet = |_: Event| {};
            let events: &mut dyn FnMut(Event) = if rank == 0 { events } else { &mut quiet };
            Ok((run.fit(setup.splits(), &plan, coll, events)?, rank == 0, size))
        })?,
    };
    let mut report = outcome(&summary, run.pos.steps, run.best_dev, run.test_acc);
    report["workers"] = json!(workers);
    Ok(lead.then_some(report))
}

/// Trains a stacked model of --layers layers, cut into --stages pipeline stages (threads, or the
/// ranks of an MPI job); returns the summary's fields on the last stage.
fn train_pipeline(mut setup: Setup<'_>, events: &mut dyn FnMut(Event)) -> Result<Option<Value>> {
    let args = setup.args;
    let unsupported = [
        ("--checkpoint", args.checkpoint.is_some()),
        ("--resume", args.resume.is_some()),
        ("--checkpoint-every", args.checkpoint_every.is_some()),
        ("--workers above 1", args.workers > 1),
    ];
    if let Some((flag, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(Error::input(
            "a stacked (--layers above 1) or pipelined (--stages above 1) run",
            "no checkpoints and no data-parallel workers (not supported with pipelines yet)",
            *flag,
        ));
    }
    let Sizes { epochs, hidden, embed, lr } = setup.sizes;
    let (vocab, classes) = (setup.data.vocab.len(), setup.data.classes);
    let mut stack = Stack::new(setup.kind, args.layers, embed, hidden, vocab, Some(PAD), classes, &mut setup.rng)?;
    if let Some(e) = &mut stack.embed {
        setup.pretrained(e.table_mut())?;
    }
    let plan = PipeSettings {
        kind: args.schedule.kind(),
        micro_batches: args.micro_batches,
        epochs,
        batch: args.batch,
        loss_on: setup.loss_on,
        clip: (args.clip > 0.0).then_some(args.clip),
        max_steps: args.max_steps,
    };
    plan.check(args.stages)?;
    let stages: Vec<Stage> = stack
        .split(args.stages)?
        .into_iter()
        .map(|part| Stage::new(part, Optimizer::new(optimizer(args, lr)), setup.rng.clone()))
        .collect();
    let how = |on: &str| {
        format!(
            "{} in {} on {on}, {} schedule, {}",
            plural(args.layers, "layer"),
            plural(args.stages, "stage"),
            args.schedule.name(),
            plural(args.micro_batches, "micro-batch")
        )
    };
    let finish = |stage: &Stage, summary: &Summary| {
        let mut report = outcome(summary, stage.version as u64, stage.best_dev, stage.test_acc);
        report["layers"] = json!(args.layers);
        report["stages"] = json!(args.stages);
        report["schedule"] = json!(args.schedule.name());
        report["micro_batches"] = json!(args.micro_batches);
        report
    };
    match args.distributed {
        None => {
            setup.announce(&how("threads"));
            let last = stages.len() - 1;
            let results = on_threads(stages, setup.timeout, last, events, |mut stage, coll, report| {
                let summary = stage.fit(setup.splits(), &plan, coll, report)?;
                Ok(finish(&stage, &summary))
            })?;
            Ok(results.into_iter().last())
        }
        Some(Distributed::Mpi) => on_mpi(setup.timeout, |coll| {
            let (rank, size) = (coll.rank(), coll.size());
            if size != args.stages {
                return Err(Error::input(
                    "--distributed mpi with --stages",
                    format!("one MPI rank per stage ({})", args.stages),
                    plural(size, "rank"),
                ));
            }
            let last = rank + 1 == size;
            if last {
                setup.announce(&how("MPI ranks"));
            }
            let mut stage =
                stages.into_iter().nth(rank).ok_or_else(|| Error::Worker { rank, msg: "no stage".into() })?;
            let mut quiet = |_: Event| {};
            let events: &mut dyn FnMut(Event) = if last { events } else { &mut quiet };
            let summary = stage.fit(setup.splits(), &plan, coll, events)?;
            Ok(last.then(|| finish(&stage, &summary)))
        }),
    }
}

/// Runs `work` as this process's rank of an MPI job (`mpirun -np N arbor ...`), with the
/// machine's cores shared among its ranks. On an error the message is printed and the whole job
/// is aborted: finalizing MPI would wait for peers that may be dead or hung.
#[cfg(feature = "mpi")]
fn on_mpi<T>(timeout: Duration, work: impl FnOnce(&mut dyn Collective) -> Result<T>) -> Result<T> {
    let mut coll = arbor::dist::mpi::MpiCollective::init(timeout)?;
    let local: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    match arbor::with_cpu_threads((cores / local.max(1)).max(1), || work(&mut coll)) {
        Ok(t) => Ok(t),
        Err(e) => {
            eprintln!("arbor: {e}");
            coll.abort(1)
        }
    }
}

/// Without MPI support compiled in, `--distributed mpi` is refused.
#[cfg(not(feature = "mpi"))]
fn on_mpi<T>(_: Duration, _: impl FnOnce(&mut dyn Collective) -> Result<T>) -> Result<T> {
    Err(Error::input(
        "--distributed mpi",
        "an arbor built with MPI support (cargo build --release --features mpi)",
        "a build without it",
    ))
}

/// The name of the TU data set in `dir` (the prefix of its `NAME_A.txt`).
fn tu_name(dir: &Path) -> Result<String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| Error::Io { path: dir.display().to_string(), msg: e.to_string() })?;
    entries.filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix("_A.txt").map(String::from)).next().ok_or_else(
        || Error::Io { path: dir.display().to_string(), msg: "no NAME_A.txt here: not a TU data set".into() },
    )
}

fn train_graphs(args: &TrainArgs, sizes: &Sizes) -> Result<()> {
    let epochs = sizes.epochs;
    let tree_only = [
        ("--checkpoint", args.checkpoint.is_some()),
        ("--resume", args.resume.is_some()),
        ("--plot", args.plot.is_some()),
        ("--embeddings", args.embeddings.is_some()),
    ];
    if let Some((flag, _)) = tree_only.iter().find(|(_, set)| *set) {
        return Err(Error::input(
            "--model ggnn",
            "the cross-validation flags (--folds, --steps, sizes, optimizer)",
            format!("{flag}, which applies to tree and sequence models only"),
        ));
    }
    let dir = args.data.as_deref().ok_or_else(|| {
        Error::input("--model ggnn", "--data DIR with a TU data set (e.g. ../shared/data/mutag)", "no --data")
    })?;
    let name = tu_name(dir)?;
    let data = tu::read(dir, &name)?;
    eprintln!(
        "arbor: {}-fold cross-validation of ggnn on {name} ({} graphs, {} node labels, {} classes)",
        args.folds,
        data.graphs.len(),
        data.node_label_count,
        data.classes
    );
    let cfg = GraphTraining {
        steps: args.steps,
        features: sizes.embed,
        hidden: sizes.hidden,
        epochs,
        batch: args.batch,
        folds: args.folds,
        seed: args.seed,
        optimizer: optimizer(args, sizes.lr),
        clip: (args.clip > 0.0).then_some(args.clip),
    };
    let pb = ProgressBar::new((args.folds * epochs) as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} epochs, eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let start = Instant::now();
    let result = cross_validate(&data, &cfg, &mut |fold, _| {
        pb.set_message(format!("fold {}/{}", fold + 1, args.folds));
        pb.inc(1);
    })?;
    pb.finish_and_clear();
    for (k, a) in result.fold_acc.iter().enumerate() {
        eprintln!("fold {}: held-out accuracy {a:.4}", k + 1);
    }
    println!(
        "{}",
        json!({
            "model": "ggnn", "data": dir.display().to_string(), "folds": result.fold_acc.len(), "epochs": epochs,
            "steps": args.steps, "hidden": sizes.hidden, "embed": sizes.embed,
            "train_seconds": (start.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
            "graphs_per_s": result.graphs_per_s.round(), "cv_acc_mean": result.mean, "cv_acc_std": result.std,
        })
    );
    Ok(())
}

fn eval(args: &EvalArgs) -> Result<()> {
    let dir =
        if args.checkpoint.join("best").is_dir() { args.checkpoint.join("best") } else { args.checkpoint.clone() };
    let ck = Checkpoint::load(&dir)?;
    let meta = &ck.meta;
    let model_kind = Model::from_name(meta["model"].as_str().unwrap_or_default())?;
    let (embed, hidden, classes) =
        (meta_usize(meta, "embed")?, meta_usize(meta, "hidden")?, meta_usize(meta, "classes")?);
    let lowercase = meta["lowercase"].as_bool().unwrap_or(false);
    let words: Vec<String> = meta["vocab"]
        .as_array()
        .map(|a| a.iter().filter_map(|w| w.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let trained_on = meta["data"].as_str().unwrap_or("synthetic");
    let data_dir = args.data.clone().or_else(|| (trained_on != "synthetic").then(|| PathBuf::from(trained_on)));
    let test = match &data_dir {
        None => synthetic::generate(500, 12, meta_usize(meta, "seed")? as u64 + 2_000_003),
        Some(dir) => {
            let mut vocab = Vocab::from_words(&words, lowercase);
            sst::read(&dir.join("test.txt"), &mut vocab, false)?
        }
    };
    let test: Vec<TreeExample> =
        if model_kind.chains() { test.iter().map(TreeExample::to_chain).collect() } else { test };
    let mut model =
        Classifier::new(model_kind.cell(embed, hidden)?, words.len(), Some(PAD), classes, &mut Rng::new(0))?;
    model.restore(&ck)?;
    let acc = model.accuracy(&test, 256)?;
    println!(
        "{}",
        json!({"model": model_kind.name(), "checkpoint": dir.display().to_string(), "test_acc": acc, "trees": test.len()})
    );
    Ok(())
}

/// Peak resident memory of this process in MiB (Linux), or 0 where unknown.
fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Infers `batch` and predicts each tree's root class (what inference is timed on).
fn infer_batch<B: Backend>(model: &mut Classifier<B>, batch: &[&TreeExample]) -> Result<()> {
    let graphs: Vec<&arbor::InputGraph> = batch.iter().map(|e| &e.graph).collect();
    let ids: Vec<u32> = batch.iter().flat_map(|e| e.words.iter().copied()).collect();
    let (mut roots, mut base) = (Vec::with_capacity(batch.len()), 0);
    for e in batch {
        roots.extend(e.graph.roots().into_iter().map(|r| base + r));
        base += e.graph.len();
    }
    let h = model.infer_rows(&graphs, &ids, &roots)?;
    for k in 0..roots.len() {
        model.out.predict_row(&h, k)?;
    }
    Ok(())
}

/// The bench's progress bar.
fn bench_bar(args: &BenchArgs, len: usize) -> ProgressBar {
    let mode = if args.mode == Mode::Train { "train" } else { "infer" };
    bar(len, format!("bench {} {mode}", args.model.model().name()))
}

/// One bench worker's pass over `batches`: in training, the data-parallel steps of `arbor train`
/// ([`train_steps`]) on every minibatch; in inference, every `args.workers`-th minibatch from
/// its rank on.
fn worker_pass<B: Backend>(
    model: &mut Classifier<B>,
    coll: &mut dyn Collective,
    opt: &mut Optimizer,
    args: &BenchArgs,
    loss_on: LossOn,
    batches: &[Vec<&TreeExample>],
    pb: Option<&ProgressBar>,
) -> Result<()> {
    let me = coll.rank();
    // In training every worker steps on every minibatch: the first one counts it.
    let count = |trees: usize| {
        if let Some(pb) = pb.filter(|_| args.mode == Mode::Infer || me == 0) {
            pb.inc(trees as u64);
        }
    };
    match args.mode {
        Mode::Train => train_steps(model, opt, coll, batches, loss_on, None, &mut |_, trees| {
            count(trees);
            Ok(true)
        }),
        Mode::Infer => {
            for (k, batch) in batches.iter().enumerate().filter(|(k, _)| k % args.workers == me) {
                let _ = k;
                infer_batch(model, batch)?;
                count(batch.len());
            }
            Ok(())
        }
    }
}

/// Times `args.sentences` of `examples` through `args.workers` replicas of `model` on threads
/// (see `BenchArgs::workers`), or through `model` alone on another backend: each warms up on
/// three minibatches, the workers meet, and the time runs until the last one is done. Returns
/// the seconds and the floating-point operations the engines executed.
fn measure<B: Backend>(
    replicas: Vec<Classifier<B>>,
    args: &BenchArgs,
    examples: &[&TreeExample],
    loss_on: LossOn,
) -> Result<(f64, f64)>
where
    Classifier<B>: Send,
{
    let batches: Vec<Vec<&TreeExample>> = examples.chunks(args.batch).map(<[_]>::to_vec).collect();
    let warmup = batches.len().min(3);
    let pb = bench_bar(args, examples.len());
    let timed = on_threads(replicas, arbor::dist::DEFAULT_TIMEOUT, 0, &mut |_| {}, |mut model, coll, _| {
        let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
        let mut pass = |model: &mut Classifier<B>, coll: &mut ThreadCollective, batches, pb| {
            worker_pass(model, coll, &mut opt, args, loss_on, batches, pb)
        };
        pass(&mut model, coll, &batches[..warmup], None)?;
        let mut meet = [0.0f32];
        coll.all_reduce_sum(&mut meet)?;
        let flops_before = model.engine.flops();
        let start = Instant::now();
        pass(&mut model, coll, &batches, Some(&pb))?;
        Ok((start, model.engine.flops() - flops_before))
    })?;
    let seconds = timed.iter().map(|(start, _)| start.elapsed()).max().unwrap_or_default().as_secs_f64();
    pb.finish_and_clear();
    // Training replicas repeat the same minibatches' shares: their flops add up to one pass.
    Ok((seconds, timed.iter().map(|&(_, flops)| flops as f64).sum()))
}

fn bench(args: &BenchArgs) -> Result<()> {
    match args.threads {
        Some(t) => arbor::with_cpu_threads(t, || bench_on(args)),
        None => bench_on(args),
    }
}

/// [`bench`] within its thread budget.
fn bench_on(args: &BenchArgs) -> Result<()> {
    if args.workers == 0 || args.workers > 1 && args.device == Device::Cuda {
        return Err(Error::input("--workers", "at least 1, and 1 with --device cuda", args.workers.to_string()));
    }
    if args.device == Device::Cpu && args.precision != PrecisionArg::F32 {
        return Err(Error::input(
            "--precision",
            "f32 on the CPU (reduced precision is for --device cuda)",
            format!("{:?}", args.precision).to_lowercase(),
        ));
    }
    let model_kind = args.model.model();
    if matches!(args.model, ModelArg::Ggnn) || args.batch == 0 || args.sentences == 0 {
        return Err(Error::input(
            "arguments",
            "a tree or sequence model, --batch and --sentences above 0",
            format!("{} {} {}", model_kind.name(), args.batch, args.sentences),
        ));
    }
    let (pool, vocab, classes) = match (&args.data, model_kind) {
        (None, Model::TreeFc) => {
            // Every vertex pulls the same (non-padding) word; the label only feeds the loss.
            let graph = arbor::InputGraph::balanced_binary(args.leaves);
            let n = graph.len();
            let ex = TreeExample { graph, words: vec![2; n], labels: vec![0; n] };
            (vec![ex], synthetic::vocab().len(), synthetic::CLASSES)
        }
        _ => {
            let d = load(args.data.as_deref(), 1, false, model_kind)?;
            (d.train, d.vocab.len(), d.classes)
        }
    };
    let examples: Vec<&TreeExample> = pool.iter().cycle().take(args.sentences).collect();
    let cell = model_kind.cell(args.embed, args.hidden)?;
    let (fwd_flops, bwd_flops) = cell.flops_per_vertex();
    let nominal_per_vertex = fwd_flops + if args.mode == Mode::Train { bwd_flops } else { 0 };
    let mut rng = Rng::new(1);
    let loss_on = if args.loss == Loss::All && !model_kind.chains() { LossOn::All } else { LossOn::Root };
    let (seconds, flops, gpu) = match args.device {
        Device::Cpu => {
            let model = Classifier::new(cell, vocab, Some(PAD), classes, &mut rng)?;
            let mut replicas: Vec<Classifier> = (1..args.workers).map(|_| model.replica()).collect::<Result<_>>()?;
            replicas.insert(0, model);
            let (seconds, flops) = measure(replicas, args, &examples, loss_on)?;
            (seconds, flops, None)
        }
        Device::Cuda => {
            let gpu = arbor::cuda::CudaBackend::new(0)
                .map_err(|e| Error::input("--device cuda", "a usable CUDA device", e.to_string()))?;
            let name = gpu.description().to_string();
            gpu.set_precision(match args.precision {
                PrecisionArg::F32 => Precision::F32,
                PrecisionArg::Tf32 => Precision::Tf32,
                PrecisionArg::Bf16 => Precision::Bf16,
                PrecisionArg::F16 => Precision::F16,
            });
            let mut model = Classifier::on(gpu, cell, vocab, Some(PAD), classes, &mut rng)?;
            if args.precision == PrecisionArg::F16 {
                model.loss_scale = Some(LossScaler::dynamic());
            }
            let (seconds, flops) = measure(vec![model], args, &examples, loss_on)?;
            (seconds, flops, Some(name))
        }
    };
    let vertices: usize = examples.iter().map(|e| e.graph.len()).sum();
    let nominal = vertices as f64 * nominal_per_vertex as f64;
    println!(
        "{}",
        json!({
            "model": model_kind.name(),
            "mode": if args.mode == Mode::Train { "train" } else { "infer" },
            "device": if args.device == Device::Cuda { "cuda" } else { "cpu" },
            "gpu": gpu,
            "precision": format!("{:?}", args.precision).to_lowercase(),
            "threads": arbor::cpu_thread_budget(),
            "cpu_isa": arbor::isa::active().name(),
            "workers": args.workers,
            "batch": args.batch,
            "hidden": args.hidden,
            "embed": args.embed,
            "loss": if loss_on == LossOn::All { "all" } else { "root" },
            "sentences": args.sentences,
            "seconds": (seconds * 1e4).round() / 1e4,
            "sent_per_s": (args.sentences as f64 / seconds).round(),
            "vertices_per_s": (vertices as f64 / seconds).round(),
            "gflops": (flops / seconds / 1e7).round() / 100.0,
            "nominal_gflops": (nominal / seconds / 1e7).round() / 100.0,
            "peak_rss_mb": (peak_rss_mb() * 10.0).round() / 10.0,
        })
    );
    Ok(())
}
