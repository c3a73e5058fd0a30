//! `arbor train --model ggnn`: graph classification by cross-validation.

use crate::args::PrecisionArg;
use crate::args::TrainArgs;
use crate::train::{optimizer, Sizes};
use crate::{on_device, OnDevice};
use arbor::data::tu;
use arbor::trainer::CvResult;
use arbor::zoo::{cross_validate_ggnn, GraphTraining};
use arbor::Backend;
use arbor::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::path::Path;
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

/// `arbor train --model ggnn`: cross-validation over the graphs of a TU data set.
pub(crate) fn train(args: &TrainArgs, sizes: &Sizes) -> Result<()> {
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
    if data.classes < 2 {
        return Err(Error::input(
            format!("--data {} (TU set {name})", dir.display()),
            "graphs of at least two classes to tell apart",
            format!("all {} graphs in one class ({name}_graph_labels.txt)", data.graphs.len()),
        ));
    }
    eprintln!(
        "arbor: {}-fold cross-validation of ggnn on {name} ({} graphs, {} node labels, {} classes)",
        args.folds(),
        data.graphs.len(),
        data.node_label_count,
        data.classes
    );
    let cfg = GraphTraining {
        steps: args.steps(),
        features: sizes.embed,
        hidden: sizes.hidden,
        epochs,
        batch: args.batch,
        folds: args.folds(),
        seed: args.seed,
        optimizer: optimizer(args, sizes.lr),
        clip: (args.clip > 0.0).then_some(args.clip),
    };
    let pb = ProgressBar::new((args.folds() * epochs) as u64);
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
            cross_validate_ggnn(&backend, self.0, self.1, self.2)
        }
    }
    let result = on_device(args.device, PrecisionArg::F32, Work(&data, &cfg, &mut progress))?;
    pb.finish_and_clear();
    for (k, a) in result.fold_scores.iter().enumerate() {
        eprintln!("fold {}: held-out accuracy {a:.4}", k + 1);
    }
    println!(
        "{}",
        json!({
            "model": "ggnn", "data": dir.display().to_string(), "folds": result.fold_scores.len(), "epochs": epochs,
            "steps": args.steps(), "hidden": sizes.hidden, "embed": sizes.embed,
            "train_seconds": (start.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
            "graphs_per_s": result.examples_per_s.round(), "cv_acc_mean": result.mean, "cv_acc_std": result.std,
        })
    );
    Ok(())
}
