//! `arbor train`: trees and sequences data-parallel or pipelined, graphs by cross-validation.

use crate::args::PrecisionArg;
use crate::args::*;
use crate::{bar, load, Data};
use crate::{on_device, OnDevice};
use arbor::checkpoint::Checkpoint;
use arbor::data::labelled::Labelled;
use arbor::data::{glove, PAD, UNK};
use arbor::dist::Collective;
use arbor::layers::LossOn;
use arbor::layers::{Embedding, WordDropout};
use arbor::model;
use arbor::nn::Model;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::pipeline::{Part, PipeSettings, Stage};
use arbor::plot::{self, Series};
use arbor::rng::Rng;
use arbor::run_folder::{Existing, RunFolder};
use arbor::trainer::{fit_threads, on_threads, Event, Learned, Learner, Next, Run, Settings, Splits, Summary};
use arbor::{Backend, Error, Result};
use indicatif::ProgressBar;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The sizes and rates of a run: the flags, or the model's defaults.
pub(crate) struct Sizes {
    pub(crate) epochs: usize,
    pub(crate) hidden: usize,
    pub(crate) embed: usize,
    pub(crate) lr: f32,
}

impl Sizes {
    pub(crate) fn of(args: &TrainArgs) -> Sizes {
        // Per model: epochs, hidden, embed, learning rate (SICK: the sizes of Tai et al.).
        let (epochs, hidden, embed, lr) = match args.model {
            ModelArg::Ggnn => (100, 32, 16, 0.005),
            ModelArg::Sick => (10, 150, 300, 0.01),
            _ => (5, 64, 32, 0.01),
        };
        Sizes {
            epochs: args.epochs.unwrap_or(epochs),
            hidden: args.hidden.unwrap_or(hidden),
            embed: args.embed.unwrap_or(embed),
            lr: args.lr.unwrap_or(lr),
        }
    }
}

pub(crate) fn optimizer(args: &TrainArgs, lr: f32) -> Config {
    let rule = match args.optimizer {
        Opt::Adagrad => Rule::Adagrad,
        Opt::Adam => Rule::Adam,
        Opt::Adamw => Rule::AdamW,
        Opt::Sgd => Rule::Sgd { momentum: 0.9 },
    };
    Config { weight_decay: args.weight_decay, ..Config::new(rule, lr) }
}

/// The optimizer of a run at learning rate `lr`, with the word vectors at `--embed-lr` if given.
pub(crate) fn new_optimizer(args: &TrainArgs, lr: f32) -> Optimizer {
    let opt = args.freeze.iter().fold(Optimizer::new(optimizer(args, lr)), |opt, name| opt.freeze(name));
    match args.embed_lr {
        Some(e) => opt.with_lr("embedding", e),
        None => opt,
    }
}

/// A fresh run of `model` at learning rate `lr` ([`new_optimizer`]), scoring a moving average of
/// the weights with `--average`; a `--freeze` name the model has no tensor of is refused.
pub(crate) fn new_run<L: Learned>(model: L, args: &TrainArgs, lr: f32, rng: &Rng) -> Result<Run<L>> {
    if !args.freeze.is_empty() {
        let names: Vec<String> = model.tensors_lent()?.into_iter().map(|t| t.0).collect();
        if let Some(name) = args.freeze.iter().find(|n| !names.contains(n)) {
            return Err(Error::input(
                format!("--freeze {name}"),
                format!("the name of one of the model's tensors ({})", names.join(", ")),
                "no such tensor",
            ));
        }
    }
    let run = Run::new(model, new_optimizer(args, lr), rng);
    match args.average {
        Some(decay) => run.with_average(decay),
        None => Ok(run),
    }
}

/// Records in `meta` the flags a checkpoint must resume with that older checkpoints lack, each
/// as `null` when unset (an old checkpoint reads as `null` too): the word-vector learning rate,
/// the weight average's decay, the dropout rates (`output_dropout`: `dropout` once meant both
/// rates, so an old checkpoint with dropout must not match), the layers (`null` for one), the
/// learning-rate decay and the frozen tensors. (`--patience` may change on a resume: it decides only when to stop.)
pub(crate) fn record_optional_flags(args: &TrainArgs, meta: &mut Value) {
    let used = |rate: f32| (rate > 0.0).then_some(rate);
    meta["embed_lr"] = json!(args.embed_lr);
    meta["average"] = json!(args.average);
    meta["word_dropout"] = json!(used(args.word_dropout));
    meta["output_dropout"] = json!(used(args.dropout));
    meta["input_dropout"] = json!(used(args.input_dropout));
    meta["recurrent_dropout"] = json!(used(args.recurrent_dropout));
    meta["layers"] = json!((args.layers > 1).then_some(args.layers));
    meta["lr_decay"] = json!(args.lr_decay);
    meta["freeze"] = json!((!args.freeze.is_empty()).then_some(&args.freeze));
}

/// A training run's progress on stderr: a bar per epoch and a line per finished epoch, whose
/// curves are also drawn to `plot`.
pub(crate) struct Progress<'a> {
    epochs: usize,
    plot: Option<&'a Path>,
    /// What the dev score is (`dev root accuracy`, `dev Pearson`).
    dev_name: &'static str,
    bar: Option<ProgressBar>,
    loss: Vec<f64>,
    dev: Vec<f64>,
}

impl<'a> Progress<'a> {
    /// The progress of `epochs` epochs whose dev score is `dev_name`, drawn to `plot` if given
    /// (an error now, not after an epoch, if it cannot be written).
    pub(crate) fn new(epochs: usize, plot: Option<&'a Path>, dev_name: &'static str) -> Result<Progress<'a>> {
        if let Some(path) = plot {
            let existed = path.exists();
            std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .and_then(|_| if existed { Ok(()) } else { std::fs::remove_file(path) })
                .map_err(|e| Error::Io { path: path.display().to_string(), msg: e.to_string() })?;
        }
        Ok(Progress { epochs, plot, dev_name, bar: None, loss: Vec::new(), dev: Vec::new() })
    }

    pub(crate) fn on(&mut self, e: Event) {
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
                eprintln!("epoch {epoch}: loss {loss:.4}, {} {dev:.4}", self.dev_name);
                if loss > 1e6 {
                    eprintln!("arbor: warning: a loss of {loss:.3e} looks diverged; lower the learning rate");
                }
                self.loss.push(loss);
                self.dev.push(dev);
                if let Some(path) = self.plot {
                    let series = [
                        Series { name: "training loss", values: &self.loss },
                        Series { name: self.dev_name, values: &self.dev },
                    ];
                    if let Err(e) = plot::write_svg(path, &series) {
                        eprintln!("arbor: {e}");
                    }
                }
            }
        }
    }

    pub(crate) fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

/// What every way of training a tree or sequence model starts from.
pub(crate) struct Setup<'a> {
    pub(crate) args: &'a TrainArgs,
    pub(crate) sizes: Sizes,
    pub(crate) kind: Model,
    pub(crate) data: Data,
    pub(crate) rng: Rng,
    pub(crate) loss_on: LossOn,
    pub(crate) timeout: Duration,
}

impl Setup<'_> {
    /// Fills an embedding table from --embeddings, if given (the padding row stays zero).
    pub(crate) fn pretrained(&self, table: &mut [f32]) -> Result<()> {
        let Some(file) = &self.args.embeddings else { return Ok(()) };
        let embed = self.sizes.embed;
        let found = glove::read_into(file, &self.data.vocab, embed, table)?;
        table[PAD as usize * embed..(PAD as usize + 1) * embed].fill(0.0);
        let merged = match found.merged {
            0 => String::new(),
            n => format!(" ({} merged by --lowercase)", plural(n, "case variant")),
        };
        eprintln!(
            "arbor: {} of {} words have vectors in {}{merged}",
            found.words,
            self.data.vocab.len(),
            file.display()
        );
        Ok(())
    }

    /// `--word-dropout` with the words' counts in the training split, if asked for.
    pub(crate) fn word_dropout(&self) -> Option<WordDropout> {
        let alpha = self.args.word_dropout;
        (alpha > 0.0).then(|| {
            let mut counts = vec![0; self.data.vocab.len()];
            for &w in self.data.train.iter().flat_map(|e| &e.words) {
                if let Some(c) = counts.get_mut(w as usize) {
                    *c += 1;
                }
            }
            WordDropout::by_frequency(UNK, &counts, alpha)
        })
    }

    /// The stacked classifier of `--layers` layers ([`stacked_model`]) on `backend`, its word
    /// vectors from `--embeddings` with `--word-dropout`, every flag's dropout in its cells;
    /// refused before anything is allocated where `replicas` copies would not fit in memory.
    pub(crate) fn stacked_model<B: Backend>(&mut self, backend: &B, replicas: usize) -> Result<model::Model<B>> {
        let (args, hidden, embed) = (self.args, self.sizes.hidden, self.sizes.embed);
        let (vocab, classes) = (self.data.vocab.len(), self.data.classes);
        let cell =
            |k: usize| self.kind.cell_with_dropout(if k == 0 { embed } else { hidden }, hidden, args.cell_dropout(k));
        // Checked before the layers are built: the bottom layer, and the others alike.
        let (bottom, above) = (cell(0)?, cell(1)?);
        let layers = args.layers as u128;
        let floats = crate::model_floats(vocab, embed, &[&bottom], hidden, classes)
            + (layers - 1) * arbor::memory::param_floats(&above);
        let engines = layers * replicas as u128 + if args.stages > 1 { layers } else { 0 };
        arbor::memory::check(
            "--hidden, --embed, --layers, --stages and --workers",
            floats * 16 * replicas as u128
                + engines * arbor::memory::ENGINE_BYTES
                + args.stages as u128 * arbor::memory::STAGE_BYTES,
            "parameters, gradients, optimizer state and the layers' engines",
        )?;
        let cells = (0..args.layers).map(cell).collect::<Result<Vec<_>>>()?;
        let mut words = Embedding::new(vocab, embed, 0.1, &mut self.rng).with_padding(PAD);
        self.pretrained(words.table_mut())?;
        if let Some(w) = self.word_dropout() {
            words = words.with_word_dropout(w);
        }
        arbor::zoo::classifier(
            backend,
            words,
            cells,
            classes,
            Labelled::readout(self.loss_on),
            args.seed,
            &mut self.rng,
        )
    }

    /// The train, dev and test trees as examples of a [`model::Model`] reading every vertex.
    fn labelled(&self) -> [Vec<Labelled<'_>>; 3] {
        let (d, on) = (&self.data, self.loss_on);
        [&d.train, &d.dev, &d.test].map(|trees| Labelled::all(trees, on, d.classes))
    }

    pub(crate) fn announce(&self, how: &str) {
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

/// Refuses flags whose values make no sense for `arbor train`, each with a one-line error naming
/// the flag: rates and bounds that are negative or not finite, more workers than a minibatch has
/// examples, a checkpoint interval without a checkpoint folder, flags a model ignores.
fn check_flags(args: &TrainArgs, sizes: &Sizes) -> Result<()> {
    let bad = |flag: &str, expected: &str, got: String| Err(Error::input(flag, expected, got));
    if !(sizes.lr.is_finite() && sizes.lr > 0.0) {
        return bad("--lr", "a finite rate above 0", sizes.lr.to_string());
    }
    if !(args.word_dropout.is_finite() && args.word_dropout >= 0.0) {
        return bad("--word-dropout", "a finite α of 0 (none) or more", args.word_dropout.to_string());
    }
    if let Some(e) = args.embed_lr.filter(|e| !(e.is_finite() && *e > 0.0)) {
        return bad("--embed-lr", "a finite rate above 0", e.to_string());
    }
    if !(args.weight_decay.is_finite() && args.weight_decay >= 0.0) {
        return bad("--weight-decay", "a finite value of 0 or more", args.weight_decay.to_string());
    }
    if !(args.clip.is_finite() && args.clip >= 0.0) {
        return bad("--clip", "a finite gradient-norm bound of 0 (none) or more", args.clip.to_string());
    }
    for (flag, rate) in args.dropout_rates() {
        if !(0.0..1.0).contains(&rate) {
            return bad(flag, "a rate in [0, 1)", rate.to_string());
        }
    }
    if args.workers == 0 || args.workers > args.batch {
        let expected = format!("between 1 and the examples of a minibatch (--batch {})", args.batch);
        return bad("--workers", &expected, args.workers.to_string());
    }
    if args.checkpoint_every.is_some() && checkpoint_dir(args).is_none() {
        return bad("--checkpoint-every", "a --checkpoint DIR to write to", "no --checkpoint".into());
    }
    if let Some(d) = args.average.filter(|d| !(0.0..1.0).contains(d)) {
        return bad("--average", "a decay in [0, 1)", d.to_string());
    }
    if args.average.is_some() && (args.stages > 1 || matches!(args.model, ModelArg::Ggnn)) {
        let got = if args.stages > 1 { format!("--stages {}", args.stages) } else { "--model ggnn".into() };
        return bad("--average", "one stage of a tree, sequence or sick model", got);
    }
    if args.stages == 1 {
        let pipeline_only =
            [("--micro-batches", args.micro_batches.is_some()), ("--schedule", args.schedule.is_some())];
        if let Some((flag, _)) = pipeline_only.iter().find(|(_, set)| *set) {
            return bad(flag, "--stages above 1 (a pipeline)", "--stages 1".into());
        }
    }
    if let Some(d) = args.lr_decay.filter(|d| !(d.is_finite() && *d > 0.0 && *d <= 1.0)) {
        return bad("--lr-decay", "a factor above 0 and at most 1", d.to_string());
    }
    if args.patience == Some(0) {
        return bad("--patience", "at least 1 epoch", "0".into());
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        return bad("--timeout", "a number of seconds above 0", args.timeout.to_string());
    }
    // Flags a model would ignore: (flag, set, the models that use it).
    let trees = "the tree and sequence models";
    let ignored: &[(&str, bool, &str)] = match args.model {
        ModelArg::Ggnn => &[
            ("--distributed", args.distributed.is_some(), "every model but ggnn, whose folds run one at a time"),
            ("--max-steps", args.max_steps.is_some(), "every model but ggnn, which trains --epochs per fold"),
            ("--lowercase", args.lowercase, "the models over words"),
            ("--loss", args.loss.is_some(), trees),
            ("--patience", args.patience.is_some(), "every model but ggnn, which trains --epochs per fold"),
            ("--lr-decay", args.lr_decay.is_some(), "every model but ggnn, which trains --epochs per fold"),
            ("--freeze", !args.freeze.is_empty(), "every model but ggnn, which trains --epochs per fold"),
        ],
        ModelArg::Sick => &[
            ("--loss", args.loss.is_some(), trees),
            ("--folds", args.folds.is_some(), "ggnn"),
            ("--steps", args.steps.is_some(), "ggnn"),
        ],
        ModelArg::VarLstm => &[
            ("--loss all", args.loss == Some(Loss::All), "the tree models (a chain has one label, its sentence's)"),
            ("--folds", args.folds.is_some(), "ggnn"),
            ("--steps", args.steps.is_some(), "ggnn"),
        ],
        _ => &[("--folds", args.folds.is_some(), "ggnn"), ("--steps", args.steps.is_some(), "ggnn")],
    };
    if let Some((flag, _, users)) = ignored.iter().find(|(_, set, _)| *set) {
        return bad(flag, &format!("a model that uses it ({users})"), format!("--model {}", args.model.name()));
    }
    if matches!(args.model, ModelArg::Ggnn) && args.embed_lr.is_some() {
        return bad(
            "--embed-lr",
            "a model over words (not ggnn: its node labels learn at --lr)",
            "--model ggnn".into(),
        );
    }
    if matches!(args.model, ModelArg::Ggnn) && (args.workers > 1 || args.stages > 1 || args.layers > 1) {
        return bad("--model ggnn", "one worker on one stage (cross-validation runs a fold at a time)", {
            format!("--workers {} --layers {} --stages {}", args.workers, args.layers, args.stages)
        });
    }
    Ok(())
}

pub(crate) fn plural(n: usize, what: &str) -> String {
    let ending = match n {
        1 => "",
        _ if what.ends_with("ch") || what.ends_with('s') => "es",
        _ => "s",
    };
    format!("{n} {what}{ending}")
}

pub(crate) fn train(args: &TrainArgs) -> Result<()> {
    let sizes = Sizes::of(args);
    let Sizes { epochs, hidden, embed, .. } = sizes;
    if args.batch == 0 || epochs == 0 || hidden == 0 || embed == 0 || args.layers == 0 || args.stages == 0 {
        return Err(Error::input(
            "arguments",
            "--batch, --epochs, --hidden, --embed, --layers and --stages above 0",
            format!("{} {epochs} {hidden} {embed} {} {}", args.batch, args.layers, args.stages),
        ));
    }
    check_flags(args, &sizes)?;
    let mut dropouts = args.dropout_rates().into_iter().chain([("--word-dropout", args.word_dropout)]);
    if let Some((flag, _)) = dropouts.find(|(_, rate)| *rate > 0.0) {
        if matches!(args.model, ModelArg::Ggnn | ModelArg::Sick) {
            return Err(Error::input(
                flag,
                "a tree or sequence model (tree-lstm, child-sum, var-lstm, tree-fc)",
                format!("--model {}", args.model.name()),
            ));
        }
    }
    let timeout = Duration::try_from_secs_f64(args.timeout).map_err(|_| {
        Error::input("--timeout", "a number of seconds above 0, to about 1.8e19", args.timeout.to_string())
    })?;
    match args.model {
        ModelArg::Ggnn => return crate::graphs::train(args, &sizes),
        ModelArg::Sick => return crate::sick::train(args, &sizes, timeout),
        _ => {}
    }
    let kind = args.model.model();
    let data = load(args.data.as_deref(), args.seed, args.lowercase, kind)?;
    let loss_on = match (args.loss(), kind.chains()) {
        // A chain has one label: the sentence's.
        (Loss::Root, _) | (_, true) => LossOn::Root,
        (Loss::All, false) => LossOn::All,
    };
    for (split, trees) in [("dev", data.dev.len()), ("test", data.test.len())] {
        if trees == 0 {
            eprintln!("arbor: warning: the {split} split of {} is empty: its accuracy is reported as null", data.name);
        }
    }
    let setup = Setup { args, sizes, kind, data, rng: Rng::new(args.seed), loss_on, timeout };
    let mut progress = Progress::new(epochs, args.plot.as_deref(), "dev root accuracy")?;
    let mut events = |e: Event| progress.on(e);
    let report =
        if args.stages > 1 { train_pipeline(setup, &mut events)? } else { train_data_parallel(setup, &mut events)? };
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
pub(crate) fn load_name(args: &TrainArgs) -> String {
    args.data.as_ref().map_or_else(|| "synthetic".into(), |d| d.display().to_string())
}

/// Warns when epochs ended but none had a finite dev score (an empty or constant dev split):
/// no best epoch was chosen, so the test score is the last epoch's (as `arbor eval` of `last/`).
pub(crate) fn warn_without_dev(summary: &Summary) {
    if !summary.dev_curve.is_empty() && summary.dev_curve.iter().all(|d| !d.is_finite()) {
        eprintln!("arbor: warning: no epoch had a finite dev score, so none was kept as best; test is scored at the last epoch");
    }
}

/// The summary's numbers of a finished run: dev and test at the best epoch, or of what a run
/// stopped before any epoch's end trained.
pub(crate) fn outcome(summary: &Summary, steps: u64, best_dev: f64, test_acc: f64) -> Value {
    warn_without_dev(summary);
    let (best_dev, test_acc) = match &summary.unfinished {
        Some((dev, test)) if best_dev == f64::NEG_INFINITY => (*dev, test.first().map_or(f64::NAN, |t| t.1)),
        _ => (best_dev, test_acc),
    };
    json!({
        "steps": steps,
        "train_seconds": (summary.train_seconds * 1000.0).round() / 1000.0,
        "sent_per_s": (summary.sentences as f64 / summary.train_seconds.max(1e-9)).round(),
        "dev_acc": best_dev,
        "test_acc": test_acc,
    })
}

/// The settings of a run of `epochs` epochs from the flags, recording `meta` in its checkpoints.
pub(crate) fn settings(args: &TrainArgs, epochs: usize, meta: Value) -> Settings {
    let mut plan = Settings {
        clip: (args.clip > 0.0).then_some(args.clip),
        checkpoint: checkpoint_dir(args),
        checkpoint_every: args.checkpoint_every,
        max_steps: args.max_steps,
        persist_pause: Duration::from_millis(args.persist_pause_ms),
        meta,
        ..Settings::new(epochs, args.batch)
    };
    if let Some(patience) = args.patience {
        plan = plan.patience(patience);
    }
    if let Some(decay) = args.lr_decay {
        plan = plan.lr_decay(decay);
    }
    plan
}

/// Where `--resume DIR` resumes from and the run folder it belongs to: `DIR/last` in the run
/// folder `DIR`, or `DIR` itself, a checkpoint whose run folder is its parent when it is a
/// `last/` (none otherwise: a checkpoint copied out of its run).
fn resume_source(dir: &Path) -> (PathBuf, Option<PathBuf>) {
    if dir.join("last").is_dir() {
        return (dir.join("last"), Some(dir.to_path_buf()));
    }
    let parent = dir.parent().filter(|_| dir.file_name().is_some_and(|n| n == "last")).map(|p| {
        if p.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            p.to_path_buf()
        }
    });
    (dir.to_path_buf(), parent)
}

/// The folder a run writes its checkpoints to: `--checkpoint`, or else the run folder that
/// `--resume` continues (so a resumed run keeps saving where it was saving).
pub(crate) fn checkpoint_dir(args: &TrainArgs) -> Option<PathBuf> {
    args.checkpoint.clone().or_else(|| args.resume.as_deref().and_then(|dir| resume_source(dir).1))
}

/// Whether `a` and `b` name the same folder (compared as canonical paths where they exist).
fn same_folder(a: &Path, b: &Path) -> bool {
    let canonical = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    canonical(a) == canonical(b)
}

/// This process's rank in an MPI job as the launcher tells it (0 outside one); only rank 0
/// writes checkpoints, so only rank 0 claims the folder.
fn launcher_rank() -> usize {
    ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// What every run does before its first step: claims its checkpoint folder
/// ([`checkpoint_dir`]; locked for the run's whole life, refused when another run writes there
/// or its checkpoints belong to another run and neither `--resume` of them nor `--overwrite`
/// says what to do), and resumes from `--resume` (its `last/`), refusing a checkpoint that has
/// nothing left to train. The returned claim must be kept until the run ends.
pub(crate) fn prepare_run<L: Learned>(
    run: &mut Run<L>,
    args: &TrainArgs,
    plan: &Settings,
) -> Result<Option<RunFolder>> {
    let resume = args.resume.as_deref().map(resume_source);
    if args.overwrite && args.checkpoint.is_none() {
        return Err(Error::input("--overwrite", "a --checkpoint DIR whose checkpoints to replace", "no --checkpoint"));
    }
    let resumes_here = |dir: &Path| resume.as_ref().and_then(|r| r.1.as_deref()).is_some_and(|r| same_folder(r, dir));
    if let Some(dir) = plan.checkpoint.as_deref().filter(|d| args.overwrite && resumes_here(d)) {
        return Err(Error::input(
            "--overwrite",
            "a --checkpoint folder other than the one --resume continues",
            format!("both {}", dir.display()),
        ));
    }
    // Everything that may refuse the resume comes before the folder is claimed, so a refused run
    // changes nothing on disk.
    let mut resumed = None;
    if let Some((from, run_folder)) = &resume {
        if !from.join("meta.json").exists() {
            return Err(Error::input(
                format!("--resume {}", args.resume.as_deref().unwrap_or(from).display()),
                "a folder holding a complete checkpoint (a run's folder or its `last/`)",
                "none there (a run stopped before its first checkpoint was written has nothing to resume)",
            ));
        }
        if let Some(best) = run_folder.as_ref().map(|f| f.join("best")).filter(|b| b.exists()) {
            // The best epoch so far must load too: a resumed run would keep a corrupted one.
            Checkpoint::load(&best)?;
        }
        let ck = Checkpoint::load(from)?;
        run.resume(&ck, &plan.meta)?;
        let stopped = |hook: &arbor::trainer::EpochHook| run.last_epoch.is_some_and(|e| hook(&e) == Next::Stop);
        let done = run.pos.epoch > plan.epochs
            || plan.max_steps.is_some_and(|m| run.pos.steps >= m)
            || (run.pos.step_in_epoch == 0 && plan.on_epoch.as_ref().is_some_and(stopped));
        if done {
            return Err(Error::input(
                format!("--resume {}", from.display()),
                "a checkpoint with training left to do (raise --epochs, --max-steps or --patience)",
                format!("one at epoch {}, step {} (--epochs {})", run.pos.epoch, run.pos.steps, plan.epochs),
            ));
        }
        if run_folder.is_none() && args.checkpoint.is_none() {
            return Err(Error::input(
                format!("--resume {}", from.display()),
                "a --checkpoint DIR to keep writing to (the checkpoint is not the `last/` of a run folder)",
                "no --checkpoint",
            ));
        }
        resumed = Some(ck.meta["tensors_file"].clone());
    }
    let folder = match &plan.checkpoint {
        Some(dir) if args.distributed.is_none() || launcher_rank() == 0 => {
            let existing = match (args.overwrite, resumes_here(dir)) {
                (true, _) => Existing::Overwrite,
                (false, true) => Existing::Resume,
                (false, false) => Existing::Refuse,
            };
            Some(RunFolder::claim(dir, existing)?)
        }
        _ => None,
    };
    if let (Some((from, _)), Some(file)) = (&resume, resumed) {
        // A run that held the folder until this one claimed it may have saved once more.
        let now = Checkpoint::tensors_path(from)?;
        if now.file_name().and_then(|n| n.to_str()) != file.as_str() {
            return Err(Error::input(
                format!("--resume {}", from.display()),
                "a checkpoint that stays as it was while this run starts",
                "one that another run replaced meanwhile (start this run again)",
            ));
        }
        eprintln!("arbor: resuming from {} at epoch {}, step {}", from.display(), run.pos.epoch, run.pos.steps);
    }
    Ok(folder)
}

/// Trains one model data-parallel (one worker, threads, or MPI ranks) on `--device`; returns the
/// summary's fields on the worker that reports them.
pub(crate) fn train_data_parallel(setup: Setup<'_>, events: &mut dyn FnMut(Event)) -> Result<Option<Value>> {
    struct Work<'a, 'e>(Setup<'a>, &'e mut dyn FnMut(Event));
    impl OnDevice for Work<'_, '_> {
        type Out = Option<Value>;
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<Option<Value>> {
            train_data_parallel_on(backend, self.0, self.1)
        }
    }
    on_device(setup.args.device, PrecisionArg::F32, Work(setup, events))
}

/// [`train_data_parallel`] with the vertex functions on `backend` (and each worker's replica of
/// it): the classifier of `--layers` layers.
fn train_data_parallel_on<B: Backend<Buffer: Send, Index: Send> + Send>(
    backend: B,
    mut setup: Setup<'_>,
    events: &mut dyn FnMut(Event),
) -> Result<Option<Value>> {
    let model = setup.stacked_model(&backend, setup.args.workers)?;
    let [train, dev, test] = setup.labelled();
    fit_data_parallel(model, &setup, Splits { train: &train, dev: &dev, test: &test }, events)
}

/// Trains `model` data-parallel (`--workers` threads or the ranks of an MPI job) on `data`, with
/// checkpoints and `--resume`; returns the summary's fields on the reporting worker.
fn fit_data_parallel<L, E>(
    model: L,
    setup: &Setup<'_>,
    data: Splits<'_, E>,
    events: &mut dyn FnMut(Event),
) -> Result<Option<Value>>
where
    L: Learner<E> + Learned,
    E: Sync,
    Run<L>: Send,
{
    let args = setup.args;
    let Sizes { epochs, hidden, embed, lr } = setup.sizes;
    let mut run = new_run(model, args, lr, &setup.rng)?;
    let d = &setup.data;
    let mut plan = settings(
        args,
        epochs,
        json!({
            "model": setup.kind.name(), "embed": embed, "hidden": hidden, "classes": d.classes,
            "data": d.name, "seed": args.seed, "lowercase": args.lowercase, "vocab": d.vocab.words(),
            "batch": args.batch, "loss": args.loss().name(), "optimizer": format!("{:?}", optimizer(args, lr)),
            "clip": args.clip, "embeddings": args.embeddings.as_ref().map(|f| f.display().to_string()),
        }),
    );
    record_optional_flags(args, &mut plan.meta);
    let _folder = prepare_run(&mut run, args, &plan)?;
    let layers = if args.layers > 1 { format!("{}, ", plural(args.layers, "layer")) } else { String::new() };
    let (summary, lead, workers) = match args.distributed {
        None => {
            setup.announce(&format!("{layers}{}", plural(args.workers, "worker")));
            let summary = fit_threads(&mut run, args.workers, setup.timeout, data, &plan, events)?;
            (summary, true, args.workers)
        }
        Some(Distributed::Mpi) => on_mpi(setup.timeout, |coll| {
            let (rank, size) = (coll.rank(), coll.size());
            if rank == 0 {
                setup.announce(&format!("{layers}{}", plural(size, "MPI rank")));
            }
            let mut quiet = |_: Event| {};
            let events: &mut dyn FnMut(Event) = if rank == 0 { events } else { &mut quiet };
            Ok((run.fit(data, &plan, coll, events)?, rank == 0, size))
        })?,
    };
    let mut report = outcome(&summary, run.pos.steps, run.best_dev, run.test_acc);
    report["workers"] = json!(workers);
    if args.layers > 1 {
        report["layers"] = json!(args.layers);
    }
    Ok(lead.then_some(report))
}

/// Trains a stacked model of --layers layers, cut into --stages pipeline stages (threads, or the
/// ranks of an MPI job) on `--device`; returns the summary's fields on the last stage.
pub(crate) fn train_pipeline(setup: Setup<'_>, events: &mut dyn FnMut(Event)) -> Result<Option<Value>> {
    let args = setup.args;
    let unsupported = [
        ("--checkpoint", args.checkpoint.is_some()),
        ("--resume", args.resume.is_some()),
        ("--checkpoint-every", args.checkpoint_every.is_some()),
        ("--workers above 1", args.workers > 1),
        ("--patience", args.patience.is_some()),
        ("--lr-decay", args.lr_decay.is_some()),
        ("--freeze", !args.freeze.is_empty()),
    ];
    if let Some((flag, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(Error::input(
            "a pipelined (--stages above 1) run",
            "no checkpoints, data-parallel workers or epoch hooks (not supported with pipelines yet; one stage of --layers has them)",
            *flag,
        ));
    }
    struct Work<'a, 'e>(Setup<'a>, &'e mut dyn FnMut(Event));
    impl OnDevice for Work<'_, '_> {
        type Out = Option<Value>;
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<Option<Value>> {
            train_pipeline_on(backend, self.0, self.1)
        }
    }
    on_device(args.device, PrecisionArg::F32, Work(setup, events))
}

/// [`train_pipeline`] with every stage's engines on replicas of `backend`.
fn train_pipeline_on<B: Backend>(
    backend: B,
    mut setup: Setup<'_>,
    events: &mut dyn FnMut(Event),
) -> Result<Option<Value>>
where
    Stage<B>: Send,
{
    let args = setup.args;
    let Sizes { epochs, lr, .. } = setup.sizes;
    let model = setup.stacked_model(&backend, 1)?;
    let plan = PipeSettings {
        kind: args.schedule().kind(),
        micro_batches: args.micro_batches(),
        epochs,
        batch: args.batch,
        clip: (args.clip > 0.0).then_some(args.clip),
        max_steps: args.max_steps,
    };
    plan.check(args.stages)?;
    let stages: Vec<Stage<B>> = Part::split(&model, args.stages)?
        .into_iter()
        .map(|part| Ok(Stage::on(backend.replica()?, part, new_optimizer(args, lr), setup.rng.clone())))
        .collect::<Result<_>>()?;
    let [train, dev, test] = setup.labelled();
    let splits = Splits { train: &train, dev: &dev, test: &test };
    let how = |on: &str| {
        format!(
            "{} in {} on {on}, {} schedule, {}",
            plural(args.layers, "layer"),
            plural(args.stages, "stage"),
            args.schedule().name(),
            plural(args.micro_batches(), "micro-batch")
        )
    };
    let finish = |stage: &Stage<B>, summary: &Summary| {
        let mut report = outcome(summary, stage.version as u64, stage.best_dev, stage.test_score());
        report["layers"] = json!(args.layers);
        report["stages"] = json!(args.stages);
        report["schedule"] = json!(args.schedule().name());
        report["micro_batches"] = json!(args.micro_batches());
        report
    };
    match args.distributed {
        None => {
            setup.announce(&how("threads"));
            let last = stages.len() - 1;
            let results = on_threads(stages, setup.timeout, last, events, |mut stage, coll, report| {
                let summary = stage.fit(splits, &plan, coll, report)?;
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
            let summary = stage.fit(splits, &plan, coll, events)?;
            Ok(last.then(|| finish(&stage, &summary)))
        }),
    }
}

/// Runs `work` as this process's rank of an MPI job (`mpirun -np N arbor ...`), with the
/// machine's cores shared among its ranks. On an error the message is printed and the whole job
/// is aborted: finalizing MPI would wait for peers that may be dead or hung.
#[cfg(feature = "mpi")]
pub(crate) fn on_mpi<T>(timeout: Duration, work: impl FnOnce(&mut dyn Collective) -> Result<T>) -> Result<T> {
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
pub(crate) fn on_mpi<T>(_: Duration, _: impl FnOnce(&mut dyn Collective) -> Result<T>) -> Result<T> {
    Err(Error::input(
        "--distributed mpi",
        "an arbor built with MPI support (cargo build --release --features mpi)",
        "a build without it",
    ))
}
