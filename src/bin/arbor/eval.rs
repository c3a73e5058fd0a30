//! `arbor eval`: a checkpoint's test scores, again.

use crate::args::{Device, EvalArgs};
use crate::meta_usize;
use crate::train::stacked_model;
use arbor::average::Average;
use arbor::checkpoint::Checkpoint;
use arbor::data::labelled::Labelled;
use arbor::data::{sst, synthetic, TreeExample, Vocab, PAD};
use arbor::layers::{Embedding, LossOn};
use arbor::nn::Model;
use arbor::rng::Rng;
use arbor::train::Classifier;
use arbor::trainer::Learner as _;
use arbor::{Backend, CpuBackend, Error, Result};
use serde_json::json;
use std::path::PathBuf;

/// Reloads a checkpoint (its `best/`, else its `last/`) and prints its test scores.
pub(crate) fn eval(args: &EvalArgs) -> Result<()> {
    // `best/` (the best dev epoch) wherever it exists, readable or not (an unreadable one is an
    // error, not a reason to score other weights); else `last/`; else the folder itself.
    let (best, last) = (args.checkpoint.join("best"), args.checkpoint.join("last"));
    let dir = if best.symlink_metadata().is_ok() {
        best
    } else if last.symlink_metadata().is_ok() {
        eprintln!(
            "arbor: {} has no best/ (no epoch ended with a finite dev score); evaluating last/",
            args.checkpoint.display()
        );
        last
    } else {
        args.checkpoint.clone()
    };
    // With `--average`, training scores the averaged weights: so does eval.
    let ck = Average::scored_weights(&Checkpoint::load(&dir)?);
    if ck.meta["model"] == "sick" {
        return crate::sick::eval(args, &dir, &ck);
    }
    let meta = &ck.meta;
    let kind = Model::from_name(meta["model"].as_str().unwrap_or_default())?;
    let lowercase = meta["lowercase"].as_bool().unwrap_or(false);
    let words: Vec<String> = meta["vocab"]
        .as_array()
        .map(|a| a.iter().filter_map(|w| w.as_str().map(String::from)).collect())
        .unwrap_or_default();
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
        Device::Cpu => accuracy(CpuBackend::new(), kind, &ck, words.len(), &test)?,
        Device::Cuda => accuracy(crate::cuda_backend()?, kind, &ck, words.len(), &test)?,
    };
    let mut report =
        json!({"model": kind.name(), "checkpoint": dir.display().to_string(), "test_acc": acc, "trees": test.len()});
    if let Some(layers) = meta["layers"].as_u64() {
        report["layers"] = json!(layers);
    }
    println!("{report}");
    Ok(())
}

/// The root accuracy on `test` of the classifier of `kind` cells (one, or a stack of as many
/// layers as the checkpoint's `layers`) restored from `ck`, on `backend`.
fn accuracy<B: Backend>(backend: B, kind: Model, ck: &Checkpoint, vocab: usize, test: &[TreeExample]) -> Result<f64> {
    let meta = &ck.meta;
    let (embed, hidden, classes) =
        (meta_usize(meta, "embed")?, meta_usize(meta, "hidden")?, meta_usize(meta, "classes")?);
    let layers = meta["layers"].as_u64().map_or(1, |l| l as usize);
    let mut rng = Rng::new(0);
    if layers == 1 {
        let mut model = Classifier::on(backend, kind.cell(embed, hidden)?, vocab, Some(PAD), classes, &mut rng)?;
        model.restore(ck)?;
        return model.accuracy(test, 256);
    }
    let cells = (0..layers).map(|k| kind.cell(if k == 0 { embed } else { hidden }, hidden)).collect::<Result<_>>()?;
    let words = Embedding::new(vocab, embed, 0.1, &mut rng).with_padding(PAD);
    let mut model = stacked_model(&backend, words, cells, hidden, classes, 0, &mut rng)?;
    model.restore(ck)?;
    let scores = model.score(&Labelled::all(test, LossOn::Root, classes))?;
    Ok(scores.first().map_or(f64::NAN, |s| s.1))
}
