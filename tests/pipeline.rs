//! Pipeline parallelism: the schedules (property-tested by simulation), 1F1B-flush against
//! gradient accumulation on one worker, and PipeDream-2BW against a single-process simulation of
//! its delayed-update rule.

use arbor::data::{synthetic, TreeExample, PAD};
use arbor::dist::pipeline::{PipeSettings, Stack, Stage};
use arbor::dist::schedule::{ops, simulate, Kind, Op};
use arbor::dist::{Collective, ThreadCollective};
use arbor::layers::LossOn;
use arbor::nn::Model;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::on_threads;
use arbor::{Backend, CpuBackend};
use proptest::prelude::*;
use std::time::Duration;

proptest! {
    /// Every stage runs every micro-batch's forward before its backward, holds at most `p − s`
    /// micro-batches, and every send meets its receive; 2BW needs at most two weight versions
    /// (and a flush only one).
    #[test]
    fn schedules_are_sound(p in 1usize..6, m in 1usize..9, t in 1usize..5, two_bw in any::<bool>()) {
        let kind = if two_bw { Kind::TwoBw } else { Kind::OneFOneBFlush };
        let per_stage: Vec<Vec<Op>> = (0..p).map(|s| ops(kind, s, p, t, m)).collect();
        for (s, list) in per_stage.iter().enumerate() {
            let mut fwd: Vec<usize> = list.iter().filter_map(|o| match o { Op::Forward(j) => Some(*j), _ => None }).collect();
            let mut bwd: Vec<usize> = list.iter().filter_map(|o| match o { Op::Backward(j) => Some(*j), _ => None }).collect();
            fwd.sort_unstable();
            bwd.sort_unstable();
            prop_assert_eq!(&fwd, &(0..t * m).collect::<Vec<_>>(), "stage {}", s);
            prop_assert_eq!(&bwd, &fwd, "stage {}", s);
        }
        let trace = simulate(&per_stage, m).map_err(TestCaseError::fail)?;
        prop_assert_eq!(trace.messages, 2 * (p - 1) * t * m);
        for s in 0..p {
            prop_assert!(trace.max_in_flight[s] <= p - s, "stage {} held {}", s, trace.max_in_flight[s]);
            let versions = trace.max_versions[s];
            match kind {
                Kind::OneFOneBFlush => prop_assert_eq!(versions, 1),
                Kind::TwoBw if m >= p => prop_assert!(versions <= 2, "stage {} held {} versions", s, versions),
                Kind::TwoBw => {}
            }
        }
    }
}

/// The simulation rejects broken schedules, so the property above can fail.
#[test]
fn simulation_catches_broken_schedules() {
    let good: Vec<Vec<Op>> = (0..2).map(|s| ops(Kind::OneFOneBFlush, s, 2, 1, 3)).collect();
    assert!(simulate(&good, 3).is_ok());
    let mut swapped = good.clone();
    swapped[1].swap(0, 2);
    assert!(simulate(&swapped, 3).unwrap_err().contains("expects micro-batch"));
    let mut early = good.clone();
    early[1] = vec![Op::Backward(0), Op::Forward(0), Op::Forward(1), Op::Backward(1), Op::Forward(2), Op::Backward(2)];
    assert!(simulate(&early, 3).unwrap_err().contains("before its forward"));
    let mut stuck = good;
    stuck[0].pop();
    assert!(simulate(&stuck, 3).is_err());
}

/// A two-layer stacked Tree-LSTM over the synthetic vocabulary.
fn stack() -> Stack {
    let vocab = synthetic::vocab().len();
    Stack::new(Model::TreeLstm, 2, 8, 10, vocab, Some(PAD), synthetic::CLASSES, &mut Rng::new(11))
        .expect("the stack builds")
}

/// Every learned value of a pipeline's stages, in stage order.
fn values(stages: &[Stack]) -> Vec<f32> {
    let mut out = Vec::new();
    for s in stages {
        if let Some(e) = &s.embed {
            out.extend(e.table());
        }
        s.layers.iter().chain(&s.out).for_each(|l| l.params.iter().for_each(|p| out.extend(p)));
    }
    out
}

fn plan(kind: Kind, micro_batches: usize, clip: Option<f32>) -> PipeSettings {
    PipeSettings { kind, micro_batches, epochs: 1, batch: 30, loss_on: LossOn::All, clip, max_steps: None }
}

fn optimizer() -> Config {
    Config::new(Rule::Adam, 0.01)
}

/// Trains `stack` cut into `stages` stages (one thread each) on `minibatches`; returns the parts.
fn pipelined(stages: usize, minibatches: &[Vec<&TreeExample>], plan: &PipeSettings) -> Vec<Stack> {
    pipelined_on(CpuBackend::new(), stages, minibatches, plan)
}

/// [`pipelined`] with every stage's engines on replicas of `backend`.
fn pipelined_on<B: Backend>(
    backend: B,
    stages: usize,
    minibatches: &[Vec<&TreeExample>],
    plan: &PipeSettings,
) -> Vec<Stack>
where
    Stage<B>: Send,
{
    let parts: Vec<Stage<B>> = stack()
        .split(stages)
        .expect("split")
        .into_iter()
        .map(|p| Stage::on(backend.replica().expect("a replica"), p, Optimizer::new(optimizer()), Rng::new(0)))
        .collect();
    on_threads(parts, Duration::from_secs(60), stages - 1, &mut |_| {}, |mut stage, coll, _| {
        stage.train(minibatches, plan, coll, &mut |_, _| {})?;
        Ok(stage.part)
    })
    .expect("the pipeline trains")
}

fn minibatches(data: &[TreeExample]) -> Vec<Vec<&TreeExample>> {
    data.chunks(30).map(|c| c.iter().collect()).collect()
}

fn max_relative(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (d / n).sqrt()
}

/// 1F1B with a flush over two stages equals accumulating the same micro-batches on one worker
/// (whose backend is held to one thread): bitwise without clipping, and to 1e-6 with the joint
/// norm clipped (the norm's partial sums are added in another order).
#[test]
fn one_f_one_b_equals_accumulation() {
    let data = synthetic::generate(120, 10, 5);
    let batches = minibatches(&data);
    for (clip, exact) in [(None, true), (Some(0.5), false)] {
        let p = plan(Kind::OneFOneBFlush, 3, clip);
        let two = values(&pipelined(2, &batches, &p));
        let one = values(&pipelined_on(CpuBackend::with_threads(1), 1, &batches, &p));
        assert_ne!(one, values(&[stack()]), "training changed nothing");
        if exact {
            assert!(two == one, "1F1B differs from accumulation by {}", max_relative(&two, &one));
        } else {
            let rel = max_relative(&two, &one);
            assert!(rel <= 1e-6, "clipped: relative difference {rel}");
        }
    }
}

/// PipeDream-2BW over two stages equals a single-process run of its rule: the gradient of
/// minibatch `t` taken at `W(t−1)` and applied to `W(t)`.
#[test]
fn two_bw_equals_the_delayed_update_rule() {
    let data = synthetic::generate(150, 10, 6);
    let batches = minibatches(&data);
    let p = plan(Kind::TwoBw, 3, None);
    let piped = values(&pipelined(2, &batches, &p));

    let mut coll = ThreadCollective::group(1, Duration::from_secs(10)).pop().expect("one worker");
    let mut current = Stage::new(stack(), Optimizer::new(optimizer()), Rng::new(0));
    let mut previous = stack();
    for b in &batches {
        let mut stale = Stage::new(previous, Optimizer::new(optimizer()), Rng::new(0));
        let g = stale.gradients(b, &p, &mut coll).expect("gradients at W(t-1)");
        previous = current.part.clone();
        current.update(g, None, &mut coll).expect("update of W(t)");
    }
    let simulated = values(&[current.part]);
    assert!(piped == simulated, "2BW differs from its rule by {}", max_relative(&piped, &simulated));
    let flushed = values(&pipelined(2, &batches, &plan(Kind::OneFOneBFlush, 3, None)));
    assert!(max_relative(&piped, &flushed) > 1e-4, "2BW should lag one version behind 1F1B");
    assert_eq!(coll.size(), 1);
}

/// Micro-batching changes only the summation order: accumulating micro-batches equals training
/// on the whole minibatch at once (SGD, so differences are not amplified).
#[test]
fn accumulated_micro_batches_equal_the_whole_minibatch() {
    let data = synthetic::generate(90, 10, 7);
    let batches = minibatches(&data);
    let train = |m: usize| {
        let mut stage = Stage::new(stack(), Optimizer::new(Config::new(Rule::Sgd { momentum: 0.9 }, 0.1)), Rng::new(0));
        let mut coll = ThreadCollective::group(1, Duration::from_secs(10)).pop().expect("one worker");
        stage.train(&batches, &plan(Kind::OneFOneBFlush, m, Some(5.0)), &mut coll, &mut |_, _| {}).expect("trains");
        values(&[stage.part])
    };
    let rel = max_relative(&train(4), &train(1));
    assert!(rel <= 1e-6, "relative difference {rel}");
}

/// Bad pipeline settings are refused with errors naming them.
#[test]
fn bad_pipeline_settings_are_refused() {
    let err = stack().split(3).err().expect("3 stages of 2 layers");
    assert!(err.to_string().contains("between 1 and the number of layers (2)"), "{err}");
    let data = synthetic::generate(30, 8, 1);
    let batches = minibatches(&data);
    let mut stage = Stage::new(stack(), Optimizer::new(optimizer()), Rng::new(0));
    let mut group = ThreadCollective::group(1, Duration::from_secs(1));
    let err = stage.train(&batches, &plan(Kind::OneFOneBFlush, 0, None), &mut group[0], &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("--micro-batches"), "{err}");
}
