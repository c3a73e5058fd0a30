//! `arbor bench`: throughput of training or inference, as JSON on the last stdout line.

use crate::args::*;
use crate::{bar, load, on_device, OnDevice};
use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, TreeExample};
use arbor::dist::Collective;
use arbor::head::argmax;
use arbor::layers::LossOn;
use arbor::loss_scale::LossScaler;
use arbor::model::{AsExample, Example, Model};
use arbor::nn::CellKind as Kind;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::profile;
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::trainer::{fit_threads, on_threads, Event, Run, Settings, Splits};
use arbor::{Backend, Error, Result, VertexFn};
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

/// The bench's progress bar.
pub(crate) fn bench_bar(args: &BenchArgs, len: usize) -> ProgressBar {
    let mode = if args.mode == Mode::Train { "train" } else { "infer" };
    bar(len, format!("bench {} {mode}", args.model.model().name()))
}

/// The model `arbor train` trains, on `backend`: one layer of `cell` over `vocab` words, reading
/// what `loss_on` says (inference reads the roots).
fn bench_model<B: Backend>(
    backend: &B,
    cell: VertexFn,
    vocab: usize,
    classes: usize,
    args: &BenchArgs,
    loss_on: LossOn,
) -> Result<Model<B>> {
    let readout = if args.mode == Mode::Train { Labelled::readout(loss_on) } else { Readout::Root };
    arbor::zoo::tree_classifier_on(backend, vec![cell], vocab, classes, readout, &mut Rng::new(1))
}

/// Times `examples` through `args.workers` replicas of `model` on threads (see
/// `BenchArgs::workers`), each with a [replica](Backend::replica) of its backend, after a warm-up
/// on three minibatches. Training runs one epoch of [`Run::fit`], the loop `arbor train` runs;
/// inference gives each worker every `args.workers`-th minibatch from its rank on.
pub(crate) fn measure<B: Backend>(model: Model<B>, args: &BenchArgs, examples: &[Labelled<'_>]) -> Result<Timed>
where
    Model<B>: Send,
{
    let warmup = &examples[..examples.len().min(3 * args.batch)];
    let pb = bench_bar(args, examples.len());
    if args.mode == Mode::Train {
        let mut run = Run::new(model, Optimizer::new(Config::new(Rule::Adagrad, 0.05)), &Rng::new(1));
        let timeout = arbor::dist::DEFAULT_TIMEOUT;
        // No clipping: the work the peers do (and the bench before the one loop did).
        let plan = Settings { clip: None, ..Settings::new(1, args.batch) };
        fit_threads(
            &mut run,
            args.workers,
            timeout,
            Splits { train: warmup, dev: &[], test: &[] },
            &plan,
            &mut |_| {},
        )?;
        let (model, opt) = run.into_parts();
        let mut run = Run::new(model, opt, &Rng::new(2));
        let (flops_before, calls_before) = (run.model_mut().flops(), run.model_mut().calls());
        let launches_before = run.model_mut().launches();
        let submissions_before = run.model_mut().submissions();
        profile::enable(args.profile);
        profile::reset();
        let start = Instant::now();
        let mut progress = |e: Event| {
            if let Event::Trees(n) = e {
                pb.inc(n as u64);
            }
        };
        let timed = Splits { train: examples, dev: &[], test: &[] };
        fit_threads(&mut run, args.workers, timeout, timed, &plan, &mut progress)?;
        let seconds = start.elapsed().as_secs_f64();
        profile::enable(false);
        pb.finish_and_clear();
        // Every replica runs its share of each minibatch: the first one's flops are its share.
        let flops = (run.model_mut().flops() - flops_before) as f64 * args.workers as f64;
        let calls = (run.model_mut().calls() - calls_before) as f64;
        let steps = examples.len().div_ceil(args.batch) as f64;
        let launches = run.model_mut().launches().zip(launches_before).map(|(l, b)| (l - b) as f64 / steps);
        let submissions = run.model_mut().submissions().zip(submissions_before).map(|(l, b)| (l - b) as f64 / steps);
        return Ok(Timed {
            seconds,
            flops,
            calls_per_step: calls / steps,
            launches_per_step: launches,
            submissions_per_step: submissions,
        });
    }
    let mut replicas: Vec<Model<B>> = (1..args.workers).map(|_| model.replica()).collect::<Result<_>>()?;
    replicas.insert(0, model);
    let batches: Vec<Vec<Example<'_>>> =
        examples.chunks(args.batch).map(|c| c.iter().map(Labelled::example).collect()).collect();
    let timed = on_threads(replicas, arbor::dist::DEFAULT_TIMEOUT, 0, &mut |_| {}, |mut model, coll, _| {
        let me = coll.rank();
        let pass = |model: &mut Model<B>, batches: &[Vec<Example<'_>>], pb: Option<&ProgressBar>| -> Result<()> {
            for batch in batches.iter().skip(me).step_by(args.workers) {
                // Inference and each tree's predicted root class.
                let out = model.infer(batch)?;
                let logits = out.get(1).map_or(&[][..], Vec::as_slice);
                std::hint::black_box(logits.chunks(classes_of(batch)).map(argmax).collect::<Vec<_>>());
                if let Some(pb) = pb {
                    pb.inc(batch.len() as u64);
                }
            }
            Ok(())
        };
        pass(&mut model, &batches[..batches.len().min(3)], None)?;
        let mut meet = [0.0f32];
        coll.all_reduce_sum(&mut meet)?;
        let (flops_before, calls_before) = (model.flops(), model.calls());
        let (launches_before, submissions_before) = (model.launches(), model.submissions());
        if me == 0 {
            profile::enable(args.profile);
            profile::reset();
        }
        let start = Instant::now();
        pass(&mut model, &batches, Some(&pb))?;
        let launches = model.launches().zip(launches_before).map(|(l, b)| l - b);
        let submissions = model.submissions().zip(submissions_before).map(|(l, b)| l - b);
        Ok((start, model.flops() - flops_before, model.calls() - calls_before, (launches, submissions)))
    })?;
    let seconds = timed.iter().map(|(start, ..)| start.elapsed()).max().unwrap_or_default().as_secs_f64();
    profile::enable(false);
    pb.finish_and_clear();
    let calls: u64 = timed.iter().map(|&(.., calls, _)| calls).sum();
    let launches: Option<u64> = timed.iter().map(|&(.., (launches, _))| launches).sum();
    let submissions: Option<u64> = timed.iter().map(|&(.., (_, submissions))| submissions).sum();
    let steps = batches.len().max(1) as f64;
    Ok(Timed {
        seconds,
        flops: timed.iter().map(|&(_, flops, ..)| flops as f64).sum(),
        calls_per_step: calls as f64 / steps,
        launches_per_step: launches.map(|l| l as f64 / steps),
        submissions_per_step: submissions.map(|l| l as f64 / steps),
    })
}

/// A timed run: its seconds, the floating-point operations its engines executed, and their
/// backend calls per minibatch (one replica's, for training on several workers).
pub(crate) struct Timed {
    seconds: f64,
    flops: f64,
    calls_per_step: f64,
    /// Kernel launches and library calls a step gave the device, where its backend counts them.
    launches_per_step: Option<f64>,
    /// Work handed to the device per step, a graph counted once ([`Backend::submissions`]).
    submissions_per_step: Option<f64>,
}

/// The classes of a minibatch's target rows (each example's one row).
fn classes_of(batch: &[Example<'_>]) -> usize {
    batch.first().map_or(1, |e| e.target.len().max(1))
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
    if args.model.model() == Kind::TreeFc && args.data.is_none() && args.leaves == 0 {
        return Err(Error::input("--leaves", "at least 1 leaf", "0"));
    }
    let model_kind = args.model.model();
    if args.model.graph_cell().is_some() || args.model == ModelArg::Sick {
        return Err(Error::input(
            "bench --model",
            "a tree or sequence model (tree-lstm, child-sum, var-lstm, tree-fc)",
            if args.model.graph_cell().is_some() {
                format!("{} (graph models are cross-validated by arbor train)", args.model.name())
            } else {
                "sick (arbor train)".into()
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
        (None, Kind::TreeFc) => {
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
    let loss_on = if args.loss == Loss::All && !model_kind.chains() { LossOn::All } else { LossOn::Root };
    // Inference reads the roots, whatever the loss.
    let on = if args.mode == Mode::Train { loss_on } else { LossOn::Root };
    let labelled: Vec<Labelled<'_>> = examples.iter().map(|tree| Labelled { tree, loss_on: on, classes }).collect();
    struct Work<'a, 'l>(VertexFn, usize, usize, &'a BenchArgs, &'a [Labelled<'l>], LossOn);
    impl OnDevice for Work<'_, '_> {
        type Out = (Timed, String);
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<(Timed, String)> {
            let Work(cell, vocab, classes, args, examples, loss_on) = self;
            let mut model = bench_model(&backend, cell, vocab, classes, args, loss_on)?;
            if args.precision == PrecisionArg::F16 {
                model = model.with_loss_scale(LossScaler::dynamic());
            }
            Ok((measure(model, args, examples)?, backend.device()))
        }
    }
    let work = Work(cell, vocab, classes, args, &labelled, loss_on);
    let (Timed { seconds, flops, calls_per_step, launches_per_step, submissions_per_step }, device) =
        on_device(args.device, args.precision, work)?;
    let gpu = (args.device == Device::Cuda).then_some(device);
    let vertices: usize = examples.iter().map(|e| e.graph.len()).sum();
    let nominal = vertices as f64 * nominal_per_vertex as f64;
    let mut report = json!({
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
        "launches_per_step": calls_per_step.round(),
    });
    if let Some(launches) = launches_per_step {
        report["device_launches_per_step"] = json!(launches.round());
    }
    if let Some(submissions) = submissions_per_step {
        report["device_submissions_per_step"] = json!(submissions.round());
    }
    if args.profile {
        // Milliseconds a step (to the microsecond), each activity summed over the workers' threads.
        let steps = args.sentences.div_ceil(args.batch) as f64;
        let ms = |s: f64| (s / steps * 1e6).round() / 1000.0;
        let mut spent: serde_json::Map<String, serde_json::Value> =
            profile::totals().into_iter().map(|(p, s)| (p.name().to_string(), json!(ms(s)))).collect();
        spent.insert("step".into(), json!(ms(seconds)));
        report["profile_ms_per_step"] = json!(spent);
    }
    println!("{report}");
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
