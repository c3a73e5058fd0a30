//! The `arbor` command: train and evaluate models from the command line.

use arbor::checkpoint::Checkpoint;
use arbor::core::rng::Rng;
use arbor::data::{glove, sst, synthetic, tu, TreeExample, Vocab, PAD};
use arbor::layers::LossOn;
use arbor::nn::Model;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::plot::{self, Series};
use arbor::train::{cross_validate, Classifier, GraphTraining};
use arbor::trainer::{fit_threads, Event, Plan, Run, Splits, Summary};
use arbor::{Error, Result};
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
    Train(TrainArgs),
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
    /// Seconds a worker waits for a peer before the run ends with an error.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Pause inside each checkpoint write, in milliseconds (for crash tests).
    #[arg(long, default_value_t = 0, hide = true)]
    persist_pause_ms: u64,
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

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train(&args),
        Command::Eval(args) => eval(&args),
        Command::Bench(args) => bench(&args),
    };
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
                name: dir.display().to_string(),
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
    meta[key].as_u64().map(|v| v as usize).ok_or_else(|| Error::Input {
        what: "checkpoint metadata".into(),
        expected: format!("a number `{key}`"),
        got: meta[key].to_string(),
    })
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

fn train(args: &TrainArgs) -> Result<()> {
    let sizes = Sizes::of(args);
    let Sizes { epochs, hidden, embed, lr } = sizes;
    if args.batch == 0 || epochs == 0 || hidden == 0 || embed == 0 {
        return Err(Error::Input {
            what: "arguments".into(),
            expected: "--batch, --epochs, --hidden and --embed above 0".into(),
            got: format!("{} {epochs} {hidden} {embed}", args.batch),
        });
    }
    if matches!(args.model, ModelArg::Ggnn) {
        return train_graphs(args, &sizes);
    }
    let model_kind = args.model.model();
    let data = load(args.data.as_deref(), args.seed, args.lowercase, model_kind)?;
    let mut rng = Rng::new(args.seed);
    let cell = model_kind.cell(embed, hidden)?;
    let mut model = Classifier::new(cell, data.vocab.len(), Some(PAD), data.classes, &mut rng)?;
    if let Some(file) = &args.embeddings {
        let found = glove::read_into(file, &data.vocab, embed, model.embed.table_mut())?;
        model.embed.table_mut()[PAD as usize * embed..(PAD as usize + 1) * embed].fill(0.0);
        eprintln!("arbor: {found} of {} words have vectors in {}", data.vocab.len(), file.display());
    }
    let opt = Optimizer::new(optimizer(args, lr));
    let loss_on = match (args.loss, model_kind.chains()) {
        // A chain has one label: the sentence's.
        (Loss::Root, _) | (_, true) => LossOn::Root,
        (Loss::All, false) => LossOn::All,
    };
    let mut run = Run::new(model, opt, &rng);
    if let Some(dir) = &args.resume {
        let dir = if dir.join("last").is_dir() { dir.join("last") } else { dir.clone() };
        run.resume(&Checkpoint::load(&dir)?)?;
        eprintln!("arbor: resuming from {} at epoch {}, step {}", dir.display(), run.pos.epoch, run.pos.steps);
    }
    let plan = Plan {
        epochs,
        batch: args.batch,
        loss_on,
        clip: (args.clip > 0.0).then_some(args.clip),
        checkpoint: args.checkpoint.clone(),
        checkpoint_every: args.checkpoint_every,
        max_steps: args.max_steps,
        persist_pause: Duration::from_millis(args.persist_pause_ms),
        meta: json!({
            "model": model_kind.name(), "embed": embed, "hidden": hidden, "classes": data.classes,
            "data": data.name, "seed": args.seed, "lowercase": args.lowercase, "vocab": data.vocab.words(),
        }),
    };
    let splits = Splits { train: &data.train, dev: &data.dev, test: &data.test };
    let timeout = Duration::from_secs_f64(args.timeout.max(0.001));
    let mut pb: Option<ProgressBar> = None;
    let mut loss_curve = Vec::new();
    let mut dev_curve = Vec::new();
    let mut events = |e: Event| match e {
        Event::EpochStart { epoch, done, total } => {
            let bar = bar(total, format!("epoch {epoch}/{epochs}"));
            bar.set_position(done as u64);
            pb = Some(bar);
        }
        Event::Trees(n) => {
            if let Some(b) = &pb {
                b.inc(n as u64);
            }
        }
        Event::EpochEnd { epoch, loss, dev } => {
            if let Some(b) = pb.take() {
                b.finish_and_clear();
            }
            eprintln!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
            loss_curve.push(loss);
            dev_curve.push(dev);
            if let Some(path) = &args.plot {
                let series = [
                    Series { name: "training loss", values: &loss_curve },
                    Series { name: "dev root accuracy", values: &dev_curve },
                ];
                if let Err(e) = plot::write_svg(path, &series) {
                    eprintln!("arbor: {e}");
                }
            }
        }
    };
    let (summary, rank, workers) = match args.distributed {
        None => {
            eprintln!(
                "arbor: training {} on {} ({} train / {} dev / {} test trees, vocabulary {}, {} worker{})",
                model_kind.name(),
                data.name,
                data.train.len(),
                data.dev.len(),
                data.test.len(),
                data.vocab.len(),
                args.workers,
                if args.workers == 1 { "" } else { "s" }
            );
            (fit_threads(&mut run, args.workers, timeout, splits, &plan, &mut events)?, 0, args.workers)
        }
        Some(Distributed::Mpi) => fit_mpi(&mut run, timeout, splits, &plan, &mut events)?,
    };
    if let Some(b) = pb.take() {
        b.finish_and_clear();
    }
    if rank == 0 {
        let summary = json!({
            "model": model_kind.name(),
            "data": data.name,
            "epochs": epochs,
            "steps": run.pos.steps,
            "batch": args.batch,
            "hidden": hidden,
            "embed": embed,
            "workers": workers,
            "train_seconds": (summary.train_seconds * 1000.0).round() / 1000.0,
            "sent_per_s": (summary.sentences as f64 / summary.train_seconds.max(1e-9)).round(),
            "dev_acc": run.best_dev,
            "test_acc": run.test_acc,
        });
        println!("{summary}");
    }
    Ok(())
}

/// Trains as one rank of an MPI job; returns the summary, this rank and the number of ranks.
#[cfg(feature = "mpi")]
fn fit_mpi(
    run: &mut Run,
    timeout: Duration,
    splits: Splits<'_>,
    plan: &Plan,
    events: &mut dyn FnMut(Event),
) -> Result<(Summary, usize, usize)> {
    use arbor::dist::Collective;
    let mut coll = arbor::dist::mpi::MpiCollective::init(timeout)?;
    let (rank, size) = (coll.rank(), coll.size());
    if rank == 0 {
        eprintln!("arbor: training on {size} MPI ranks");
    }
    let mut quiet = |_: Event| {};
    let events: &mut dyn FnMut(Event) = if rank == 0 { events } else { &mut quiet };
    // Ranks on one machine share its cores.
    let local: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    // Fails only if the pool is already running, in which case it keeps its size.
    let _ = rayon::ThreadPoolBuilder::new().num_threads((cores / local.max(1)).max(1)).build_global();
    let summary = run.fit(splits, plan, &mut coll, events)?;
    Ok((summary, rank, size))
}

/// Without MPI support compiled in, `--distributed mpi` is refused.
#[cfg(not(feature = "mpi"))]
fn fit_mpi(
    _: &mut Run,
    _: Duration,
    _: Splits<'_>,
    _: &Plan,
    _: &mut dyn FnMut(Event),
) -> Result<(Summary, usize, usize)> {
    Err(Error::Input {
        what: "--distributed mpi".into(),
        expected: "an arbor built with MPI support (cargo build --release --features mpi)".into(),
        got: "a build without it".into(),
    })
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
        return Err(Error::Input {
            what: "--model ggnn".into(),
            expected: "the cross-validation flags (--folds, --steps, sizes, optimizer)".into(),
            got: format!("{flag}, which applies to tree and sequence models only"),
        });
    }
    let dir = args.data.as_deref().ok_or_else(|| Error::Input {
        what: "--model ggnn".into(),
        expected: "--data DIR with a TU data set (e.g. ../shared/data/mutag)".into(),
        got: "no --data".into(),
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

fn bench(args: &BenchArgs) -> Result<()> {
    if args.device == Device::Cuda {
        let why = match arbor_cuda::device_count() {
            Ok(n) if n > 0 => "the CUDA backend is not built yet".to_string(),
            Ok(_) => "no CUDA device".to_string(),
            Err(e) => e.to_string(),
        };
        return Err(Error::Input { what: "--device cuda".into(), expected: "a usable CUDA backend".into(), got: why });
    }
    if let Some(t) = args.threads {
        rayon::ThreadPoolBuilder::new().num_threads(t.max(1)).build_global().map_err(|e| Error::Input {
            what: "--threads".into(),
            expected: "a thread pool".into(),
            got: e.to_string(),
        })?;
    }
    let model_kind = args.model.model();
    if matches!(args.model, ModelArg::Ggnn) || args.batch == 0 || args.sentences == 0 {
        return Err(Error::Input {
            what: "arguments".into(),
            expected: "a tree or sequence model, --batch and --sentences above 0".into(),
            got: format!("{} {} {}", model_kind.name(), args.batch, args.sentences),
        });
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
    let mut model = Classifier::new(cell, vocab, Some(PAD), classes, &mut rng)?;
    let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
    let loss_on = if args.loss == Loss::All && !model_kind.chains() { LossOn::All } else { LossOn::Root };
    let run = |model: &mut Classifier, opt: &mut Optimizer, batch: &[&TreeExample]| -> Result<()> {
        match args.mode {
            Mode::Train => model.train_step(batch, loss_on, opt, None).map(|_| ()),
            Mode::Infer => {
                let graphs: Vec<&arbor::InputGraph> = batch.iter().map(|e| &e.graph).collect();
                let ids: Vec<u32> = batch.iter().flat_map(|e| e.words.iter().copied()).collect();
                let h = model.infer(&graphs, &ids)?;
                let mut root = 0;
                for e in batch {
                    root += e.graph.len();
                    model.out.predict_row(&h, root - 1)?;
                }
                Ok(())
            }
        }
    };
    let warmup = args.sentences.min(args.batch * 3);
    for chunk in examples[..warmup].chunks(args.batch) {
        run(&mut model, &mut opt, chunk)?;
    }
    let pb = bar(
        examples.len(),
        format!("bench {} {}", model_kind.name(), if args.mode == Mode::Train { "train" } else { "infer" }),
    );
    let flops_before = model.engine.flops();
    let start = Instant::now();
    for chunk in examples.chunks(args.batch) {
        run(&mut model, &mut opt, chunk)?;
        pb.inc(chunk.len() as u64);
    }
    let seconds = start.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let vertices: usize = examples.iter().map(|e| e.graph.len()).sum();
    let flops = (model.engine.flops() - flops_before) as f64;
    let nominal = vertices as f64 * nominal_per_vertex as f64;
    println!(
        "{}",
        json!({
            "model": model_kind.name(),
            "mode": if args.mode == Mode::Train { "train" } else { "infer" },
            "device": "cpu",
            "threads": rayon::current_num_threads(),
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
