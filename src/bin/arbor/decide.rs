//! What `arbor train` decides before training, from the model timed on a few minibatches:
//! `--stages auto` (stages × replicas × micro-batches, `arbor::dist::planner`) and `--batch
//! auto`'s step-time model (`arbor::trainer::BatchSize`).

use crate::args::AUTO_BATCH;
use crate::train::{optimizer, plural, Setup};
use arbor::data::labelled::Labelled;
use arbor::dist::planner::{self, LayerCost, Machine, TrainPlan};
use arbor::model::{self, AsExample, Example};
use arbor::trainer::{AutoBatch, MEASURE_EVERY};
use arbor::{Backend, Error, Result};
use serde_json::{json, Value};

/// `--batch auto`'s settings: its step-time model from `model`'s layers timed on a few training
/// minibatches of `train` at the batch it starts at ([`AUTO_BATCH`]; `Model::layer_costs`), and
/// its bounds (an eighth of that batch to sixteen times it); printed. A run resumed from a
/// checkpoint that recorded them goes on with those, timing nothing.
pub(crate) fn auto_batch<B: Backend>(
    model: &model::Model<B>,
    train: &[Labelled<'_>],
    setup: &Setup<'_>,
) -> Result<AutoBatch> {
    let args = setup.args;
    if let Some(auto) = crate::resume::resumed_batch_settings(args) {
        eprintln!(
            "arbor: --batch auto: the checkpoint's step-time model ({:.2} ms + {:.3} ms an example)",
            auto.pass_seconds * 1e3,
            auto.example_seconds * 1e3
        );
        return Ok(auto);
    }
    let batches: Vec<Vec<Example<'_>>> =
        train.chunks_exact(AUTO_BATCH).take(9).map(|c| c.iter().map(AsExample::example).collect()).collect();
    too_few("--batch auto", &batches, AUTO_BATCH, train.len())?;
    let costs = model.layer_costs(&batches, optimizer(args, setup.sizes.lr), (args.clip > 0.0).then_some(args.clip))?;
    let auto = AutoBatch {
        base: AUTO_BATCH,
        min: (AUTO_BATCH / 8).max(1),
        max: AUTO_BATCH * 16,
        pass_seconds: costs.iter().map(|c| c.pass_seconds).sum(),
        example_seconds: costs.iter().map(|c| c.seconds).sum(),
        every: AUTO_EVERY,
    };
    eprintln!(
        "arbor: --batch auto: from {} (between {} and {}), a step timed at {:.2} ms + {:.3} ms an example; \
         the noise measured every {MEASURE_EVERY} steps, the batch chosen every {AUTO_EVERY}",
        auto.base,
        auto.min,
        auto.max,
        auto.pass_seconds * 1e3,
        auto.example_seconds * 1e3,
    );
    Ok(auto)
}

/// Steps between `--batch auto`'s decisions.
const AUTO_EVERY: u64 = 25;

/// `--stages auto`: for every number of workers up to the cores, times `model`'s layers on a few
/// training minibatches of `train` with the threads each worker would have (the cores shared
/// among them; `Model::layer_costs`) and plans stages × replicas on those workers
/// (`arbor::dist::planner`) within `--memory-budget`; prints the plan with the shortest
/// predicted step and returns it, with what the checkpoint records of it.
pub(crate) fn plan_stages<B: Backend>(
    model: &model::Model<B>,
    train: &[Labelled<'_>],
    setup: &Setup<'_>,
) -> Result<(TrainPlan, Value)> {
    let args = setup.args;
    let batches: Vec<Vec<Example<'_>>> =
        train.chunks_exact(args.batch()).take(4).map(|c| c.iter().map(AsExample::example).collect()).collect();
    too_few("--stages auto", &batches, args.batch(), train.len())?;
    let config = optimizer(args, setup.sizes.lr);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    // What a worker may use: the budget, or the memory of the device the model runs on (the
    // system's, a GPU's free memory) shared among the plan's workers.
    let available = model.backend().memory_available().map_or(f64::INFINITY, |b| b as f64);
    let memory = |workers: usize| args.memory_budget.map_or(available / workers as f64, |mb| mb * 1e6);
    let mut best: Option<(TrainPlan, Vec<LayerCost>, f64)> = None;
    let mut refused = None;
    // The layers timed once for each number of threads a worker may have.
    let mut timed: std::collections::HashMap<usize, Vec<LayerCost>> = Default::default();
    for workers in 1..=cores.min(args.batch()) {
        let threads = (cores / workers).max(1);
        let costs = match timed.get(&threads) {
            Some(costs) => costs.clone(),
            None => {
                let costs = arbor::with_cpu_threads(threads, || {
                    model.layer_costs(&batches, config, (args.clip > 0.0).then_some(args.clip))
                })?;
                timed.entry(threads).or_insert(costs).clone()
            }
        };
        // Threads of one process: rows pass through shared memory, a hand-off costs a wake-up.
        let machine = Machine { workers, memory: memory(workers), bandwidth: 1e10, latency: 2e-5 };
        match planner::plan(&costs, args.batch(), args.schedule().kind(), &machine, None) {
            Ok(plan) if best.as_ref().is_none_or(|(b, ..)| plan.step_seconds < b.step_seconds) => {
                best = Some((plan, costs, machine.memory));
            }
            Ok(_) => {}
            Err(e) => refused = Some(e),
        }
    }
    let Some((plan, costs, budget)) = best else {
        return Err(refused.unwrap_or_else(|| Error::input("--stages auto", "a plan", "none")));
    };
    let predicted = plan.step_seconds * 1e3;
    let layers: Vec<String> =
        costs.iter().map(|c| format!("{:.0} + {:.1}", c.pass_seconds * 1e6, c.seconds * 1e6)).collect();
    eprintln!(
        "arbor: --stages auto: {} ({} layers a stage) × {}, {}, predicted {predicted:.2} ms a step \
         (layers measured at {} µs a pass + an example; {:.0} MB a worker at most of {:.0})",
        plural(plan.stages.len(), "stage"),
        plan.stages.iter().map(usize::to_string).collect::<Vec<_>>().join("+"),
        plural(plan.replicas, "replica"),
        plural(plan.micro_batches, "micro-batch"),
        layers.join(", "),
        plan.memory / 1e6,
        budget / 1e6,
    );
    let chosen = json!({
        "stages": plan.stages, "replicas": plan.replicas, "micro_batches": plan.micro_batches,
        "predicted_ms": predicted,
        "layer_us": costs.iter().map(|c| [c.pass_seconds * 1e6, c.seconds * 1e6]).collect::<Vec<_>>(),
    });
    Ok((plan, chosen))
}

/// The error for a training split too small to time: fewer than two whole minibatches of `batch`
/// (of 4 examples or more) in `batches`, cut from `examples` examples.
fn too_few(flag: &str, batches: &[Vec<Example<'_>>], batch: usize, examples: usize) -> Result<()> {
    if batches.len() >= 2 && batch >= 4 {
        return Ok(());
    }
    let expected = format!("a training split of two minibatches of 4 examples or more to time (--batch {batch})");
    Err(Error::input(flag, expected, plural(examples, "example")))
}
