//! `arbor eval`: a checkpoint's test scores, again.

use crate::args::EvalArgs;
use crate::args::PrecisionArg;
use crate::meta_usize;
use crate::{on_device, OnDevice};
use arbor::average::Average;
use arbor::checkpoint::Checkpoint;
use arbor::data::labelled::Labelled;
use arbor::data::{sst, synthetic, TreeExample, Vocab};
use arbor::layers::LossOn;
use arbor::model;
use arbor::nn::CellKind;
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::zoo::GraphCell;
use arbor::{Backend, Error, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// The checkpoint `arbor eval` and `arbor predict` score in `folder`: its `best/` wherever it
/// exists, readable or not (an unreadable one is an error, not a reason to score other
/// weights); else its `last/`; else the folder itself. With `--average`, training scores the
/// averaged weights, and so does this checkpoint.
pub(crate) fn scored_checkpoint(folder: &Path, verb: &str) -> Result<(PathBuf, Checkpoint)> {
    let dir = Checkpoint::scored_dir(folder);
    if dir.ends_with("last") && !folder.ends_with("last") {
        eprintln!("arbor: {} has no best/ (no epoch ended with a finite dev score); {verb} last/", folder.display());
    }
    let ck = Average::scored_weights(&Checkpoint::load(&dir)?);
    Ok((dir, ck))
}

/// Reloads a checkpoint ([`scored_checkpoint`]) and prints its test scores.
pub(crate) fn eval(args: &EvalArgs) -> Result<()> {
    if arbor::trainer::fold_dir(&args.checkpoint, 0).is_dir() {
        return crate::graphs::eval(args);
    }
    let (dir, ck) = scored_checkpoint(&args.checkpoint, "evaluating")?;
    if GraphCell::from_name(ck.meta["model"].as_str().unwrap_or_default()).is_some() {
        return crate::graphs::eval(args);
    }
    if ck.meta["model"] == "sick" {
        return crate::sick::eval(args, &dir, &ck);
    }
    let meta = &ck.meta;
    let kind = CellKind::from_name(meta["model"].as_str().unwrap_or_default())?;
    let (words, lowercase) = vocabulary(meta);
    let trained_on = meta["data"].as_str().unwrap_or("synthetic");
    let data_dir = args.data.clone().or_else(|| (trained_on != "synthetic").then(|| PathBuf::from(trained_on)));
    let (classes, data_classes) =
        (meta_usize(meta, "classes")?, if data_dir.is_some() { sst::CLASSES } else { synthetic::CLASSES });
    if classes != data_classes {
        return Err(Error::input(
            format!("checkpoint {}", dir.display()),
            format!("data of the checkpoint's {classes} classes (it was trained on {trained_on})"),
            format!(
                "{} with {data_classes} classes",
                data_dir.as_ref().map_or("the synthetic treebank".into(), |d| d.display().to_string())
            ),
        ));
    }
    if let Some(dir) = data_dir.as_ref().filter(|d| !d.join("test.txt").is_file()) {
        return Err(Error::input(
            format!("checkpoint {} (model {})", args.checkpoint.display(), kind.name()),
            "an SST-style folder with test.txt",
            format!("{}, which has none", dir.display()),
        ));
    }
    let test = match &data_dir {
        None => synthetic::generate(500, 12, meta_usize(meta, "seed")? as u64 + 2_000_003),
        Some(dir) => {
            let mut vocab = Vocab::from_words(&words, lowercase);
            sst::read(&dir.join("test.txt"), &mut vocab, false)?
        }
    };
    let test: Vec<TreeExample> = if kind.chains() { test.iter().map(TreeExample::to_chain).collect() } else { test };
    struct Work<'a>(CellKind, &'a Checkpoint, usize, &'a [TreeExample]);
    impl OnDevice for Work<'_> {
        type Out = f64;
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<f64> {
            Restored::from(backend, self.0, self.1, self.2)?.accuracy(self.3)
        }
    }
    let acc = on_device(args.device, PrecisionArg::F32, Work(kind, &ck, words.len(), &test))?;
    let mut report =
        json!({"model": kind.name(), "checkpoint": dir.display().to_string(), "test_acc": acc, "trees": test.len()});
    if let Some(layers) = meta["layers"].as_u64() {
        report["layers"] = json!(layers);
    }
    println!("{report}");
    Ok(())
}

/// The vocabulary a checkpoint recorded (its words in id order) and whether it folds case.
pub(crate) fn vocabulary(meta: &Value) -> (Vec<String>, bool) {
    let words = meta["vocab"]
        .as_array()
        .map(|a| a.iter().filter_map(|w| w.as_str().map(String::from)).collect())
        .unwrap_or_default();
    (words, meta["lowercase"].as_bool().unwrap_or(false))
}

/// A tree or sequence classifier restored from a checkpoint: built from its `model_spec`, or
/// for a checkpoint written before models described themselves, from its `model`, sizes and
/// `layers`.
pub(crate) struct Restored<B: Backend> {
    model: model::Model<B>,
    classes: usize,
}

impl<B: Backend> Restored<B> {
    /// The classifier of `kind` cells over `vocab` words in `ck`, on `backend`.
    pub(crate) fn from(backend: B, kind: CellKind, ck: &Checkpoint, vocab: usize) -> Result<Restored<B>> {
        let meta = &ck.meta;
        let classes = meta_usize(meta, "classes")?;
        if !meta["model_spec"].is_null() {
            return Ok(Restored { model: model::Model::from_checkpoint(ck, &backend)?, classes });
        }
        let (embed, hidden) = (meta_usize(meta, "embed")?, meta_usize(meta, "hidden")?);
        let layers = meta["layers"].as_u64().map_or(1, |l| l as usize);
        let mut rng = Rng::new(0);
        let cells =
            (0..layers).map(|k| kind.cell(if k == 0 { embed } else { hidden }, hidden)).collect::<Result<_>>()?;
        let mut model = arbor::zoo::tree_classifier_on(&backend, cells, vocab, classes, Readout::Root, &mut rng)?;
        model.restore(ck)?;
        Ok(Restored { model, classes })
    }

    /// `trees` as the model reads them: every vertex, or the roots.
    fn examples<'t>(&self, trees: &'t [TreeExample]) -> Vec<Labelled<'t>> {
        let on = if self.model.readout() == Readout::Vertices { LossOn::All } else { LossOn::Root };
        Labelled::all(trees, on, self.classes)
    }

    /// Root accuracy on `test`.
    pub(crate) fn accuracy(&mut self, test: &[TreeExample]) -> Result<f64> {
        let scores = self.model.score(&self.examples(test))?;
        Ok(scores.first().map_or(f64::NAN, |s| s.1))
    }

    /// The class scores (logits) at each tree's root; the trees' labels are not read.
    pub(crate) fn root_logits(&mut self, trees: &[TreeExample]) -> Result<Vec<Vec<f32>>> {
        let logits = self.model.infer_all(&self.examples(trees))?;
        let rows: Vec<&[f32]> = logits.get("logits")?.chunks(self.classes.max(1)).collect();
        if rows.len() == trees.len() {
            return Ok(rows.iter().map(|r| r.to_vec()).collect());
        }
        // One row per vertex, tree after tree; the root is each tree's last vertex.
        let mut end = 0;
        trees
            .iter()
            .map(|t| {
                end += t.graph.len();
                rows.get(end - 1).map(|r| r.to_vec()).ok_or_else(|| {
                    Error::input("head outputs `logits`", "a row per vertex", format!("{} rows", rows.len()))
                })
            })
            .collect()
    }
}
