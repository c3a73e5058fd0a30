//! Pipeline parallelism: the schedules (property-tested by simulation), 1F1B-flush against
//! gradient accumulation on one worker, and PipeDream-2BW against a single-process simulation of
//! its delayed-update rule.

use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, TreeExample, PAD, UNK};
use arbor::dist::schedule::{ops, simulate, Kind, MicroPass};
use arbor::dist::{Collective, ThreadCollective};
use arbor::head::softmax_classifier;
use arbor::layers::{Embedding, LossOn, WordDropout};
use arbor::model::{AsExample, Feed, Model};
use arbor::nn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::pipeline::{Part, PipeSettings, Stage};
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::trainer::{on_threads, Every};
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
        let per_stage: Vec<Vec<MicroPass>> = (0..p).map(|s| ops(kind, s, p, t, m)).collect();
        for (s, list) in per_stage.iter().enumerate() {
            let mut fwd: Vec<usize> = list.iter().filter_map(|o| match o { MicroPass::Forward(j) => Some(*j), _ => None }).collect();
            let mut bwd: Vec<usize> = list.iter().filter_map(|o| match o { MicroPass::Backward(j) => Some(*j), _ => None }).collect();
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
    let good: Vec<Vec<MicroPass>> = (0..2).map(|s| ops(Kind::OneFOneBFlush, s, 2, 1, 3)).collect();
    assert!(simulate(&good, 3).is_ok());
    let mut swapped = good.clone();
    swapped[1].swap(0, 2);
    assert!(simulate(&swapped, 3).unwrap_err().contains("expects micro-batch"));
    let mut early = good.clone();
    early[1] = vec![
        MicroPass::Backward(0),
        MicroPass::Forward(0),
        MicroPass::Forward(1),
        MicroPass::Backward(1),
        MicroPass::Forward(2),
        MicroPass::Backward(2),
    ];
    assert!(simulate(&early, 3).unwrap_err().contains("before its forward"));
    let mut stuck = good;
    stuck[0].pop();
    assert!(simulate(&stuck, 3).is_err());
}

/// A two-layer stacked Tree-LSTM over the synthetic vocabulary with a softmax classifier at
/// every vertex, as a model.
fn model() -> Model<CpuBackend> {
    let mut rng = Rng::new(11);
    let vocab = synthetic::vocab().len();
    let words = Embedding::new(vocab, 8, 0.1, &mut rng).with_padding(PAD);
    let (bottom, top) = (nn::tree_lstm(8, 10).expect("cell"), nn::tree_lstm(10, 10).expect("cell"));
    let head = softmax_classifier(10, synthetic::CLASSES).expect("head");
    Model::init(&CpuBackend::new(), words, bottom, vec![Feed::Words], head, &mut rng)
        .and_then(|m| m.with_readout(Readout::Vertices).stack(top, &mut rng))
        .expect("the model builds")
}

/// The parts of [`model`] for `stages` stages.
fn parts(stages: usize) -> Vec<Part> {
    Part::split(&model(), stages).expect("split")
}

/// Every learned value of a pipeline's stages, in stage order.
fn values(stages: &[Part]) -> Vec<f32> {
    stages.iter().flat_map(Part::values).collect()
}

/// How the stages run a minibatch, and the bound on the joint gradient norm.
struct Plan(PipeSettings, Option<f32>);

fn plan(kind: Kind, micro_batches: usize, clip: Option<f32>) -> Plan {
    Plan(PipeSettings { kind, micro_batches }, clip)
}

fn optimizer() -> Config {
    Config::new(Rule::Adam, 0.01)
}

/// Trains `parts` (one stage per thread) on `minibatches`; returns the trained parts.
fn pipelined<E: AsExample>(parts: Vec<Part>, minibatches: &[Vec<&E>], plan: &Plan) -> Vec<Part> {
    pipelined_on(CpuBackend::new(), parts, minibatches, plan)
}

/// [`pipelined`] with every stage's engines on replicas of `backend`.
fn pipelined_on<B: Backend, E: AsExample>(
    backend: B,
    parts: Vec<Part>,
    minibatches: &[Vec<&E>],
    plan: &Plan,
) -> Vec<Part>
where
    Stage<B>: Send,
{
    let stages = parts.len();
    let parts: Vec<Stage<B>> =
        parts.into_iter().map(|p| Stage::on(backend.replica().expect("a replica"), p, plan.0)).collect();
    on_threads(parts, Duration::from_secs(60), stages - 1, &mut |_| {}, |mut stage, coll, _| {
        stage.train(&mut Optimizer::new(optimizer()), minibatches, plan.1, coll, &mut |_, _| {})?;
        Ok(stage.into_part())
    })
    .expect("the pipeline trains")
}

/// Trees with a loss at every vertex.
fn labelled(data: &[TreeExample]) -> Vec<Labelled<'_>> {
    Labelled::all(data, LossOn::All, synthetic::CLASSES)
}

fn minibatches<E>(data: &[E]) -> Vec<Vec<&E>> {
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
    let data = labelled(&data);
    let batches = minibatches(&data);
    for (clip, exact) in [(None, true), (Some(0.5), false)] {
        let p = plan(Kind::OneFOneBFlush, 3, clip);
        let two = values(&pipelined(parts(2), &batches, &p));
        let one = values(&pipelined_on(CpuBackend::with_threads(1), parts(1), &batches, &p));
        assert_ne!(one, values(&parts(1)), "training changed nothing");
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
    let data = labelled(&data);
    let batches = minibatches(&data);
    let p = plan(Kind::TwoBw, 3, None);
    let piped = values(&pipelined(parts(2), &batches, &p));

    let mut coll = ThreadCollective::group(1, Duration::from_secs(10)).pop().expect("one worker");
    let mut current = Stage::new(parts(1).remove(0), p.0);
    let mut opt = Optimizer::new(optimizer());
    let mut previous = parts(1).remove(0);
    for b in &batches {
        let mut stale = Stage::new(previous, p.0);
        let g = stale.gradients(b, &mut coll).expect("gradients at W(t-1)");
        previous = current.part().clone();
        current.update(g, &mut opt, None, &mut coll).expect("update of W(t)");
    }
    let simulated = values(&[current.into_part()]);
    assert!(piped == simulated, "2BW differs from its rule by {}", max_relative(&piped, &simulated));
    let flushed = values(&pipelined(parts(2), &batches, &plan(Kind::OneFOneBFlush, 3, None)));
    assert!(max_relative(&piped, &flushed) > 1e-4, "2BW should lag one version behind 1F1B");
    assert_eq!(coll.size(), 1);
}

/// Micro-batching changes only the summation order: accumulating micro-batches equals training
/// on the whole minibatch at once (SGD, so differences are not amplified).
#[test]
fn accumulated_micro_batches_equal_the_whole_minibatch() {
    let data = synthetic::generate(90, 10, 7);
    let data = labelled(&data);
    let batches = minibatches(&data);
    let train = |m: usize| {
        let p = plan(Kind::OneFOneBFlush, m, Some(5.0));
        let mut stage = Stage::new(parts(1).remove(0), p.0);
        let mut opt = Optimizer::new(Config::new(Rule::Sgd { momentum: 0.9 }, 0.1));
        let mut coll = ThreadCollective::group(1, Duration::from_secs(10)).pop().expect("one worker");
        stage.train(&mut opt, &batches, p.1, &mut coll, &mut |_, _| {}).expect("trains");
        values(&[stage.into_part()])
    };
    let rel = max_relative(&train(4), &train(1));
    assert!(rel <= 1e-6, "relative difference {rel}");
}

/// Bad pipeline settings are refused with errors naming them.
#[test]
fn bad_pipeline_settings_are_refused() {
    let err = Part::split(&model(), 3).err().expect("3 stages of 2 layers");
    assert!(err.to_string().contains("between 1 and the number of layers (2)"), "{err}");
    let data = synthetic::generate(30, 8, 1);
    let data = labelled(&data);
    let batches = minibatches(&data);
    let mut stage = Stage::new(parts(1).remove(0), plan(Kind::OneFOneBFlush, 0, None).0);
    let mut group = ThreadCollective::group(1, Duration::from_secs(1));
    let mut opt = Optimizer::new(optimizer());
    let err = stage.train(&mut opt, &batches, None, &mut group[0], &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("--micro-batches"), "{err}");
}

/// Trains `model` one minibatch at a time as [`Model::step`] does (Adagrad, no clipping), with
/// the summed loss divided by the examples' [`AsExample::terms`] as the stages divide it;
/// returns its learned values as one part.
fn stepped<E: AsExample>(mut model: Model<CpuBackend>, minibatches: &[Vec<&E>]) -> Vec<f32> {
    let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
    for batch in minibatches {
        let examples: Vec<_> = batch.iter().map(|e| e.example()).collect();
        let terms = batch.iter().map(|e| e.terms()).sum();
        let mut grads = model.gradients(&examples, terms, None).expect("gradients");
        model.apply(&mut grads, &mut opt, None).expect("a step");
    }
    values(&Part::split(&model, 1).expect("one part"))
}

/// [`pipelined`] with Adagrad (as [`stepped`]) on `stages` stages of `model`.
fn piped<E: AsExample>(model: &Model<CpuBackend>, stages: usize, minibatches: &[Vec<&E>], m: usize) -> Vec<f32> {
    let p = plan(Kind::OneFOneBFlush, m, None);
    let parts: Vec<Stage> =
        Part::split(model, stages).expect("split").into_iter().map(|s| Stage::new(s, p.0)).collect();
    let trained = on_threads(parts, Duration::from_secs(60), stages - 1, &mut |_| {}, |mut stage, coll, _| {
        let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
        stage.train(&mut opt, minibatches, None, coll, &mut |_, _| {})?;
        Ok(stage.into_part())
    })
    .expect("the pipeline trains");
    values(&trained)
}

/// [`piped`] on `stages` stages each replicated `replicas` times (`stages × replicas` threads,
/// replica after replica), under `kind`; every replica's trained parts, replica after replica.
fn piped_replicas<E: AsExample>(
    model: &Model<CpuBackend>,
    (stages, replicas): (usize, usize),
    minibatches: &[Vec<&E>],
    (kind, m): (Kind, usize),
) -> Vec<Vec<f32>> {
    let p = plan(kind, m, Some(0.5));
    let parts = Part::split(model, stages).expect("split");
    let workers: Vec<Stage> =
        (0..replicas).flat_map(|_| parts.iter().map(|s| Stage::new(s.clone(), p.0).replicated(replicas))).collect();
    let trained = on_threads(workers, Duration::from_secs(60), stages - 1, &mut |_| {}, |mut stage, coll, _| {
        let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
        stage.train(&mut opt, minibatches, p.1, coll, &mut |_, _| {})?;
        Ok(stage.into_part())
    })
    .expect("the replicated pipeline trains");
    trained.chunks(stages).map(values).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Any P × W shape (P stages, each replicated on W workers that take shares of every
    /// minibatch and sum their gradients) trains as one pipeline of P stages does on the whole
    /// minibatch — 1F1B as one worker, 2BW as one 2BW pipeline — to rounding (the shares'
    /// gradients are summed in another order, and Adagrad's first steps divide a gradient by its
    /// own size, which grows that rounding where a gradient is near zero: 3e-7–1e-6 of the
    /// weights' norm as a rule, 1.3e-5 for 1 × 3 at seed 954, so 1e-4 here, where training moves
    /// them by ~40%), with the joint norm clipped; and every replica ends bitwise equal to the
    /// others.
    #[test]
    fn any_stages_times_replicas_trains_as_one_pipeline(
        stages in 1usize..=2,
        replicas in 2usize..=3,
        m in 1usize..=3,
        two_bw in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let kind = if two_bw { Kind::TwoBw } else { Kind::OneFOneBFlush };
        let m = if two_bw { m.max(stages) } else { m };
        let data = synthetic::generate(60, 8, seed);
        let data = labelled(&data);
        let batches: Vec<Vec<&Labelled<'_>>> = data.chunks(20).map(|c| c.iter().collect()).collect();
        let model = model();
        let alone = piped_replicas(&model, (stages, 1), &batches, (kind, m)).remove(0);
        let grid = piped_replicas(&model, (stages, replicas), &batches, (kind, m));
        prop_assert!(alone != values(&Part::split(&model, 1).expect("one part")), "training changed nothing");
        for (r, trained) in grid.iter().enumerate() {
            prop_assert!(trained == &grid[0], "replica {} differs from replica 0", r);
        }
        let rel = max_relative(&grid[0], &alone);
        prop_assert!(rel <= 1e-4, "{} × {} ({:?}, {} micro-batches): relative difference {}", stages, replicas, kind, m, rel);
    }
}

/// A model cut into pipeline stages trains as the model itself does with [`Model::step`]: one
/// stage and one micro-batch bitwise, two stages and three micro-batches up to the order of the
/// micro-batches' sums.
#[test]
fn a_model_in_stages_trains_as_the_model() {
    let data = synthetic::generate(90, 10, 8);
    let data = labelled(&data);
    let batches = minibatches(&data);
    let whole = stepped(model(), &batches);
    assert_ne!(whole, values(&parts(1)), "training changed nothing");
    assert!(piped(&model(), 1, &batches, 1) == whole, "one stage differs from Model::step");
    let rel = max_relative(&piped(&model(), 2, &batches, 3), &whole);
    assert!(rel <= 1e-5, "two stages: relative difference {rel}");
}

/// Word dropout (every word at rate 1/3) in stages drops what [`Model::step`] drops: one stage
/// bitwise, two stages up to rounding; and it does change training.
#[test]
fn word_dropout_in_stages_drops_what_the_model_drops() {
    let data = synthetic::generate(90, 10, 8);
    let data = labelled(&data);
    let batches = minibatches(&data);
    let dropping = || {
        let mut m = model();
        let every_word_once = vec![1; synthetic::vocab().len()];
        *m.embedding_mut() =
            m.embedding().clone().with_word_dropout(WordDropout::by_frequency(UNK, &every_word_once, 0.5));
        m
    };
    let whole = stepped(dropping(), &batches);
    assert!(max_relative(&whole, &stepped(model(), &batches)) > 1e-3, "word dropout changed nothing");
    assert!(piped(&dropping(), 1, &batches, 1) == whole, "one stage differs from Model::step");
    let rel = max_relative(&piped(&dropping(), 2, &batches, 3), &whole);
    assert!(rel <= 1e-5, "two stages: relative difference {rel}");
}

/// Tai et al.'s pair model with a second layer stacked on the child-sum cell (one of the test's
/// own: the sum of the children's states through a tanh layer), two dependency trees per SICK
/// example read at their roots, with word dropout (so the parent words drop with the words):
/// cut into two stages it trains as [`Model::step`] does, and put back together
/// ([`Part::join`]) it is the model again.
#[test]
fn a_pair_model_in_stages_trains_as_the_model() {
    use arbor::data::{data_dir, sick};
    use arbor::{Builder, Init};
    let data = sick::read_splits(&data_dir().join("sick"), true).expect("SICK data (ARBOR_DATA)");
    let (embed, hidden) = (8, 6);
    let model = || {
        let mut rng = Rng::new(5);
        let every_word_once = vec![1; data.vocab.len()];
        let words = Embedding::new(data.vocab.len(), embed, 0.1, &mut rng)
            .with_padding(PAD)
            .with_word_dropout(WordDropout::by_frequency(UNK, &every_word_once, 0.5));
        let cell = nn::child_sum_tree_lstm_nary(embed, hidden).expect("cell");
        let head = nn::relatedness_head(hidden, 7, sick::CLASSES).expect("head");
        let f = Builder::new("sum-tanh", 0);
        let (x, children) = (f.pull("x", hidden), f.gather_sum("h", hidden));
        let w = f.param("W", [hidden, hidden], Init::Xavier);
        let u = f.param("U", [hidden, hidden], Init::Xavier);
        let h = (x.matmul(w) + children.matmul(u) + f.param("b", [1, hidden], Init::Zeros)).tanh();
        f.scatter("h", h);
        f.push("h", h);
        Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words, Feed::ParentWords], head, &mut rng)
            .and_then(|m| m.stack(f.build()?, &mut rng))
            .expect("the pair model builds")
    };
    let pairs = &data.train[..75];
    let batches: Vec<Vec<&sick::Pair>> = pairs.chunks(25).map(|c| c.iter().collect()).collect();
    let whole = stepped(model(), &batches);
    assert_ne!(whole, values(&Part::split(&model(), 1).expect("one part")), "training changed nothing");
    let rel = max_relative(&piped(&model(), 2, &batches, 3), &whole);
    assert!(rel <= 1e-5, "two stages: relative difference {rel}");
    let mut joined = Part::join(Part::split(&model(), 2).expect("split"), &CpuBackend::new()).expect("join");
    let mut original = model();
    let (a, b) = (sick::predict(&mut joined, &data.dev[..50]), sick::predict(&mut original, &data.dev[..50]));
    assert_eq!(a.expect("joined"), b.expect("original"), "split and joined again, the model predicts otherwise");
}

/// A pipeline's stages trained in the one loop (`Run::fit`, PipeDream-2BW) with checkpoints
/// every 2 steps: stopped after 4 steps and resumed, they end bitwise where an uninterrupted run
/// ends (`last/` and `best/`), and what they write is a checkpoint of the whole model, named as
/// the model names its tensors — `Model::load` rebuilds it and scores test as the run did.
#[test]
fn stages_in_the_one_loop_checkpoint_and_resume_exactly() {
    use arbor::checkpoint::Checkpoint;
    use arbor::trainer::{fit_together, Run, Settings, Splits};
    let data = synthetic::generate(120, 10, 9);
    let data = labelled(&data);
    let (train, dev) = data.split_at(90);
    let splits = Splits { train, dev, test: dev };
    let root = std::env::temp_dir().join(format!("arbor-pipeline-run-{}", std::process::id()));
    std::fs::remove_dir_all(&root).ok();
    let fit = |name: &str, max_steps: Option<u64>, resume: bool| {
        let dir = root.join(name);
        let pipe = PipeSettings { kind: Kind::TwoBw, micro_batches: 2 };
        let mut runs: Vec<Run<Stage>> = parts(2)
            .into_iter()
            .map(|p| Run::new(Stage::new(p, pipe), Optimizer::new(optimizer()), &Rng::new(3)))
            .collect();
        let plan = Settings {
            checkpoint: Some(dir.clone()),
            checkpoint_every: Some(Every::Steps(2)),
            max_steps,
            ..Settings::new(2, 30)
        };
        if resume {
            let ck = Checkpoint::load(&dir.join("last")).expect("the stopped run's checkpoint");
            runs.iter_mut().for_each(|r| r.resume(&ck, &plan.meta).expect("resumes"));
            assert_eq!(runs[0].position().steps, 4);
        }
        fit_together(runs.iter_mut().collect(), Duration::from_secs(60), splits, &plan, &mut |_| {}).expect("trains");
        (dir, runs.pop().expect("a last stage").test_scores().clone())
    };
    let (whole, scores) = fit("whole", None, false);
    fit("stopped", Some(4), false);
    let (stopped, _) = fit("stopped", None, true);
    for kept in ["last", "best"] {
        let (a, b) = (Checkpoint::load(&whole.join(kept)), Checkpoint::load(&stopped.join(kept)));
        assert!(a.expect(kept).tensors == b.expect(kept).tensors, "{kept}/ differs after the resume");
    }
    let mut model = Model::load(&whole, &CpuBackend::new()).expect("the whole model loads");
    assert_eq!(model.score(dev).expect("scores"), scores, "the loaded model scores otherwise");
    std::fs::remove_dir_all(&root).ok();
}
