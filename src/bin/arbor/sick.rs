//! `arbor train --model sick` and `arbor eval` of its checkpoints: sentence-pair relatedness on
//! SICK with the model of Tai et al. (2015) — the child-sum Tree-LSTM over each sentence's
//! dependency tree (`nn::child_sum_tree_lstm_nary`), the relatedness head
//! (`nn::relatedness_head`) and the KL loss, put together by `arbor::model::Model`.

use crate::args::{Device, EvalArgs, TrainArgs};
use crate::meta_usize;
use crate::train::{optimizer, Progress, Sizes};
use arbor::checkpoint::Checkpoint;
use arbor::core::rng::Rng;
use arbor::data::sick::{self, Pair};
use arbor::data::{Vocab, PAD};
use arbor::layers::Embedding;
use arbor::model::{Example, Feed, Model};
use arbor::optim::Optimizer;
use arbor::trainer::Event;
use arbor::{metrics, nn, Backend, CpuBackend, Error, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// Units of the relatedness head's hidden layer (Tai et al.).
const UNITS: usize = 50;

/// The pair model at `embed`/`hidden` over `vocab` words, on replicas of `backend`.
fn pair_model<B: Backend>(backend: &B, vocab: usize, embed: usize, hidden: usize, rng: &mut Rng) -> Result<Model<B>> {
    let words = Embedding::new(vocab, embed, 0.1, rng).with_padding(PAD);
    let (cell, head) =
        (nn::child_sum_tree_lstm_nary(embed, hidden)?, nn::relatedness_head(hidden, UNITS, sick::CLASSES)?);
    Model::init(backend, words, cell, vec![Feed::Words, Feed::ParentWords], head, rng)
}

/// Pearson's and Spearman's correlations and the mean squared error of the model's expected
/// scores on `pairs`.
fn scores<B: Backend>(model: &mut Model<B>, pairs: &[Pair]) -> Result<Value> {
    let (got, gold) = (sick::predict(model, pairs)?, sick::gold(pairs));
    Ok(json!({
        "pearson": metrics::pearson(&got, &gold),
        "spearman": metrics::spearman(&got, &gold),
        "mse": metrics::mean_squared_error(&got, &gold),
    }))
}

/// Trains the pair model on `--data DIR` (a SICK folder), keeping the epoch of the best dev
/// Pearson; prints a JSON line with its test scores.
pub(crate) fn train(args: &TrainArgs, sizes: &Sizes) -> Result<()> {
    let unsupported = [
        ("--layers or --stages above 1", args.layers > 1 || args.stages > 1),
        ("--workers above 1", args.workers > 1),
        ("--distributed", args.distributed.is_some()),
        ("--resume", args.resume.is_some()),
        ("--checkpoint-every", args.checkpoint_every.is_some()),
        ("--embeddings", args.embeddings.is_some()),
    ];
    if let Some((flag, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(Error::input("--model sick", "one worker on one stage, from random word vectors (for now)", *flag));
    }
    match args.device {
        Device::Cpu => train_on(&CpuBackend::new(), args, sizes),
        Device::Cuda => train_on(&crate::cuda_backend()?, args, sizes),
    }
}

fn train_on<B: Backend>(backend: &B, args: &TrainArgs, sizes: &Sizes) -> Result<()> {
    let dir = args.data.as_deref().ok_or_else(|| {
        Error::input("--model sick", "--data DIR with the SICK splits (e.g. ../shared/data/sick)", "no --data")
    })?;
    let data = sick::read_splits(dir, args.lowercase)?;
    eprintln!(
        "arbor: training sick relatedness on {} ({} train / {} dev / {} test pairs, vocabulary {})",
        dir.display(),
        data.train.len(),
        data.dev.len(),
        data.test.len(),
        data.vocab.len()
    );
    let (epochs, hidden, embed, lr) = (sizes.epochs, sizes.hidden, sizes.embed, sizes.lr);
    let mut rng = Rng::new(args.seed);
    let mut model = pair_model(backend, data.vocab.len(), embed, hidden, &mut rng)?;
    let mut opt = Optimizer::new(optimizer(args, lr));
    let clip = (args.clip > 0.0).then_some(args.clip);
    let mut progress = Progress::new(epochs, args.plot.as_deref(), "dev Pearson");
    let mut order: Vec<usize> = (0..data.train.len()).collect();
    let (mut steps, mut seconds, mut seen) = (0u64, 0.0f64, 0usize);
    let mut best: Option<(usize, f64, Value)> = None;
    for epoch in 1..=epochs {
        rng.shuffle(&mut order);
        let room = args.max_steps.map_or(usize::MAX, |m| m.saturating_sub(steps) as usize);
        let batches: Vec<&[usize]> = order.chunks(args.batch).take(room).collect();
        if batches.is_empty() {
            break;
        }
        progress.on(Event::EpochStart { epoch, done: 0, total: batches.iter().map(|b| b.len()).sum() });
        let (start, mut loss) = (Instant::now(), 0.0f64);
        for batch in &batches {
            let examples: Vec<Example<'_>> = batch.iter().map(|&i| data.train[i].example()).collect();
            let out = model.step(&examples, &mut opt, clip)?;
            loss += out[0].iter().map(|&l| f64::from(l)).sum::<f64>();
            steps += 1;
            progress.on(Event::Trees(batch.len()));
        }
        seconds += start.elapsed().as_secs_f64();
        let pairs: usize = batches.iter().map(|b| b.len()).sum();
        seen += pairs;
        let dev = scores(&mut model, &data.dev)?["pearson"].as_f64().unwrap_or(f64::NAN);
        progress.on(Event::EpochEnd { epoch, loss: loss / pairs as f64, dev });
        if best.as_ref().is_none_or(|(_, d, _)| dev > *d) {
            best = Some((epoch, dev, scores(&mut model, &data.test)?));
            if let Some(dir) = &args.checkpoint {
                let meta = json!({
                    "model": "sick", "embed": embed, "hidden": hidden, "units": UNITS, "epoch": epoch,
                    "lowercase": args.lowercase, "data": dir_name(args), "vocab": data.vocab.words(), "dev_pearson": dev,
                });
                Checkpoint { tensors: model.tensors()?, meta }.save(&dir.join("best"))?;
            }
        }
    }
    progress.finish();
    let Some((epoch, dev, test)) = best else {
        return Err(Error::input("--model sick", "at least one training step", "--max-steps 0"));
    };
    println!(
        "{}",
        json!({
            "model": "sick", "data": dir_name(args), "epochs": epochs, "batch": args.batch, "hidden": hidden,
            "embed": embed, "steps": steps, "train_seconds": (seconds * 1000.0).round() / 1000.0,
            "pairs_per_s": (seen as f64 / seconds.max(1e-9)).round(), "best_epoch": epoch, "dev_pearson": dev,
            "test_pearson": test["pearson"], "test_spearman": test["spearman"], "test_mse": test["mse"],
        })
    );
    Ok(())
}

fn dir_name(args: &TrainArgs) -> String {
    args.data.as_ref().map_or_else(String::new, |d| d.display().to_string())
}

/// `arbor eval` of a checkpoint of `--model sick` (in `dir`): its test scores, again.
pub(crate) fn eval(args: &EvalArgs, dir: &Path, ck: &Checkpoint) -> Result<()> {
    let meta = &ck.meta;
    let (embed, hidden) = (meta_usize(meta, "embed")?, meta_usize(meta, "hidden")?);
    let words: Vec<String> = meta["vocab"]
        .as_array()
        .map(|a| a.iter().filter_map(|w| w.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let data = args.data.clone().or_else(|| meta["data"].as_str().map(Into::into)).ok_or_else(|| {
        Error::input("arbor eval of a sick checkpoint", "--data DIR with the SICK splits", "none, and none recorded")
    })?;
    let mut vocab = Vocab::from_words(&words, meta["lowercase"].as_bool().unwrap_or(false));
    let test = sick::read(&data.join("test"), &mut vocab, false)?;
    let test_scores = match args.device {
        Device::Cpu => eval_on(&CpuBackend::new(), ck, words.len(), embed, hidden, &test)?,
        Device::Cuda => eval_on(&crate::cuda_backend()?, ck, words.len(), embed, hidden, &test)?,
    };
    println!(
        "{}",
        json!({
            "model": "sick", "checkpoint": dir.display().to_string(), "pairs": test.len(),
            "test_pearson": test_scores["pearson"], "test_spearman": test_scores["spearman"], "test_mse": test_scores["mse"],
        })
    );
    Ok(())
}

fn eval_on<B: Backend>(
    backend: &B,
    ck: &Checkpoint,
    vocab: usize,
    embed: usize,
    hidden: usize,
    test: &[Pair],
) -> Result<Value> {
    let mut model = pair_model(backend, vocab, embed, hidden, &mut Rng::new(0))?;
    model.restore(ck)?;
    scores(&mut model, test)
}
