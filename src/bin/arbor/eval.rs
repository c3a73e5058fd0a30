//! `arbor eval`: a checkpoint's test scores, again.

use crate::args::{Device, EvalArgs};
use crate::meta_usize;
use arbor::average::Average;
use arbor::checkpoint::Checkpoint;
use arbor::data::labelled::Labelled;
use arbor::data::{sst, synthetic, TreeExample, Vocab, PAD};
use arbor::layers::{Embedding, LossOn};
use arbor::model;
use arbor::nn::Model;
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::{Backend, CpuBackend, Error, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// The checkpoint `arbor eval` and `arbor predict` score in `folder`: its `best/` wherever it
/// exists, readable or not (an unreadable one is an error, not a reason to score other
/// weights); else its `last/`; else the folder itself. With `--average`, training scores the
/// averaged weights, and so does this checkpoint.
pub(crate) fn scored_checkpoint(folder: &Path, verb: &str) -> Result<(PathBuf, Checkpoint)> {
    let (best, last) = (folder.join("best"), folder.join("last"));
    let dir = if best.symlink_metadata().is_ok() {
        best
    } else if last.symlink_metadata().is_ok() {
        eprintln!("arbor: {} has no best/ (no epoch ended with a finite dev score); {verb} last/", folder.display());
        last
    } else {
        folder.to_path_buf()
    };
    let ck = Average::scored_weights(&Checkpoint::load(&dir)?);
    Ok((dir, ck))
}

/// Reloads a checkpoint ([`scored_checkpoint`]) and prints its test scores.
pub(crate) fn eval(args: &EvalArgs) -> Result<()> {
    let (dir, ck) = scored_checkpoint(&args.checkpoint, "evaluating")?;
    if ck.meta["model"] == "sick" {
        return crate::sick::eval(args, &dir, &ck);
    }
    let meta = &ck.meta;
    let kind = Model::from_name(meta["model"].as_str().unwrap_or_default())?;
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
    let acc = match args.device {
        Device::Cpu => Restored::from(CpuBackend::new(), kind, &ck, words.len())?.accuracy(&test)?,
        Device::Cuda => Restored::from(crate::cuda_backend()?, kind, &ck, words.len())?.accuracy(&test)?,
    };
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

/// A tree or sequence classifier restored from a checkpoint (as many layers as its `layers`),
/// reading the roots.
pub(crate) struct Restored<B: Backend> {
    model: model::Model<B>,
    classes: usize,
}

impl<B: Backend> Restored<B> {
    /// The classifier of `kind` cells over `vocab` words in `ck`, on `backend`.
    pub(crate) fn from(backend: B, kind: Model, ck: &Checkpoint, vocab: usize) -> Result<Restored<B>> {
        let meta = &ck.meta;
        let (embed, hidden, classes) =
            (meta_usize(meta, "embed")?, meta_usize(meta, "hidden")?, meta_usize(meta, "classes")?);
        let layers = meta["layers"].as_u64().map_or(1, |l| l as usize);
        let mut rng = Rng::new(0);
        let cells =
            (0..layers).map(|k| kind.cell(if k == 0 { embed } else { hidden }, hidden)).collect::<Result<_>>()?;
        let words = Embedding::new(vocab, embed, 0.1, &mut rng).with_padding(PAD);
        let mut model = arbor::zoo::classifier(&backend, words, cells, classes, Readout::Root, 0, &mut rng)?;
        model.restore(ck)?;
        Ok(Restored { model, classes })
    }

    /// Root accuracy on `test`.
    pub(crate) fn accuracy(&mut self, test: &[TreeExample]) -> Result<f64> {
        let scores = self.model.score(&Labelled::all(test, LossOn::Root, self.classes))?;
        Ok(scores.first().map_or(f64::NAN, |s| s.1))
    }

    /// The class scores (logits) at each tree's root; the trees' labels are not read.
    pub(crate) fn root_logits(&mut self, trees: &[TreeExample]) -> Result<Vec<Vec<f32>>> {
        let logits = self.model.infer_all(&Labelled::all(trees, LossOn::Root, self.classes))?;
        Ok(logits.get("logits")?.chunks(self.classes).map(<[f32]>::to_vec).collect())
    }
}
