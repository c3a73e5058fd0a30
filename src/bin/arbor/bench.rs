//! `arbor bench`: throughput of training or inference, as JSON on the last stdout line.

use crate::args::*;
use crate::{bar, load};
#[cfg(feature = "cuda")]
use arbor::cuda::Precision;
use arbor::data::{synthetic, TreeExample, PAD};
use arbor::dist::{Collective, ThreadCollective};
use arbor::layers::LossOn;
#[cfg(feature = "cuda")]
use arbor::loss_scale::LossScaler;
use arbor::nn::Model;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::train::Classifier;
use arbor::trainer::{on_threads, train_steps};
use arbor::{Backend, Error, Result};
use indicatif::ProgressBar;
use serde_json::json;
use std::time::Instant;

/// Peak resident memory of this process in MiB (Linux), or 0 where unknown.
pub(crate) fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Infers `batch` and predicts each tree's root class (what inference is timed on).
pub(crate) fn infer_batch<B: Backend>(model: &mut Classifier<B>, batch: &[&TreeExample]) -> Result<()> {
    let graphs: Vec<&arbor::InputGraph> = batch.iter().map(|e| &e.graph).collect();
    let ids: Vec<u32> = batch.iter().flat_map(|e| e.words.iter().copied()).collect();
    let (mut roots, mut base) = (Vec::with_capacity(batch.len()), 0);
    for e in batch {
        roots.extend(e.graph.roots().into_iter().map(|r| base + r));
        base += e.graph.len();
    }
    let h = model.infer_rows(&graphs, &ids, &roots)?;
    model.out.predict(&h)?;
    Ok(())
}

/// The bench's progress bar.
pub(crate) fn bench_bar(args: &BenchArgs, len: usize) -> ProgressBar {
    let mode = if args.mode == Mode::Train { "train" } else { "infer" };
    bar(len, format!("bench {} {mode}", args.model.model().name()))
}

/// One bench worker's pass over `batches`: in training, the data-parallel steps of `arbor train`
/// ([`train_steps`]) on every minibatch; in inference, every `args.workers`-th minibatch from
/// its rank on.
pub(crate) fn worker_pass<B: Backend>(
    model: &mut Classifier<B>,
    coll: &mut dyn Collective,
    opt: &mut Optimizer,
    args: &BenchArgs,
    loss_on: LossOn,
    batches: &[Vec<&TreeExample>],
    pb: Option<&ProgressBar>,
) -> Result<()> {
    let me = coll.rank();
    // In training every worker steps on every minibatch: the first one counts it.
    let count = |trees: usize| {
        if let Some(pb) = pb.filter(|_| args.mode == Mode::Infer || me == 0) {
            pb.inc(trees as u64);
        }
    };
    match args.mode {
        Mode::Train => train_steps(model, opt, coll, batches, loss_on, None, &mut |_, trees| {
            count(trees);
            Ok(true)
        }),
        Mode::Infer => {
            for batch in batches.iter().skip(me).step_by(args.workers) {
                infer_batch(model, batch)?;
                count(batch.len());
            }
            Ok(())
        }
    }
}

/// Times `args.sentences` of `examples` through `args.workers` replicas of `model` on threads
/// (see `BenchArgs::workers`), each with a [replica](Backend::replica) of its backend: each
/// warms up on three minibatches, the workers meet, and the time runs until the last one is
/// done. Returns the seconds and the floating-point operations the engines executed.
pub(crate) fn measure<B: Backend>(
    model: Classifier<B>,
    args: &BenchArgs,
    examples: &[&TreeExample],
    loss_on: LossOn,
) -> Result<(f64, f64)>
where
    Classifier<B>: Send,
{
    let mut replicas: Vec<Classifier<B>> = (1..args.workers).map(|_| model.replica()).collect::<Result<_>>()?;
    replicas.insert(0, model);
    let batches: Vec<Vec<&TreeExample>> = examples.chunks(args.batch).map(<[_]>::to_vec).collect();
    let warmup = batches.len().min(3);
    let pb = bench_bar(args, examples.len());
    let timed = on_threads(replicas, arbor::dist::DEFAULT_TIMEOUT, 0, &mut |_| {}, |mut model, coll, _| {
        let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
        let mut pass = |model: &mut Classifier<B>, coll: &mut ThreadCollective, batches, pb| {
            worker_pass(model, coll, &mut opt, args, loss_on, batches, pb)
        };
        pass(&mut model, coll, &batches[..warmup], None)?;
        let mut meet = [0.0f32];
        coll.all_reduce_sum(&mut meet)?;
        let flops_before = model.engine.flops();
        let start = Instant::now();
        pass(&mut model, coll, &batches, Some(&pb))?;
        Ok((start, model.engine.flops() - flops_before))
    })?;
    let seconds = timed.iter().map(|(start, _)| start.elapsed()).max().unwrap_or_default().as_secs_f64();
    pb.finish_and_clear();
    // Training replicas repeat the same minibatches' shares: their flops add up to one pass.
    Ok((seconds, timed.iter().map(|&(_, flops)| flops as f64).sum()))
}

pub(crate) fn bench(args: &BenchArgs) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if let Some(t) = args.threads.filter(|&t| t == 0 || t > 8 * cores) {
        return Err(Error::input("--threads", format!("between 1 and 8 × the {cores} cores"), t.to_string()));
    }
    match args.threads {
        Some(t) => arbor::with_cpu_threads(t, || bench_on(args)),
        None => bench_on(args),
    }
}

/// [`bench`] within its thread budget.
pub(crate) fn bench_on(args: &BenchArgs) -> Result<()> {
    if args.workers == 0 || args.workers > args.batch.max(1) {
        let expected = format!("between 1 and the trees of a minibatch (--batch {})", args.batch);
        return Err(Error::input("--workers", expected, args.workers.to_string()));
    }
    if args.model.model() == Model::TreeFc && args.data.is_none() && args.leaves == 0 {
        return Err(Error::input("--leaves", "at least 1 leaf", "0"));
    }
    if args.device == Device::Cpu && args.precision != PrecisionArg::F32 {
        return Err(Error::input(
            "--precision",
            "f32 on the CPU (reduced precision is for --device cuda)",
            format!("{:?}", args.precision).to_lowercase(),
        ));
    }
    let model_kind = args.model.model();
    if matches!(args.model, ModelArg::Ggnn | ModelArg::Sick) {
        return Err(Error::input(
            "bench --model",
            "a tree or sequence model (tree-lstm, child-sum, var-lstm, tree-fc)",
            if matches!(args.model, ModelArg::Ggnn) {
                "ggnn (cross-validated by arbor train)"
            } else {
                "sick (arbor train)"
            },
        ));
    }
    if args.batch == 0 || args.sentences == 0 || args.hidden == 0 || args.embed == 0 {
        return Err(Error::input(
            "arguments",
            "--batch, --sentences, --hidden and --embed above 0",
            format!("{} {} {} {}", args.batch, args.sentences, args.hidden, args.embed),
        ));
    }
    let cell = model_kind.cell(args.embed, args.hidden)?;
    let (pool, vocab, classes) = match (&args.data, model_kind) {
        (None, Model::TreeFc) => {
            // Checked before the tree is built: its vertices, and a minibatch's values.
            let vertices = (2 * args.leaves as u128).saturating_sub(1);
            let minibatch = vertices * args.batch.min(args.sentences) as u128;
            arbor::memory::check(
                "--leaves, --batch, --hidden and --embed",
                vertices * 48 + minibatch * arbor::memory::vertex_floats(&cell) * 4,
                "a synthetic tree and a minibatch's values",
            )?;
            // Every vertex pulls the same (non-padding) word; the label only feeds the loss.
            let graph = arbor::InputGraph::balanced_binary(args.leaves);
            let n = graph.len();
            let ex = TreeExample { graph, words: vec![2; n], labels: vec![0; n] };
            (vec![ex], synthetic::vocab().len(), synthetic::CLASSES)
        }
        _ => {
            let d = load(args.data.as_deref(), 1, false, model_kind)?;
            (d.train, d.vocab.len(), d.classes)
        }
    };
    arbor::memory::check("--sentences", 8 * args.sentences as u128, "the list of timed sentences")?;
    let examples: Vec<&TreeExample> = pool.iter().cycle().take(args.sentences).collect();
    let floats = crate::model_floats(vocab, args.embed, &[&cell], args.hidden, classes) * args.workers as u128;
    arbor::memory::check_model("--hidden, --embed and --workers", floats, 2 * args.workers as u128)?;
    let (fwd_flops, bwd_flops) = cell.flops_per_vertex();
    let nominal_per_vertex = fwd_flops + if args.mode == Mode::Train { bwd_flops } else { 0 };
    let mut rng = Rng::new(1);
    let loss_on = if args.loss == Loss::All && !model_kind.chains() { LossOn::All } else { LossOn::Root };
    let (seconds, flops, gpu) = match args.device {
        Device::Cpu => {
            let model = Classifier::new(cell, vocab, Some(PAD), classes, &mut rng)?;
            let (seconds, flops) = measure(model, args, &examples, loss_on)?;
            (seconds, flops, None)
        }
        Device::Cuda => measure_on_gpu(cell, vocab, classes, args, &examples, loss_on, &mut rng)?,
    };
    let vertices: usize = examples.iter().map(|e| e.graph.len()).sum();
    let nominal = vertices as f64 * nominal_per_vertex as f64;
    println!(
        "{}",
        json!({
            "model": model_kind.name(),
            "mode": if args.mode == Mode::Train { "train" } else { "infer" },
            "device": if args.device == Device::Cuda { "cuda" } else { "cpu" },
            "gpu": gpu,
            "precision": format!("{:?}", args.precision).to_lowercase(),
            "threads": arbor::cpu_thread_budget(),
            "cpu_isa": arbor::isa::active().name(),
            "workers": args.workers,
            "batch": args.batch,
            "hidden": args.hidden,
            "embed": args.embed,
            "loss": if loss_on == LossOn::All { "all" } else { "root" },
            "sentences": args.sentences,
            "seconds": (seconds * 1e4).round() / 1e4,
            "sent_per_s": (args.sentences as f64 / seconds).round(),
            "vertices_per_s": (vertices as f64 / seconds).round(),
            "gflops": significant(flops / seconds / 1e9),
            "nominal_gflops": significant(nominal / seconds / 1e9),
            "peak_rss_mb": (peak_rss_mb() * 10.0).round() / 10.0,
        })
    );
    Ok(())
}

/// `x` to three significant digits (a small model's GFLOP/s do not round to 0).
fn significant(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(2 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// The measurement on the first CUDA device: seconds, FLOPs and the device's name.
#[cfg(feature = "cuda")]
fn measure_on_gpu(
    cell: arbor::VertexFn,
    vocab: usize,
    classes: usize,
    args: &BenchArgs,
    examples: &[&TreeExample],
    loss_on: LossOn,
    rng: &mut Rng,
) -> Result<(f64, f64, Option<String>)> {
    let gpu = crate::cuda_backend()?;
    let name = gpu.description().to_string();
    gpu.set_precision(match args.precision {
        PrecisionArg::F32 => Precision::F32,
        PrecisionArg::Tf32 => Precision::Tf32,
        PrecisionArg::Bf16 => Precision::Bf16,
        PrecisionArg::F16 => Precision::F16,
    });
    let mut model = Classifier::on(gpu, cell, vocab, Some(PAD), classes, rng)?;
    if args.precision == PrecisionArg::F16 {
        model.loss_scale = Some(LossScaler::dynamic());
    }
    let (seconds, flops) = measure(model, args, examples, loss_on)?;
    Ok((seconds, flops, Some(name)))
}

/// `--device cuda` in a build without the `cuda` feature: the error saying so.
#[cfg(not(feature = "cuda"))]
fn measure_on_gpu(
    _: arbor::VertexFn,
    _: usize,
    _: usize,
    _: &BenchArgs,
    _: &[&TreeExample],
    _: LossOn,
    _: &mut Rng,
) -> Result<(f64, f64, Option<String>)> {
    crate::cuda_backend().map(|_| (0.0, 0.0, None))
}
