//! Choosing how a model's training spreads over workers, as PipeDream-2BW's planner does: `P`
//! pipeline stages of whole layers, each replicated on `W` data-parallel workers, a minibatch
//! cut into `W` shares and each share into `m` micro-batches — the shape and the stage
//! boundaries that give the shortest step within each worker's memory, from what each layer
//! costs ([`LayerCost`]) and what the machine is ([`Machine`]).
//!
//! The model of a step ([`step_seconds`]): a micro-batch of `b` examples takes `Σ (pass_seconds
//! + b·seconds)` of its stage's layers, plus, across each stage boundary, one message each way (the rows and
//! their gradients); a 1F1B pipeline with a flush runs `m + P − 1` micro-batch slots of its
//! slowest stage, 2BW `m` (no flush: the bubble is amortized); then every stage sums its
//! gradients over its `W` replicas (a ring all-reduce: `2(W−1)/W` of its parameters' bytes each
//! way and `2(W−1)` messages; of a table, the rows a minibatch touches), the slowest stage's
//! sum counted. Memory ([`stage_bytes`]): a
//! stage's parameters with their gradients and two optimizer state tensors (2BW keeps a second
//! weight version), and the values its in-flight micro-batches keep between their forward and
//! backward passes (`P − s` of them on stage `s`).

use crate::dist::schedule::Kind;
use arbor_core::error::{Error, Result};

/// What one layer costs (the word vectors count with the first layer, the head is a layer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerCost {
    /// Seconds of its forward and backward passes per example.
    pub seconds: f64,
    /// Seconds of its forward and backward passes over a micro-batch besides its examples'
    /// (planning, lowering, launches: what makes small batches of dynamic graphs slow).
    pub pass_seconds: f64,
    /// Bytes of its parameters.
    pub param_bytes: f64,
    /// Bytes of gradient its replicas sum each step: its parameters', or of a table only the
    /// rows a minibatch touches.
    pub sum_bytes: f64,
    /// Bytes it keeps per example between the forward and the backward pass.
    pub kept_bytes: f64,
    /// Bytes per example it passes to the next layer (and receives back as their gradient).
    pub output_bytes: f64,
}

/// The machine a plan is for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Machine {
    /// Workers available (threads, GPUs, MPI ranks).
    pub workers: usize,
    /// Bytes of memory each worker may use.
    pub memory: f64,
    /// Bytes per second between two workers.
    pub bandwidth: f64,
    /// Seconds a message takes besides its bytes.
    pub latency: f64,
}

/// How to train: stages, replicas, micro-batches, with the step time and memory predicted.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainPlan {
    /// The layers of each stage, first stage first (their sum is the model's layers).
    pub stages: Vec<usize>,
    /// Data-parallel replicas of every stage.
    pub replicas: usize,
    /// Micro-batches each replica cuts its share of a minibatch into.
    pub micro_batches: usize,
    /// The schedule.
    pub kind: Kind,
    /// Predicted seconds a step.
    pub step_seconds: f64,
    /// Predicted bytes of the fullest worker.
    pub memory: f64,
}

impl TrainPlan {
    /// Workers the plan uses: stages × replicas.
    pub fn workers(&self) -> usize {
        self.stages.len() * self.replicas
    }
}

/// One spread of training to price: stages (layers each), replicas, micro-batches, minibatch size.
#[derive(Clone, Copy, Debug)]
pub struct Spread<'a> {
    /// The layers of each stage.
    pub stages: &'a [usize],
    /// Replicas of every stage.
    pub replicas: usize,
    /// Micro-batches per replica's share.
    pub micro_batches: usize,
    /// Examples per minibatch.
    pub batch: usize,
    /// The schedule.
    pub kind: Kind,
}

impl Spread<'_> {
    /// Examples per micro-batch.
    fn micro(&self) -> f64 {
        self.batch as f64 / (self.replicas * self.micro_batches) as f64
    }
}

/// The layers of each stage as index ranges.
fn ranges(stages: &[usize]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    stages.iter().scan(0, |at, &n| {
        *at += n;
        Some(*at - n..*at)
    })
}

/// Seconds one micro-batch of `b` examples takes on the stage of `layers` (`last`: no boundary
/// after it).
fn stage_seconds(layers: &[LayerCost], b: f64, last: bool, machine: &Machine) -> f64 {
    let compute: f64 = layers.iter().map(|l| l.pass_seconds + b * l.seconds).sum();
    let out = layers.last().map_or(0.0, |l| l.output_bytes);
    compute + if last { 0.0 } else { 2.0 * (machine.latency + b * out / machine.bandwidth) }
}

/// Seconds a ring all-reduce of `bytes` over `w` workers takes.
fn all_reduce_seconds(bytes: f64, w: usize, machine: &Machine) -> f64 {
    if w < 2 {
        return 0.0;
    }
    let share = 2.0 * (w - 1) as f64 / w as f64;
    share * bytes / machine.bandwidth + 2.0 * (w - 1) as f64 * machine.latency
}

/// Predicted seconds of one step of `shape` over `layers` on `machine` (the module's model).
pub fn step_seconds(layers: &[LayerCost], shape: &Spread<'_>, machine: &Machine) -> f64 {
    let (p, b) = (shape.stages.len(), shape.micro());
    let slowest = ranges(shape.stages)
        .enumerate()
        .map(|(s, r)| stage_seconds(&layers[r], b, s + 1 == p, machine))
        .fold(0.0, f64::max);
    let slots = match shape.kind {
        Kind::OneFOneBFlush => shape.micro_batches + p - 1,
        Kind::TwoBw => shape.micro_batches,
    };
    let sums = ranges(shape.stages)
        .map(|r| all_reduce_seconds(layers[r].iter().map(|l| l.sum_bytes).sum(), shape.replicas, machine))
        .fold(0.0, f64::max);
    slots as f64 * slowest + sums
}

/// Predicted bytes of the worker holding stage `s` (of `p`) made of `layers`, with micro-batches
/// of `b` examples.
pub fn stage_bytes(layers: &[LayerCost], s: usize, p: usize, b: f64, kind: Kind) -> f64 {
    let versions = if kind == Kind::TwoBw { 2.0 } else { 1.0 };
    let params: f64 = layers.iter().map(|l| l.param_bytes).sum();
    let kept: f64 = layers.iter().map(|l| l.kept_bytes).sum();
    params * (versions + 3.0) + (p - s) as f64 * b * kept
}

/// The stage boundaries of `p` stages over `layers` for micro-batches of `b` examples that make
/// the slowest stage fastest with every stage within `machine.memory` (none: no cut fits),
/// by dynamic programming over (stages so far, layers so far).
fn partition(layers: &[LayerCost], p: usize, b: f64, kind: Kind, machine: &Machine) -> Option<Vec<usize>> {
    let n = layers.len();
    // best[k][j]: the slowest stage of the best cut of the first j layers into k stages, and
    // where its last stage starts.
    let mut best = vec![vec![(f64::INFINITY, 0usize); n + 1]; p + 1];
    best[0][0] = (0.0, 0);
    for k in 1..=p {
        for j in k..=n - (p - k) {
            for i in k - 1..j {
                let (before, _) = best[k - 1][i];
                let stage = &layers[i..j];
                if !before.is_finite() || stage_bytes(stage, k - 1, p, b, kind) > machine.memory {
                    continue;
                }
                let slowest = before.max(stage_seconds(stage, b, k == p, machine));
                if slowest < best[k][j].0 {
                    best[k][j] = (slowest, i);
                }
            }
        }
    }
    if !best[p][n].0.is_finite() {
        return None;
    }
    let (mut stages, mut j) = (Vec::with_capacity(p), n);
    for k in (1..=p).rev() {
        let i = best[k][j].1;
        stages.push(j - i);
        j = i;
    }
    stages.reverse();
    Some(stages)
}

/// The plan with the shortest predicted step for minibatches of `batch` examples under `kind`:
/// every number of stages up to the layers and the workers, every number of replicas that fits
/// beside them (each replica at least one example; only `replicas` where given), micro-batches
/// in powers of two (at least one per stage for 2BW, at most the examples of a share), the
/// boundaries that make the slowest stage fastest. Ties go to fewer workers. An error when no plan fits the
/// memory.
pub fn plan(
    layers: &[LayerCost],
    batch: usize,
    kind: Kind,
    machine: &Machine,
    replicas: Option<usize>,
) -> Result<TrainPlan> {
    let mut best: Option<TrainPlan> = None;
    for p in 1..=layers.len().min(machine.workers) {
        let most = (machine.workers / p).min(batch);
        for w in (1..=most).filter(|&w| replicas.is_none_or(|r| r == w)) {
            let share = batch.div_ceil(w);
            let first = if kind == Kind::TwoBw { p.next_power_of_two() } else { 1 };
            let micro = std::iter::successors(Some(first), |m| Some(m * 2)).take_while(|&m| m <= share);
            for m in micro {
                let b = batch as f64 / (w * m) as f64;
                let Some(stages) = partition(layers, p, b, kind, machine) else { continue };
                let shape = Spread { stages: &stages, replicas: w, micro_batches: m, batch, kind };
                let step = step_seconds(layers, &shape, machine);
                let memory = ranges(&stages)
                    .enumerate()
                    .map(|(s, r)| stage_bytes(&layers[r], s, p, b, kind))
                    .fold(0.0, f64::max);
                let better = best.as_ref().is_none_or(|q| step < q.step_seconds * (1.0 - 1e-9));
                if better {
                    best = Some(TrainPlan { stages, replicas: w, micro_batches: m, kind, step_seconds: step, memory });
                }
            }
        }
    }
    best.ok_or_else(|| {
        let need = stage_bytes(layers, 0, 1, 1.0, kind) / layers.len().max(1) as f64;
        Error::input(
            "a training plan",
            format!("a worker memory of at least about {need:.0} bytes (a layer and one example)"),
            format!("{:.0} bytes a worker", machine.memory),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(seconds: f64, param_bytes: f64) -> LayerCost {
        LayerCost {
            seconds,
            pass_seconds: 0.0,
            param_bytes,
            sum_bytes: param_bytes,
            kept_bytes: 1e3,
            output_bytes: 600.0,
        }
    }

    fn machine(workers: usize, memory: f64) -> Machine {
        Machine { workers, memory, bandwidth: 1e10, latency: 5e-6 }
    }

    #[test]
    fn one_worker_runs_the_whole_model_unpipelined() {
        let layers = vec![layer(1e-4, 1e6); 4];
        let p = plan(&layers, 64, Kind::OneFOneBFlush, &machine(1, 1e9), None).unwrap();
        assert_eq!((p.stages.clone(), p.replicas, p.micro_batches), (vec![4], 1, 1));
        assert!((p.step_seconds - 64.0 * 4e-4).abs() < 1e-12, "{p:?}");
        assert_eq!(p.memory, 4e6 * 4.0 + 64.0 * 4e3);
    }

    #[test]
    fn small_models_go_data_parallel_and_a_model_too_big_for_a_worker_is_cut() {
        // 10 KB a layer: summing gradients costs next to nothing, replicas beat a pipeline.
        let layers = vec![layer(1e-4, 1e4); 4];
        let p = plan(&layers, 64, Kind::OneFOneBFlush, &machine(8, 1e9), None).unwrap();
        assert_eq!((p.stages.len(), p.replicas), (1, 8), "{p:?}");
        // With one replica a stage, the same model runs as a pipeline of every worker it can use.
        let p = plan(&layers, 64, Kind::TwoBw, &machine(8, 1e9), Some(1)).unwrap();
        assert_eq!((p.stages, p.replicas), (vec![1, 1, 1, 1], 1));
        assert!(p.micro_batches >= 4, "2BW runs a micro-batch a stage at least");
        // 4 layers of 100 MB need 1.6 GB with their gradients and state: two fit in 1 GB; and
        // summing 100 MB over replicas costs more than the pipeline's bubble.
        let big = vec![layer(1e-4, 1e8); 4];
        let p = plan(&big, 64, Kind::OneFOneBFlush, &machine(8, 1e9), None).unwrap();
        assert!(p.stages.len() >= 2 && p.stages.iter().all(|&n| n <= 2), "{p:?}");
        assert!(p.memory <= 1e9 && p.workers() <= 8 && p.replicas == 1, "{p:?}");
        let e = plan(&big, 64, Kind::OneFOneBFlush, &machine(8, 1e8), None).unwrap_err().to_string();
        assert!(e.contains("memory"), "{e}");
    }

    #[test]
    fn boundaries_balance_unequal_layers() {
        // A slow top layer, memory for two layers a worker, two workers: the slow layer alone.
        let layers = [layer(1e-4, 1e8), layer(1e-4, 1e8), layer(1e-4, 1e8), layer(3e-4, 1e8)];
        let p = plan(&layers, 64, Kind::OneFOneBFlush, &machine(2, 9e8), None).unwrap();
        assert_eq!(p.stages, [2, 2], "two layers a worker at most: {p:?}");
        let p = plan(&layers, 64, Kind::OneFOneBFlush, &machine(2, 1.3e9), None).unwrap();
        assert_eq!(p.stages, [3, 1], "{p:?}");
    }

    #[test]
    fn the_model_counts_the_bubble_and_the_sums() {
        let layers = vec![layer(1e-4, 1e6); 2];
        let m = machine(4, 1e9);
        let shape = Spread { stages: &[1, 1], replicas: 2, micro_batches: 4, batch: 64, kind: Kind::OneFOneBFlush };
        let b = 8.0;
        let first = b * 1e-4 + 2.0 * (5e-6 + b * 600.0 / 1e10);
        let sums = 2.0 * 0.5 * 1e6 / 1e10 + 2.0 * 5e-6;
        let want = 5.0 * first + sums;
        assert!((step_seconds(&layers, &shape, &m) - want).abs() < 1e-12);
        let two_bw = Spread { kind: Kind::TwoBw, ..shape };
        assert!((step_seconds(&layers, &two_bw, &m) - (4.0 * first + sums)).abs() < 1e-12);
    }

    #[test]
    fn a_cost_per_pass_keeps_micro_batches_few() {
        // Without one, more micro-batches only shrink the bubble; with 1 ms a pass, each costs.
        let free = vec![layer(1e-4, 1e4); 2];
        let p = plan(&free, 64, Kind::OneFOneBFlush, &machine(2, 1e9), Some(1)).unwrap();
        assert!(p.stages.len() == 2 && p.micro_batches >= 16, "{p:?}");
        let fixed: Vec<LayerCost> = free.iter().map(|l| LayerCost { pass_seconds: 1e-3, ..*l }).collect();
        let p = plan(&fixed, 64, Kind::OneFOneBFlush, &machine(2, 1e9), Some(1)).unwrap();
        assert!(p.micro_batches <= 4, "{p:?}");
    }
}
