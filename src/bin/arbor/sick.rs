//! `arbor train --model sick` and `arbor eval` of its checkpoints: sentence-pair relatedness on
//! SICK with the model of Tai et al. (2015) — the child-sum Tree-LSTM over each sentence's
//! dependency tree (`nn::child_sum_tree_lstm_nary`), the relatedness head
//! (`nn::relatedness_head`) and the KL loss, put together by `arbor::model::Model`.

use crate::args::PrecisionArg;
use crate::args::{Distributed, EvalArgs, TrainArgs};
use crate::meta_usize;
use crate::resume::prepare_run;
use crate::train::{
    check_freeze, new_run, on_mpi, optimizer, plural, record_optional_flags, settings, Progress, Sizes,
};
use crate::{on_device, OnDevice};
use arbor::checkpoint::Checkpoint;
use arbor::data::sick::{self, Pair};
use arbor::data::{Vocab, PAD};
use arbor::layers::Embedding;
use arbor::model::{AsExample, Feed, Model};
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, Event};
use arbor::{nn, Backend, Error, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

/// Units of the relatedness head's hidden layer (Tai et al.).
const UNITS: usize = 50;

/// The pair model at `embed`/`hidden` over `vocab` words, on replicas of `backend`; refused
/// before anything is allocated where `replicas` copies would not fit in memory.
fn pair_model<B: Backend>(
    backend: &B,
    vocab: usize,
    embed: usize,
    hidden: usize,
    replicas: usize,
    rng: &mut Rng,
) -> Result<Model<B>> {
    let (cell, head) =
        (nn::child_sum_tree_lstm_nary(embed, hidden)?, nn::relatedness_head(hidden, UNITS, sick::CLASSES)?);
    let floats = crate::model_floats(vocab, embed, &[&cell, &head], 0, 0) * replicas as u128;
    arbor::memory::check_model("--hidden, --embed and --workers", floats, 2 * replicas as u128)?;
    let words = Embedding::new(vocab, embed, 0.1, rng).with_padding(PAD);
    Model::init(backend, words, cell, vec![Feed::Words, Feed::ParentWords], head, rng)
}

/// The scores of `AsExample::score` for pairs as a JSON object.
fn scores<B: Backend>(model: &mut Model<B>, pairs: &[Pair]) -> Result<Value> {
    let scores = Pair::score(&model.infer_all(pairs)?, pairs)?;
    Ok(scores.into_iter().map(|(k, v)| (k, json!(v))).collect::<serde_json::Map<_, _>>().into())
}

/// Trains the pair model on `--data DIR` (a SICK folder) by the one training loop (threads or
/// MPI ranks, checkpoints, resume), keeping the epoch of the best dev Pearson; prints a JSON
/// line with its test scores.
pub(crate) fn train(args: &TrainArgs, sizes: &Sizes, timeout: Duration) -> Result<()> {
    let unsupported = [
        ("--layers or --stages above 1", args.layers > 1 || args.most_stages() > 1),
        ("--embeddings", args.embeddings.is_some()),
    ];
    if let Some((flag, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(Error::input("--model sick", "one stage, from random word vectors (for now)", *flag));
    }
    struct Train<'a>(&'a TrainArgs, &'a Sizes, Duration);
    impl OnDevice for Train<'_> {
        type Out = ();
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<()> {
            train_on(backend, self.0, self.1, self.2)
        }
    }
    on_device(args.device, PrecisionArg::F32, Train(args, sizes, timeout))
}

fn train_on<B: Backend<Buffer: Send, Index: Send> + Send>(
    backend: B,
    args: &TrainArgs,
    sizes: &Sizes,
    timeout: Duration,
) -> Result<()> {
    let dir = args.data.as_deref().ok_or_else(|| {
        Error::input("--model sick", "--data DIR with the SICK splits (e.g. ../shared/data/sick)", "no --data")
    })?;
    let data = sick::read_splits(dir, args.lowercase)?;
    let (epochs, hidden, embed, lr) = (sizes.epochs, sizes.hidden, sizes.embed, sizes.lr);
    let mut rng = Rng::new(args.seed);
    let model = pair_model(&backend, data.vocab.len(), embed, hidden, args.workers, &mut rng)?;
    check_freeze(args, &model.tensors_lent()?.into_iter().map(|t| t.0).collect::<Vec<_>>())?;
    let mut run = new_run(model, args, lr, &rng)?;
    let mut plan = settings(
        args,
        epochs,
        json!({
            "model": "sick", "embed": embed, "hidden": hidden, "units": UNITS, "seed": args.seed,
            "lowercase": args.lowercase, "data": dir_name(args), "vocab": data.vocab.words(), "batch": args.batch(),
            "optimizer": format!("{:?}", optimizer(args, lr)), "clip": args.clip,
        }),
    );
    record_optional_flags(args, &mut plan.meta);
    let _folder = prepare_run(std::slice::from_mut(&mut run), args, &plan)?;
    let splits = data.splits();
    let announce = |workers: String| {
        eprintln!(
            "arbor: training sick relatedness on {} ({} train / {} dev / {} test pairs, vocabulary {}, {workers})",
            dir.display(),
            data.train.len(),
            data.dev.len(),
            data.test.len(),
            data.vocab.len()
        );
    };
    let mut progress = Progress::new(epochs, args.plot.as_deref(), "dev Pearson")?;
    let mut events = |e: Event| progress.on(e);
    let (summary, lead) = match args.distributed {
        None => {
            announce(plural(args.workers, "worker"));
            (fit_threads(&mut run, args.workers, timeout, splits, &plan, &mut events)?, true)
        }
        Some(Distributed::Mpi) => on_mpi(timeout, |coll| {
            let rank = coll.rank();
            if rank == 0 {
                announce(plural(coll.size(), "MPI rank"));
            }
            let mut quiet = |_: Event| {};
            let events: &mut dyn FnMut(Event) = if rank == 0 { &mut events } else { &mut quiet };
            Ok((run.fit(splits, &plan, coll, events)?, rank == 0))
        })?,
    };
    progress.finish();
    if !lead {
        return Ok(());
    }
    crate::train::warn_without_dev(&summary);
    // The best epoch's scores, or those of what a run stopped before any epoch's end trained.
    let (dev, test) = match &summary.unfinished {
        Some((dev, test)) if run.best_dev() == f64::NEG_INFINITY => (*dev, test.clone()),
        _ => (run.best_dev(), run.test_scores().clone()),
    };
    let test = |key: &str| test.iter().find(|(k, _)| k == key).map(|(_, v)| *v);
    let seconds = summary.train_seconds;
    println!(
        "{}",
        json!({
            "model": "sick", "data": dir_name(args), "epochs": epochs, "batch": args.batch(), "hidden": hidden,
            "embed": embed, "workers": args.workers, "steps": run.position().steps, "train_seconds": (seconds * 1000.0).round() / 1000.0,
            "pairs_per_s": (summary.sentences as f64 / seconds.max(1e-9)).round(), "dev_pearson": dev,
            "test_pearson": test("pearson"), "test_spearman": test("spearman"), "test_mse": test("mse"),
        })
    );
    Ok(())
}

/// The SICK folder as a full path (as SST's is recorded), so `arbor eval` and `--resume` find
/// the same folder from anywhere, however `--data` was spelled.
fn dir_name(args: &TrainArgs) -> String {
    args.data
        .as_ref()
        .map_or_else(String::new, |d| d.canonicalize().unwrap_or_else(|_| d.clone()).display().to_string())
}

/// `arbor eval` of a checkpoint of `--model sick` (in `dir`): its test scores, again.
pub(crate) fn eval(args: &EvalArgs, dir: &Path, ck: &Checkpoint) -> Result<()> {
    let meta = &ck.meta;
    let (embed, hidden) = (meta_usize(meta, "embed")?, meta_usize(meta, "hidden")?);
    let (words, lowercase) = crate::eval::vocabulary(meta);
    let data = args.data.clone().or_else(|| meta["data"].as_str().map(Into::into)).ok_or_else(|| {
        Error::input("arbor eval of a sick checkpoint", "--data DIR with the SICK splits", "none, and none recorded")
    })?;
    if !data.join("test").is_dir() {
        return Err(Error::input(
            format!("checkpoint {} (model sick)", args.checkpoint.display()),
            "a SICK folder with a test/ split",
            format!("{}, which has none", data.display()),
        ));
    }
    let mut vocab = Vocab::from_words(&words, lowercase);
    let test = sick::read(&data.join("test"), &mut vocab, false)?;
    struct Eval<'a>(&'a Checkpoint, usize, usize, usize, &'a [sick::Pair]);
    impl OnDevice for Eval<'_> {
        type Out = Value;
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<Value> {
            eval_on(&backend, self.0, self.1, self.2, self.3, self.4)
        }
    }
    let test_scores = on_device(args.device, PrecisionArg::F32, Eval(ck, words.len(), embed, hidden, &test))?;
    println!(
        "{}",
        json!({
            "model": "sick", "checkpoint": dir.display().to_string(), "pairs": test.len(),
            "test_pearson": test_scores["pearson"], "test_spearman": test_scores["spearman"], "test_mse": test_scores["mse"],
        })
    );
    Ok(())
}

/// The test scores of the checkpoint's model: rebuilt from its `model_spec`, or for a checkpoint
/// written before models described themselves, from its sizes.
fn eval_on<B: Backend>(
    backend: &B,
    ck: &Checkpoint,
    vocab: usize,
    embed: usize,
    hidden: usize,
    test: &[Pair],
) -> Result<Value> {
    let mut model = if ck.meta.get("model_spec").is_some() {
        Model::from_checkpoint(ck, backend)?
    } else {
        let mut model = pair_model(backend, vocab, embed, hidden, 1, &mut Rng::new(0))?;
        model.restore(ck)?;
        model
    };
    scores(&mut model, test)
}
