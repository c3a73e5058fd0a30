//! `arbor train`: trees and sequences data-parallel or pipelined, graphs by cross-validation.

use crate::args::PrecisionArg;
use crate::args::*;
use crate::decide::{auto_batch, plan_stages};
use crate::resume::{checkpoint_dir, prepare_run};
use crate::{bar, load, Data};
use crate::{on_device, OnDevice};
use arbor::data::labelled::Labelled;
use arbor::data::{glove, PAD, UNK};
use arbor::dist::Collective;
use arbor::layers::LossOn;
use arbor::layers::{Embedding, WordDropout};
use arbor::model;
use arbor::nn::CellKind;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::pipeline::{Part, PipeSettings, Stage};
use arbor::plot::{self, Series};
use arbor::rng::Rng;
use arbor::trainer::{
    fit_threads, fit_together, AutoBatch, Event, Every, Learned, Learner, Run, Settings, Splits, Summary,
};
use arbor::{Backend, Error, Result};
use indicatif::ProgressBar;
use serde_json::{json, Value};
use std::path::Path;
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
            ModelArg::Ggnn | ModelArg::Gin | ModelArg::Gat => (100, 32, 16, 0.005),
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

/// Refuses a `--freeze` name that is not one of the model's tensors (`names`).
pub(crate) fn check_freeze(args: &TrainArgs, names: &[String]) -> Result<()> {
    match args.freeze.iter().find(|n| !names.contains(n)) {
        Some(name) => Err(Error::input(
            format!("--freeze {name}"),
            format!("the name of one of the model's tensors ({})", names.join(", ")),
            "no such tensor",
        )),
        None => Ok(()),
    }
}

/// A fresh run of `model` (the whole model, or a pipeline stage's part of it, whose `--freeze`
/// names [`check_freeze`] checked) at learning rate `lr` ([`new_optimizer`]), scoring a moving
/// average of the weights with `--average`.
pub(crate) fn new_run<L: Learned>(model: L, args: &TrainArgs, lr: f32, rng: &Rng) -> Result<Run<L>> {
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
    pub(crate) kind: CellKind,
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
        let engines = layers * replicas as u128 + if args.most_stages() > 1 { layers } else { 0 };
        arbor::memory::check(
            "--hidden, --embed, --layers, --stages and --workers",
            floats * 16 * replicas as u128
                + engines * arbor::memory::ENGINE_BYTES
                + (args.most_stages() * replicas) as u128 * arbor::memory::STAGE_BYTES,
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
    if args.workers == 0 || args.workers > args.batch() {
        let expected = format!("between 1 and the examples of a minibatch (--batch {})", args.batch());
        return bad("--workers", &expected, args.workers.to_string());
    }
    if args.checkpoint_every.is_some() && checkpoint_dir(args).is_none() {
        return bad("--checkpoint-every", "a --checkpoint DIR to write to", "no --checkpoint".into());
    }
    if !(args.checkpoint_overhead > 0.0 && args.checkpoint_overhead < 1.0) {
        let got = args.checkpoint_overhead.to_string();
        return bad("--checkpoint-overhead", "a share of the training time in (0, 1)", got);
    }
    if let Some(d) = args.average.filter(|d| !(0.0..1.0).contains(d)) {
        return bad("--average", "a decay in [0, 1)", d.to_string());
    }
    if args.stages == Stages::Auto {
        if args.workers > 1 {
            return bad(
                "--workers",
                "1 with --stages auto (the planner chooses the replicas)",
                args.workers.to_string(),
            );
        }
        if args.micro_batches.is_some() {
            return bad("--micro-batches", "none with --stages auto (the planner chooses them)", "given".into());
        }
        if args.distributed.is_some() {
            return bad(
                "--distributed",
                "none with --stages auto (it plans threads: give MPI ranks --stages N)",
                "mpi".into(),
            );
        }
        if let Some(m) = args.memory_budget.filter(|m| !(m.is_finite() && *m > 0.0)) {
            return bad("--memory-budget", "megabytes above 0", m.to_string());
        }
    } else if args.memory_budget.is_some() {
        return bad(
            "--memory-budget",
            "--stages auto (what the planner plans within)",
            format!("--stages {}", args.stages),
        );
    }
    if args.stages == Stages::Count(1) {
        let pipeline_only =
            [("--micro-batches", args.micro_batches.is_some()), ("--schedule", args.schedule.is_some())];
        if let Some((flag, _)) = pipeline_only.iter().find(|(_, set)| *set) {
            return bad(flag, "--stages above 1 (a pipeline)", "--stages 1".into());
        }
    }
    if let Some(d) = args.lr_decay {
        Settings::check_lr_decay("--lr-decay", d)?;
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
        ModelArg::Ggnn | ModelArg::Gin | ModelArg::Gat => &[
            ("--distributed", args.distributed.is_some(), "every model but ggnn, whose folds run one at a time"),
            ("--max-steps", args.max_steps.is_some(), "every model but ggnn, which trains --epochs per fold"),
            ("--lowercase", args.lowercase, "the models over words"),
            ("--loss", args.loss.is_some(), trees),
            ("--patience", args.patience.is_some(), "every model but ggnn, which trains --epochs per fold"),
            ("--freeze", !args.freeze.is_empty(), "every model but ggnn, which trains --epochs per fold"),
            ("--batch auto", args.batch_arg == Batch::Auto, trees),
        ],
        ModelArg::Sick => &[
            ("--batch auto", args.batch_arg == Batch::Auto, trees),
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
    if args.batch_arg == Batch::Auto {
        let spread = [
            ("--workers", args.workers > 1, args.workers.to_string()),
            ("--stages", args.stages != Stages::Count(1), args.stages.to_string()),
            ("--distributed", args.distributed.is_some(), "mpi".to_string()),
        ];
        if let Some((flag, _, got)) = spread.into_iter().find(|(_, set, _)| *set) {
            return bad(
                flag,
                "one worker and one stage with --batch auto (it measures the noise of one model's gradients)",
                got,
            );
        }
    }
    if let Some((flag, _, users)) = ignored.iter().find(|(_, set, _)| *set) {
        return bad(flag, &format!("a model that uses it ({users})"), format!("--model {}", args.model.name()));
    }
    if args.model.graph_cell().is_some() && args.embed_lr.is_some() {
        return bad(
            "--embed-lr",
            "a model over words (not a graph model: its node labels learn at --lr)",
            format!("--model {}", args.model.name()),
        );
    }
    if args.model.graph_cell().is_some() && (args.workers > 1 || args.most_stages() > 1 || args.layers > 1) {
        return bad(
            &format!("--model {}", args.model.name()),
            "one worker on one stage (cross-validation runs a fold at a time)",
            format!("--workers {} --layers {} --stages {}", args.workers, args.layers, args.stages),
        );
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
    if args.batch() == 0 || epochs == 0 || hidden == 0 || embed == 0 || args.layers == 0 || args.most_stages() == 0 {
        return Err(Error::input(
            "arguments",
            "--batch, --epochs, --hidden, --embed, --layers and --stages above 0",
            format!("{} {epochs} {hidden} {embed} {} {}", args.batch(), args.layers, args.stages),
        ));
    }
    check_flags(args, &sizes)?;
    // A graph model drops out its classifier's input (--dropout), nothing else.
    let graph = args.model.graph_cell().is_some();
    let mut dropouts = args.dropout_rates().into_iter().chain([("--word-dropout", args.word_dropout)]);
    if let Some((flag, _)) = dropouts.find(|&(flag, rate)| rate > 0.0 && !(graph && flag == "--dropout")) {
        if graph || args.model == ModelArg::Sick {
            return Err(Error::input(
                flag,
                "a tree or sequence model (tree-lstm, child-sum, var-lstm, tree-fc)",
                format!("--model {}", args.model.name()),
            ));
        }
    }
    let graph_flags = [
        ("--readout", args.readout.is_some()),
        ("--every-step", args.every_step),
        ("--cycles", args.cycles.is_some()),
        ("--ensemble", args.ensemble.is_some()),
    ];
    if let Some((flag, _)) = graph_flags.iter().find(|(_, set)| *set && !graph) {
        return Err(Error::input(*flag, "a graph model (ggnn, gin, gat)", format!("--model {}", args.model.name())));
    }
    if args.per_step && args.model != ModelArg::Gin {
        return Err(Error::input("--per-step", "--model gin", format!("--model {}", args.model.name())));
    }
    let timeout = Duration::try_from_secs_f64(args.timeout).map_err(|_| {
        Error::input("--timeout", "a number of seconds above 0, to about 1.8e19", args.timeout.to_string())
    })?;
    match args.model {
        ModelArg::Ggnn | ModelArg::Gin | ModelArg::Gat => return crate::graphs::train(args, &sizes),
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
    let report = train_model(setup, &mut events)?;
    progress.finish();
    if let Some(Value::Object(fields)) = report {
        let mut summary = json!({
            "model": kind.name(),
            "data": load_name(args),
            "epochs": epochs,
            "batch": args.batch_arg.to_json(),
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
    let mut v = json!({
        "steps": steps,
        "train_seconds": (summary.train_seconds * 1000.0).round() / 1000.0,
        "sent_per_s": (summary.sentences as f64 / summary.train_seconds.max(1e-9)).round(),
        "dev_acc": best_dev,
        "test_acc": test_acc,
    });
    // Snapshots between epochs' ends: the interval (chosen last, for `auto`) and their share
    // of the training time.
    if summary.checkpoint_interval.is_some() {
        v["checkpoint_every"] = json!(summary.checkpoint_interval);
        v["checkpoint_overhead"] = json!(summary.checkpoint_seconds / summary.train_seconds.max(1e-9));
    }
    if !summary.batch_trajectory.is_empty() {
        v["batch_trajectory"] = json!(summary.batch_trajectory);
    }
    v
}

/// The settings of a run of `epochs` epochs from the flags, recording `meta` in its checkpoints.
pub(crate) fn settings(args: &TrainArgs, epochs: usize, meta: Value) -> Settings {
    let mut plan = Settings {
        clip: (args.clip > 0.0).then_some(args.clip),
        checkpoint: checkpoint_dir(args),
        checkpoint_every: args.checkpoint_every.map(|e| match e {
            Every::Auto(_) => Every::Auto(args.checkpoint_overhead),
            fixed => fixed,
        }),
        max_steps: args.max_steps,
        persist_pause: Duration::from_millis(args.persist_pause_ms),
        meta,
        ..Settings::new(epochs, args.batch())
    };
    if let Some(patience) = args.patience {
        plan = plan.patience(patience);
    }
    if let Some(decay) = args.lr_decay {
        plan = plan.lr_decay(decay);
    }
    plan
}

/// Trains one model of `--layers` layers on `--device`, data-parallel (one worker, threads, or MPI
/// ranks) or cut into `--stages` pipeline stages; returns the summary's fields on the worker
/// that reports them.
pub(crate) fn train_model(setup: Setup<'_>, events: &mut dyn FnMut(Event)) -> Result<Option<Value>> {
    struct Work<'a, 'e>(Setup<'a>, &'e mut dyn FnMut(Event));
    impl OnDevice for Work<'_, '_> {
        type Out = Option<Value>;
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<Option<Value>> {
            train_model_on(backend, self.0, self.1)
        }
    }
    on_device(setup.args.device, PrecisionArg::F32, Work(setup, events))
}

/// [`train_model`] with the vertex functions on `backend` (and each worker's replica of it).
fn train_model_on<B: Backend<Buffer: Send, Index: Send> + Send>(
    backend: B,
    mut setup: Setup<'_>,
    events: &mut dyn FnMut(Event),
) -> Result<Option<Value>> {
    let args = setup.args;
    let model = setup.stacked_model(&backend, args.workers)?;
    let [train, dev, test] = setup.labelled();
    let data = Splits { train: &train, dev: &dev, test: &test };
    let kind = args.schedule().kind();
    // The stages: as many as --stages, as even as the layers allow, or as the planner cut them;
    // each replicated on --workers workers, or on as many as the planner chose.
    let (count, boundaries, pipe, replicas, chosen) = match args.stages {
        Stages::Auto => {
            let (plan, chosen) = plan_stages(&model, &train, &setup)?;
            let pipe = PipeSettings { kind, micro_batches: plan.micro_batches };
            (plan.stages.len(), Some(plan.stages), pipe, plan.replicas, Some(chosen))
        }
        Stages::Count(n) => (n, None, PipeSettings { kind, micro_batches: args.micro_batches() }, args.workers, None),
    };
    if count == 1 {
        let batch_auto = match args.batch_arg {
            Batch::Auto => Some(auto_batch(&model, &train, &setup)?),
            Batch::Count(_) => None,
        };
        let spread = Parallel { pipe: None, replicas, chosen, batch_auto };
        return fit_runs(vec![model], &setup, data, events, spread);
    }
    pipe.check(count, args.batch())?;
    let parts = match boundaries {
        Some(sizes) => Part::split_at(&model, &sizes)?,
        None => Part::split(&model, count)?,
    };
    drop(model);
    // Threads: every replica's stages, replica after replica. MPI ranks: one replica's stages,
    // each rank taking its own.
    let copies = if args.distributed.is_some() { 1 } else { replicas };
    let stage = |part: &Part| Ok(Stage::on(backend.replica()?, part.clone(), pipe).replicated(replicas));
    let stages: Vec<Stage<B>> = (0..copies).flat_map(|_| parts.iter().map(stage)).collect::<Result<_>>()?;
    fit_runs(stages, &setup, data, events, Parallel { pipe: Some(pipe), replicas, chosen, batch_auto: None })
}

/// How a run spreads over its workers: a pipeline's settings (none: one model, data-parallel),
/// the replicas of the model or of each stage, and what `--stages auto` chose (for the
/// checkpoint).
struct Parallel {
    pipe: Option<PipeSettings>,
    replicas: usize,
    chosen: Option<Value>,
    batch_auto: Option<AutoBatch>,
}

/// Trains `models` on `data` in the one loop, with checkpoints and `--resume`: one model
/// data-parallel (`--workers` threads or the ranks of an MPI job), or the stages of a pipeline
/// (a thread or an MPI rank each). Returns the summary's fields on the reporting worker.
fn fit_runs<L, E>(
    models: Vec<L>,
    setup: &Setup<'_>,
    data: Splits<'_, E>,
    events: &mut dyn FnMut(Event),
    Parallel { pipe, replicas, chosen, batch_auto }: Parallel,
) -> Result<Option<Value>>
where
    L: Learner<E> + Learned,
    E: Sync,
    Run<L>: Send,
{
    let args = setup.args;
    let Sizes { epochs, hidden, embed, lr } = setup.sizes;
    let mut names = Vec::new();
    for m in &models {
        names.extend(m.tensors_lent()?.into_iter().map(|t| t.0));
    }
    check_freeze(args, &names)?;
    let mut runs = models.into_iter().map(|m| new_run(m, args, lr, &setup.rng)).collect::<Result<Vec<_>>>()?;
    let d = &setup.data;
    let mut plan = settings(
        args,
        epochs,
        json!({
            "model": setup.kind.name(), "embed": embed, "hidden": hidden, "classes": d.classes,
            "data": d.name, "seed": args.seed, "lowercase": args.lowercase, "vocab": d.vocab.words(),
            "batch": args.batch_arg.to_json(), "loss": args.loss().name(), "optimizer": format!("{:?}", optimizer(args, lr)),
            "clip": args.clip, "embeddings": args.embeddings.as_ref().map(|f| f.display().to_string()),
        }),
    );
    record_optional_flags(args, &mut plan.meta);
    plan.batch_auto = batch_auto;
    let stages = if pipe.is_some() { runs.len() / if args.distributed.is_some() { 1 } else { replicas } } else { 1 };
    let micro_batches = pipe.map_or(1, |p| p.micro_batches);
    if stages > 1 && args.schedule() == ScheduleArg::TwoBw {
        // 2BW decides which weights each minibatch sees (one step stale): a resume keeps it. A
        // 1F1B pipeline flushes every minibatch, as one stage would (its micro-batches'
        // gradients summed), so it resumes any checkpoint of the same run, pipelined or not,
        // and its own resumes unpipelined or on other stages (elastic).
        plan.meta["stages"] = json!(stages);
        plan.meta["schedule"] = json!(args.schedule().name());
        plan.meta["micro_batches"] = json!(micro_batches);
    }
    if let Some(chosen) = chosen {
        plan.meta["stages_auto"] = chosen;
    }
    let _folder = prepare_run(&mut runs, args, &plan)?;
    let layers = if args.layers > 1 { format!("{}, ", plural(args.layers, "layer")) } else { String::new() };
    let how = |on: &str, workers: usize| match stages {
        1 => format!("{layers}{}", plural(workers, on)),
        _ => format!(
            "{layers}in {}{} on {on}s, {} schedule, {}",
            plural(stages, "stage"),
            if replicas > 1 { format!(" × {}", plural(replicas, "replica")) } else { String::new() },
            args.schedule().name(),
            plural(micro_batches, "micro-batch")
        ),
    };
    let reporter = stages - 1;
    let (summary, at, workers) = match args.distributed {
        None if stages == 1 => {
            setup.announce(&how("worker", replicas));
            (fit_threads(&mut runs[0], replicas, setup.timeout, data, &plan, events)?, Some(0), replicas)
        }
        None => {
            setup.announce(&how("thread", stages * replicas));
            let summary = fit_together(runs.iter_mut().collect(), setup.timeout, data, &plan, events)?;
            (summary, Some(reporter), stages * replicas)
        }
        Some(Distributed::Mpi) => on_mpi(setup.timeout, |coll| {
            let (rank, size) = (coll.rank(), coll.size());
            if stages > 1 && size != stages * replicas {
                return Err(Error::input(
                    "--distributed mpi with --stages",
                    format!("one MPI rank per stage and replica ({stages} × {replicas}: --stages × --workers)"),
                    plural(size, "rank"),
                ));
            }
            let (mine, reports) = if stages > 1 { (rank % stages, rank == reporter) } else { (0, rank == 0) };
            if reports {
                setup.announce(&how("MPI rank", size));
            }
            let mut quiet = |_: Event| {};
            let events: &mut dyn FnMut(Event) = if reports { events } else { &mut quiet };
            Ok((runs[mine].fit(data, &plan, coll, events)?, reports.then_some(mine), size))
        })?,
    };
    let Some(run) = at.map(|k| &runs[k]) else { return Ok(None) };
    let mut report = outcome(&summary, run.position().steps, run.best_dev(), run.test_acc());
    if args.layers > 1 {
        report["layers"] = json!(args.layers);
    }
    report["workers"] = json!(workers);
    if stages > 1 {
        report["stages"] = json!(stages);
        report["replicas"] = json!(replicas);
        report["schedule"] = json!(args.schedule().name());
        report["micro_batches"] = json!(micro_batches);
    }
    Ok(Some(report))
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
