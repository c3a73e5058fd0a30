//! `arbor train --model ggnn`: graph classification by cross-validation.

use crate::args::PrecisionArg;
use crate::args::{EvalArgs, TrainArgs};
use crate::eval::scored_checkpoint;
use crate::meta_usize;
use crate::train::{optimizer, Sizes};
use crate::{on_device, OnDevice};
use arbor::data::tu;
use arbor::data::tu::Unrolled;
use arbor::ensemble::score_pooled;
use arbor::model::Model;
use arbor::run_folder::{Existing, RunFolder};
use arbor::trainer::{fold_dir, fold_indices, member_dir, CvResult};
use arbor::zoo::{cross_validate_graphs, GraphTraining};
use arbor::Backend;
use arbor::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The name of the TU data set in `dir` (the prefix of its `NAME_A.txt`).
fn tu_name(dir: &Path) -> Result<String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| Error::Io { path: dir.display().to_string(), msg: e.to_string() })?;
    let mut names: Vec<String> =
        entries.filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix("_A.txt").map(String::from)).collect();
    names.sort();
    let io = |msg: String| Error::Io { path: dir.display().to_string(), msg };
    match &names[..] {
        [name] => Ok(name.clone()),
        [] => Err(io("no NAME_A.txt here: not a TU data set".into())),
        _ => Err(io(format!("more than one TU data set here ({}): keep one per folder", names.join(", ")))),
    }
}

/// TU data set `name` from `dir`, its nodes also labelled by the cycles of up to `cycles` nodes
/// through them where given (`--cycles`).
fn read_labelled(dir: &Path, name: &str, cycles: Option<usize>) -> Result<tu::TuDataset> {
    let mut data = tu::read(dir, name)?;
    if let Some(n) = cycles {
        if n < 3 {
            return Err(Error::input("--cycles", "a cycle length of at least 3", n.to_string()));
        }
        data.label_cycles(n)?;
    }
    Ok(data)
}

/// `arbor train --model ggnn|gin|gat`: cross-validation over the graphs of a TU data set.
pub(crate) fn train(args: &TrainArgs, sizes: &Sizes) -> Result<()> {
    let epochs = sizes.epochs;
    let cell = args.model.graph_cell().unwrap_or_default();
    let model_flag = format!("--model {}", cell.name());
    let tree_only = [
        ("--resume", args.resume.is_some()),
        ("--plot", args.plot.is_some()),
        ("--embeddings", args.embeddings.is_some()),
    ];
    if let Some((flag, _)) = tree_only.iter().find(|(_, set)| *set) {
        return Err(Error::input(
            model_flag,
            "the cross-validation flags (--folds, --steps, sizes, optimizer)",
            format!("{flag}, which applies to tree and sequence models only"),
        ));
    }
    if args.ensemble == Some(0) {
        return Err(Error::input("--ensemble", "at least 1 model per fold", "0"));
    }
    let dir = args.data.as_deref().ok_or_else(|| {
        Error::input(&model_flag, "--data DIR with a TU data set (e.g. ../shared/data/mutag)", "no --data")
    })?;
    let name = tu_name(dir)?;
    let data = read_labelled(dir, &name, args.cycles)?;
    if data.classes < 2 {
        return Err(Error::input(
            format!("--data {} (TU set {name})", dir.display()),
            "graphs of at least two classes to tell apart",
            format!("all {} graphs in one class ({name}_graph_labels.txt)", data.graphs.len()),
        ));
    }
    eprintln!(
        "arbor: {}-fold cross-validation of {} on {name} ({} graphs, {} node labels, {} classes)",
        args.folds(),
        cell.name(),
        data.graphs.len(),
        data.node_label_count,
        data.classes
    );
    let cfg = GraphTraining {
        steps: args.steps(),
        features: sizes.embed,
        hidden: sizes.hidden,
        readout: args.readout(cell),
        every_step: args.every_step,
        per_step: args.per_step,
        dropout: args.dropout,
        epochs,
        batch: args.batch(),
        folds: args.folds(),
        ensemble: args.ensemble.unwrap_or(1),
        seed: args.seed,
        optimizer: optimizer(args, sizes.lr),
        clip: (args.clip > 0.0).then_some(args.clip),
        lr_decay: args.lr_decay,
        average: args.average,
        checkpoint: args.checkpoint.clone(),
        // Where the graphs are, so that `arbor eval` scores each fold's held-out graphs again.
        meta: json!({"data": dir.display().to_string(), "name": name, "cycles": args.cycles}),
        ..GraphTraining::new(cell)
    };
    // The folder is this run's for its whole life (refused if another run's checkpoints are
    // there, unless --overwrite).
    let existing = if args.overwrite { Existing::Overwrite } else { Existing::Refuse };
    let _folder = args.checkpoint.as_deref().map(|dir| RunFolder::claim(dir, existing)).transpose()?;
    let pb = ProgressBar::new((args.folds() * epochs * cfg.ensemble) as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} epochs, eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let start = Instant::now();
    let mut progress = |fold: usize, _| {
        pb.set_message(format!("fold {}/{}", fold + 1, args.folds()));
        pb.inc(1);
    };
    struct Work<'a>(&'a tu::TuDataset, &'a GraphTraining, &'a mut dyn FnMut(usize, usize));
    impl OnDevice for Work<'_> {
        type Out = CvResult;
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<CvResult> {
            cross_validate_graphs(&backend, self.0, self.1, self.2)
        }
    }
    let result = on_device(args.device, PrecisionArg::F32, Work(&data, &cfg, &mut progress))?;
    pb.finish_and_clear();
    for (k, a) in result.fold_scores.iter().enumerate() {
        eprintln!("fold {}: held-out accuracy {a:.4}", k + 1);
    }
    // The epoch chosen on the held-out folds (as published GIN tables choose it): reported
    // beside the last epoch's mean, never instead of it.
    let (best_epoch, best_mean) = result.best_epoch().map(|(e, m)| (e + 1, m)).unzip();
    println!(
        "{}",
        json!({
            "model": cell.name(), "data": dir.display().to_string(), "folds": result.fold_scores.len(), "epochs": epochs,
            "steps": args.steps(), "hidden": sizes.hidden, "embed": sizes.embed, "readout": cfg.readout.name(), "every_step": cfg.every_step,
            "per_step": cfg.per_step, "lr_decay": cfg.lr_decay, "cycles": args.cycles,
            "train_seconds": (start.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
            "graphs_per_s": result.examples_per_s.round(), "ensemble": cfg.ensemble,
            "cv_acc_mean": result.mean, "cv_acc_std": result.std, "cv_acc_member_mean": result.member_mean,
            "cv_best_epoch": best_epoch, "cv_acc_best_epoch": best_mean,
        })
    );
    Ok(())
}

/// The folders `dir_of(0)`, `dir_of(1)`, … up to the first that is not `saved`.
fn numbered(dir_of: impl Fn(usize) -> PathBuf, saved: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
    (0..).map(dir_of).take_while(|d| saved(d)).collect()
}

/// `arbor eval` of `arbor train --model ggnn|gin|gat --checkpoint DIR`: each fold's model (`DIR/fold-k`,
/// or one fold's folder; an ensemble's members together, `fold-k/member-m`) scored on the graphs
/// it held out, read from where training read them (or `--data`); their mean is the training's
/// `cv_acc_mean`.
pub(crate) fn eval(args: &EvalArgs) -> Result<()> {
    let last = |d: &Path| d.join("last").is_dir();
    let folds = numbered(|k| fold_dir(&args.checkpoint, k), |d| last(d) || last(&member_dir(d, 0)));
    let folds = if folds.is_empty() { vec![args.checkpoint.clone()] } else { folds };
    let mut fold_scores = Vec::with_capacity(folds.len());
    let mut read: Option<(PathBuf, Vec<Unrolled>)> = None;
    let mut model = String::new();
    for dir in &folds {
        // An ensemble's fold keeps each member's checkpoints in a folder of its own.
        let members = numbered(|m| member_dir(dir, m), last);
        let members = if members.is_empty() { vec![dir.clone()] } else { members };
        let cks = members.iter().map(|d| Ok(scored_checkpoint(d, "evaluating")?.1)).collect::<Result<Vec<_>>>()?;
        let meta = &cks[0].meta;
        model = meta["model"].as_str().unwrap_or("ggnn").to_string();
        let recorded = meta["data"].as_str().map(PathBuf::from);
        let data_dir = args.data.clone().or(recorded).ok_or_else(|| {
            Error::input(format!("checkpoint {}", dir.display()), "the data folder it records", "none (give --data)")
        })?;
        let (k, count, seed, steps) = (
            meta_usize(meta, "fold")?,
            meta_usize(meta, "folds")?,
            meta["fold_seed"].as_u64(),
            meta_usize(meta, "message_steps")?,
        );
        let seed = seed.ok_or_else(|| Error::input("checkpoint metadata", "a number `fold_seed`", "none"))?;
        if read.as_ref().is_none_or(|(d, _)| *d != data_dir) {
            let name = meta["name"].as_str().map_or_else(|| tu_name(&data_dir), |n| Ok(n.to_string()))?;
            let every_step = meta["every_step"].as_bool().unwrap_or(false);
            let cycles = meta["cycles"].as_u64().map(|n| n as usize);
            read =
                Some((data_dir.clone(), Unrolled::all(&read_labelled(&data_dir, &name, cycles)?, steps, every_step)?));
        }
        let graphs = read.as_ref().map(|(_, g)| g.as_slice()).unwrap_or_default();
        // Folds dealt by class (stratified), or, in checkpoints from before, by order alone.
        let stratified = meta["stratified"].as_bool().unwrap_or(false);
        let strata: Vec<u32> = graphs.iter().map(|g| if stratified { g.class() } else { 0 }).collect();
        let held = fold_indices(&strata, count, seed)?;
        let test: Vec<Unrolled> = held.get(k).into_iter().flatten().map(|&i| graphs[i].clone()).collect();
        struct Work<'a>(&'a [arbor::checkpoint::Checkpoint], &'a [Unrolled]);
        impl OnDevice for Work<'_> {
            type Out = f64;
            fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<f64> {
                let infer = |ck| Model::from_checkpoint(ck, &backend)?.infer_all(self.1);
                let outputs = self.0.iter().map(infer).collect::<Result<Vec<_>>>()?;
                Ok(score_pooled(&outputs, self.1)?.first().map_or(f64::NAN, |s| s.1))
            }
        }
        fold_scores.push(on_device(args.device, PrecisionArg::F32, Work(&cks, &test))?);
    }
    let n = fold_scores.len() as f64;
    let mean = fold_scores.iter().sum::<f64>() / n;
    let std = (fold_scores.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n).sqrt();
    println!(
        "{}",
        json!({
            "checkpoint": args.checkpoint.display().to_string(), "model": model, "folds": fold_scores.len(),
            "fold_scores": fold_scores, "cv_acc_mean": mean, "cv_acc_std": std,
        })
    );
    Ok(())
}
