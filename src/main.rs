//! The `arbor` command: train and evaluate models from the command line.

use arbor::core::rng::Rng;
use arbor::data::{sst, synthetic, TreeExample};
use arbor::layers::LossOn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::train::TreeClassifier;
use arbor::{nn, Error, Result};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

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
}

#[derive(Clone, Copy, ValueEnum)]
enum Model {
    /// Binary constituency Tree-LSTM (Tai et al. 2015).
    TreeLstm,
    /// Child-sum Tree-LSTM.
    ChildSum,
    /// An LSTM over each sentence as a chain (loss at the last word).
    VarLstm,
    /// Tree-FC: one fully connected layer over the children (the Cavs benchmark cell).
    TreeFc,
}

#[derive(Clone, Copy, ValueEnum)]
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
    model: Model,
    /// An SST directory (train.txt, dev.txt, test.txt); without it, the synthetic treebank.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Passes over the training set.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Trees per minibatch.
    #[arg(long, default_value_t = 25)]
    batch: usize,
    /// Hidden state width.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Word vector width.
    #[arg(long, default_value_t = 32)]
    embed: usize,
    /// Where the loss is taken.
    #[arg(long, value_enum, default_value = "all")]
    loss: Loss,
    /// The optimizer.
    #[arg(long, value_enum, default_value = "adam")]
    optimizer: Opt,
    /// Learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f32,
    /// Weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,
    /// Clip the joint gradient norm to this value (0: no clipping).
    #[arg(long, default_value_t = 5.0)]
    clip: f32,
    /// Lowercase words (SST only).
    #[arg(long)]
    lowercase: bool,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train(&args),
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
    vocab: usize,
    classes: usize,
}

fn load(args: &TrainArgs) -> Result<Data> {
    match &args.data {
        None => Ok(Data {
            name: "synthetic".into(),
            train: synthetic::generate(4000, 12, args.seed),
            dev: synthetic::generate(500, 12, args.seed + 1_000_003),
            test: synthetic::generate(500, 12, args.seed + 2_000_003),
            vocab: synthetic::vocab().len(),
            classes: synthetic::CLASSES,
        }),
        Some(dir) => {
            if !dir.is_dir() {
                return Err(Error::Io { path: dir.display().to_string(), msg: "not a directory".into() });
            }
            let s = sst::read_splits(dir, args.lowercase)?;
            Ok(Data {
                name: dir.display().to_string(),
                vocab: s.vocab.len(),
                train: s.train,
                dev: s.dev,
                test: s.test,
                classes: sst::CLASSES,
            })
        }
    }
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

fn train(args: &TrainArgs) -> Result<()> {
    if args.batch == 0 || args.epochs == 0 || args.hidden == 0 || args.embed == 0 {
        return Err(Error::Input {
            what: "arguments".into(),
            expected: "--batch, --epochs, --hidden and --embed above 0".into(),
            got: format!("{} {} {} {}", args.batch, args.epochs, args.hidden, args.embed),
        });
    }
    let mut data = load(args)?;
    let (cell, model_name) = match args.model {
        Model::TreeLstm => (nn::tree_lstm(args.embed, args.hidden)?, "tree-lstm"),
        Model::ChildSum => (nn::child_sum_tree_lstm(args.embed, args.hidden)?, "child-sum"),
        Model::VarLstm => (nn::var_lstm(args.embed, args.hidden)?, "var-lstm"),
        Model::TreeFc => (nn::tree_fc(args.embed, args.hidden)?, "tree-fc"),
    };
    if matches!(args.model, Model::VarLstm) {
        for split in [&mut data.train, &mut data.dev, &mut data.test] {
            *split = split.iter().map(TreeExample::to_chain).collect();
        }
    }
    let mut rng = Rng::new(args.seed);
    let mut model = TreeClassifier::new(cell, data.vocab, data.classes, &mut rng)?;
    let rule = match args.optimizer {
        Opt::Adagrad => Rule::Adagrad,
        Opt::Adam => Rule::Adam,
        Opt::Adamw => Rule::AdamW,
        Opt::Sgd => Rule::Sgd { momentum: 0.9 },
    };
    let mut opt = Optimizer::new(Config { weight_decay: args.weight_decay, ..Config::new(rule, args.lr) });
    let loss_on = match (args.loss, args.model) {
        // A chain has one label: the sentence's.
        (_, Model::VarLstm) | (Loss::Root, _) => LossOn::Root,
        (Loss::All, _) => LossOn::All,
    };
    let clip = (args.clip > 0.0).then_some(args.clip);
    eprintln!(
        "arbor: training {model_name} on {} ({} train / {} dev / {} test trees, vocabulary {})",
        data.name,
        data.train.len(),
        data.dev.len(),
        data.test.len(),
        data.vocab
    );
    let mut order: Vec<usize> = (0..data.train.len()).collect();
    let (mut best_dev, mut train_seconds, mut sentences) = (0.0f64, 0.0f64, 0usize);
    let mut test_acc = 0.0;
    for epoch in 1..=args.epochs {
        rng.shuffle(&mut order);
        let pb = bar(order.len(), format!("epoch {epoch}/{}", args.epochs));
        let start = Instant::now();
        let (mut loss, mut steps) = (0.0f64, 0usize);
        for chunk in order.chunks(args.batch) {
            let batch: Vec<&TreeExample> = chunk.iter().map(|&i| &data.train[i]).collect();
            let s = model.train_step(&batch, loss_on, &mut opt, clip)?;
            loss += f64::from(s.loss);
            steps += 1;
            pb.inc(chunk.len() as u64);
        }
        train_seconds += start.elapsed().as_secs_f64();
        sentences += order.len();
        pb.finish_and_clear();
        let dev = model.accuracy(&data.dev, 256)?;
        if dev > best_dev {
            best_dev = dev;
            test_acc = model.accuracy(&data.test, 256)?;
        }
        eprintln!("epoch {epoch}: loss {:.4}, dev root accuracy {dev:.4}", loss / steps.max(1) as f64);
    }
    let summary = serde_json::json!({
        "model": model_name,
        "data": data.name,
        "epochs": args.epochs,
        "batch": args.batch,
        "hidden": args.hidden,
        "embed": args.embed,
        "train_seconds": (train_seconds * 1000.0).round() / 1000.0,
        "sent_per_s": (sentences as f64 / train_seconds.max(1e-9)).round(),
        "dev_acc": best_dev,
        "test_acc": test_acc,
    });
    println!("{summary}");
    Ok(())
}
