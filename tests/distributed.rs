//! Data parallelism on threads: a step over any number of workers equals one worker's step on
//! the whole minibatch; shards balance vertices; a worker that dies or hangs ends the others'
//! run with an error in bounded time.

use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, PAD, UNK};
use arbor::dist::data_parallel::{merge, shard};
use arbor::dist::{Collective, ThreadCollective};
use arbor::layers::{LossOn, WordDropout};
use arbor::model::{AsExample, Example, Model};
use arbor::nn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{on_threads, Event, Run, Settings, Splits};
use arbor::{CpuBackend, DropoutKey, Error, SparseGrad, VertexFn};
use proptest::prelude::*;
use std::time::{Duration, Instant};

/// The classifier of the synthetic treebank around `cell`, reading every vertex.
fn classifier(cell: VertexFn, seed: u64) -> Model<CpuBackend> {
    arbor::zoo::tree_classifier(cell, synthetic::vocab().len(), synthetic::CLASSES, LossOn::All, &mut Rng::new(seed))
        .expect("the classifier builds")
}

fn model(seed: u64) -> Model<CpuBackend> {
    classifier(nn::tree_lstm(8, 12).expect("the cell builds"), seed)
}

/// Every learned value of a model, by tensor.
fn values(m: &Model<CpuBackend>) -> Vec<(String, Vec<f32>)> {
    m.tensors().expect("tensors").into_iter().map(|(name, _, v)| (name, v)).collect()
}

/// The minibatches of `steps` steps of `batch` trees, with the loss on every vertex.
fn minibatches<'a>(data: &'a [Labelled<'_>], batch: usize, steps: usize) -> Vec<Vec<Example<'a>>> {
    data.chunks(batch).take(steps).map(|c| c.iter().map(Labelled::example).collect()).collect()
}

/// The loss-carrying vertices of each minibatch (the denominator of its mean loss).
fn terms(data: &[Labelled<'_>], batch: usize, steps: usize) -> Vec<usize> {
    data.chunks(batch).take(steps).map(|c| c.iter().map(AsExample::terms).sum()).collect()
}

/// Trains a replica of `start` for `steps` minibatches of `batch` trees of `data` on each of
/// `workers` threads, each step data-parallel ([`Model::step_shared`]); returns every worker's
/// model.
fn data_parallel(
    start: &Model<CpuBackend>,
    workers: usize,
    data: &[Labelled<'_>],
    (batch, steps): (usize, usize),
    opt: Config,
) -> Vec<Model<CpuBackend>> {
    let (batches, denoms) = (minibatches(data, batch, steps), terms(data, batch, steps));
    let states: Vec<Model<CpuBackend>> = (0..workers).map(|_| start.replica().expect("replica")).collect();
    on_threads(states, Duration::from_secs(30), 0, &mut |_| {}, |mut m, coll, _| {
        let mut o = Optimizer::new(opt);
        for (step, (b, &denom)) in batches.iter().zip(&denoms).enumerate() {
            m.step_shared(coll, b, denom, &mut o, Some(5.0), step as u64, None)?;
        }
        Ok(m)
    })
    .expect("every worker trains")
}

/// Largest `‖a − b‖ / ‖b‖` over the tensors.
fn relative(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f64 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| {
            let d: f64 = x.iter().zip(y).map(|(x, y)| f64::from(x - y).powi(2)).sum();
            let n: f64 = y.iter().map(|y| f64::from(*y).powi(2)).sum();
            (d / n.max(1e-30)).sqrt()
        })
        .fold(0.0, f64::max)
}

/// One worker through the data-parallel step is bitwise the plain training step.
#[test]
fn one_worker_is_bitwise_the_plain_step() {
    let data = synthetic::generate(120, 10, 7);
    let data = Labelled::all(&data, LossOn::All, synthetic::CLASSES);
    let opt = Config::new(Rule::Adam, 0.01);
    let mut plain = model(1);
    let mut o = Optimizer::new(opt);
    for (b, denom) in minibatches(&data, 20, 6).iter().zip(terms(&data, 20, 6)) {
        let mut grads = plain.gradients(b, denom, None).expect("gradients");
        assert!(plain.apply(&mut grads, &mut o, Some(5.0)).expect("step"), "the step was applied");
    }
    let dp = data_parallel(&model(1), 1, &data, (20, 6), opt);
    assert_eq!(values(&dp[0]), values(&plain));
}

/// Two and four workers end where one does (≤ 1e-6 relative: only the summation order of the
/// gradients differs), and every replica holds bitwise the same values.
#[test]
fn two_and_four_workers_equal_one() {
    let data = synthetic::generate(160, 10, 8);
    let data = Labelled::all(&data, LossOn::All, synthetic::CLASSES);
    let opt = Config::new(Rule::Sgd { momentum: 0.9 }, 0.1);
    let one = values(&data_parallel(&model(2), 1, &data, (40, 4), opt)[0]);
    for workers in [2, 4] {
        let replicas = data_parallel(&model(2), workers, &data, (40, 4), opt);
        let first = values(&replicas[0]);
        for r in &replicas[1..] {
            assert_eq!(values(r), first, "replicas of {workers} workers differ");
        }
        let rel = relative(&first, &one);
        assert!(rel <= 1e-6, "{workers} workers: relative difference {rel}");
        assert_ne!(first, values(&model(2)), "training changed nothing");
    }
}

/// With dropout (in the cell, and of words), two and four workers draw the masks one worker
/// draws (each tree's masks keyed by its place in the minibatch) and so end where it does; and
/// dropout does change training.
#[test]
fn workers_draw_the_dropout_masks_of_one() {
    let trees = synthetic::generate(160, 10, 9);
    let data = Labelled::all(&trees, LossOn::All, synthetic::CLASSES);
    let opt = Config::new(Rule::Sgd { momentum: 0.9 }, 0.1);
    let with_dropout = || {
        let cell = nn::CellKind::TreeLstm.cell_with_dropout(8, 12, nn::CellDropout::all(0.3)).expect("the cell builds");
        let mut m = classifier(cell, 3);
        m.cells_mut()[0].set_dropout_key(DropoutKey { seed: 11, ..DropoutKey::default() });
        let mut counts = vec![0; synthetic::vocab().len()];
        trees.iter().flat_map(|e| &e.words).for_each(|&w| counts[w as usize] += 1);
        *m.embedding_mut() = m.embedding().clone().with_word_dropout(WordDropout::by_frequency(UNK, &counts, 20.0));
        m
    };
    let one = values(&data_parallel(&with_dropout(), 1, &data, (40, 4), opt)[0]);
    let plain = values(&data_parallel(&model(3), 1, &data, (40, 4), opt)[0]);
    assert!(relative(&one, &plain) > 1e-3, "dropout changed nothing");
    for workers in [2, 4] {
        let replicas = data_parallel(&with_dropout(), workers, &data, (40, 4), opt);
        let first = values(&replicas[0]);
        for r in &replicas[1..] {
            assert_eq!(values(r), first, "replicas of {workers} workers differ");
        }
        let rel = relative(&first, &one);
        assert!(rel <= 1e-6, "{workers} workers with dropout: relative difference {rel}");
    }
}

proptest! {
    /// Shards are contiguous, cover every item once, and none exceeds an even share by more
    /// than one item.
    #[test]
    fn shards_balance_vertices(weights in prop::collection::vec(1usize..60, 0..40), n in 1usize..6) {
        let parts = shard(&weights, n);
        prop_assert_eq!(parts.len(), n);
        prop_assert_eq!(parts[0].start, 0);
        prop_assert_eq!(parts[n - 1].end, weights.len());
        for w in parts.windows(2) {
            prop_assert_eq!(w[0].end, w[1].start);
        }
        let total: usize = weights.iter().sum();
        let largest = weights.iter().copied().max().unwrap_or(0);
        for p in &parts {
            let load: usize = weights[p.clone()].iter().sum();
            prop_assert!(load <= total / n + largest, "{load} > {} + {largest}", total / n);
        }
    }
}

/// A peer that has stopped is reported at once; one that stays silent, after the timeout.
#[test]
fn dead_or_silent_peers_give_errors() {
    let mut group = ThreadCollective::group(2, Duration::from_secs(30));
    drop(group.pop());
    let start = Instant::now();
    let err = group[0].recv(1).expect_err("the peer is gone");
    assert_eq!(err.to_string(), "worker 0: worker 1 has stopped");
    assert!(start.elapsed() < Duration::from_secs(1));
    assert!(group[0].send(1, vec![1]).is_err());

    let mut group = ThreadCollective::group(2, Duration::from_millis(200));
    let start = Instant::now();
    let err = group[0].all_reduce_sum(&mut [1.0]).expect_err("the peer never answers");
    let waited = start.elapsed();
    assert_eq!(err.to_string(), "worker 0: worker 1 sent nothing for 0.2 s; giving up");
    assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(2), "{waited:?}");
}

/// All-reduces on threads sum in rank order whatever the rank (every worker ends bitwise the
/// same), finish in the order they started, reuse their buffers from step to step, and refuse contributions of another length.
#[test]
fn thread_all_reduces_sum_in_rank_order() {
    let sums = on_threads(vec![(); 3], Duration::from_secs(10), 0, &mut |_| {}, |_, coll, _| {
        let mut out = Vec::new();
        for step in 0..3 {
            // (1 − 1) + 1e-8 is 1e-8; any other order rounds the 1e-8 away against a 1.
            let mut x = [[1.0, -1.0, 1e-8][coll.rank()], step as f32 + coll.rank() as f32];
            let mut y = [coll.rank() as f32];
            coll.start_all_reduce(&x)?;
            coll.start_all_reduce(&y)?;
            coll.finish_all_reduce(&mut x)?;
            coll.finish_all_reduce(&mut y)?;
            out.push((x, y));
        }
        Ok(out)
    })
    .expect("every worker reduces");
    for (rank, s) in sums.iter().enumerate() {
        for (step, (x, y)) in s.iter().enumerate() {
            assert_eq!(*x, [1e-8, 3.0 * step as f32 + 3.0], "worker {rank}, step {step}");
            assert_eq!(*y, [3.0], "worker {rank}, step {step}");
        }
    }

    let err = on_threads(vec![(); 2], Duration::from_secs(10), 0, &mut |_| {}, |_, coll, _| {
        let mut x = vec![1.0; 2 + coll.rank()];
        coll.all_reduce_sum(&mut x)
    })
    .expect_err("lengths differ");
    assert_eq!(err.to_string(), "worker 0: expected 2 values from worker 1, got 3");
}

/// Sparse gradients merge by row: rows ascending and once each, a row's copies added in the
/// order given.
#[test]
fn sparse_gradients_merge_by_row() {
    let a = SparseGrad { rows: vec![5, 1], values: vec![1.0, 2.0, 3.0, 4.0] };
    let b = SparseGrad { rows: vec![1, 3, 1], values: vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0] };
    let m = merge(&[a, b], 2);
    assert_eq!(m.rows, [1, 3, 5]);
    assert_eq!(m.values, [3.0 + 10.0 + 50.0, 4.0 + 20.0 + 60.0, 30.0, 40.0, 1.0, 2.0]);
}

fn plan() -> Settings {
    Settings::new(1, 20)
}

/// Worker 0 of a two-worker run whose worker 1 fails at once or hangs: it must end with an
/// error, promptly. Returns that error, the group's error and how long worker 0 ran.
fn faulty_run(hang: bool) -> (Error, Error, Duration) {
    let data = synthetic::generate(100, 8, 9);
    let data = Labelled::all(&data, LossOn::All, synthetic::CLASSES);
    let splits = Splits { train: &data, dev: &data[..10], test: &data[..10] };
    let start = Run::new(model(3), Optimizer::new(Config::new(Rule::Adam, 0.01)), &Rng::new(4));
    let runs = vec![start.replica().expect("replica"), start];
    let seen = std::sync::Mutex::new(None);
    let group = on_threads(runs, Duration::from_millis(300), 0, &mut |_: Event| {}, |mut run, coll, report| {
        if coll.rank() == 1 {
            if hang {
                std::thread::sleep(Duration::from_secs(2));
                return Ok(());
            }
            return Err(Error::Worker { rank: 1, msg: "injected failure".into() });
        }
        let began = Instant::now();
        let result = run.fit(splits, &plan(), coll, report);
        *seen.lock().expect("lock") = Some((result.as_ref().err().cloned(), began.elapsed()));
        result.map(|_| ())
    });
    let (err, took) = seen.into_inner().expect("lock").expect("worker 0 ran");
    (err.expect("worker 0 fails"), group.expect_err("the run fails"), took)
}

/// A worker that fails makes the others stop with an error naming it, and the run reports the
/// failure itself rather than its consequence.
#[test]
fn a_dead_worker_stops_the_run() {
    let (err, group, took) = faulty_run(false);
    assert_eq!(err.to_string(), "worker 0: worker 1 has stopped");
    assert_eq!(group.to_string(), "worker 1: injected failure");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// A worker that hangs makes the others give up after the timeout.
#[test]
fn a_hung_worker_times_the_run_out() {
    let (err, group, took) = faulty_run(true);
    assert_eq!(err.to_string(), "worker 0: worker 1 sent nothing for 0.3 s; giving up");
    assert_eq!(group.to_string(), err.to_string());
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(2), "{took:?}");
}

/// A whole model (the SICK pair model: two trees per example, a head, no hand-written gradient)
/// on the one training loop: two and three workers end where one does (≤ 1e-5 relative), and
/// the run reports the test scores of its best dev epoch.
#[test]
fn a_pair_model_on_the_training_loop_with_workers_equals_one() {
    use arbor::data::sick;
    use arbor::layers::Embedding;
    use arbor::model::Feed;
    use arbor::trainer::fit_threads;
    let data = sick::read_splits(&arbor::data::data_dir().join("sick"), false).expect("the SICK splits read");
    let fresh = || {
        let mut rng = Rng::new(4);
        let words = Embedding::new(data.vocab.len(), 8, 0.1, &mut rng).with_padding(PAD);
        let (cell, head) =
            (nn::child_sum_tree_lstm_nary(8, 8).unwrap(), nn::relatedness_head(8, 10, sick::CLASSES).unwrap());
        Model::init(&CpuBackend::new(), words, cell, vec![Feed::Words, Feed::ParentWords], head, &mut rng)
            .expect("the pair model builds")
    };
    let splits = Splits { train: &data.train[..120], dev: &data.dev[..60], test: &data.test[..60] };
    let settings = Settings { epochs: 2, ..plan() };
    let run = |workers: usize| {
        let mut run = Run::new(fresh(), Optimizer::new(Config::new(Rule::Sgd { momentum: 0.9 }, 0.1)), &Rng::new(5));
        let summary = fit_threads(&mut run, workers, Duration::from_secs(60), splits, &settings, &mut |_| {})
            .expect("the run trains");
        let values: Vec<(String, Vec<f32>)> =
            run.model().tensors().expect("tensors").into_iter().map(|(n, _, v)| (n, v)).collect();
        (values, summary, run.test_scores().clone())
    };
    let (one, summary, scores) = run(1);
    assert_eq!(summary.sentences, 240);
    assert_eq!(scores.iter().map(|s| s.0.as_str()).collect::<Vec<_>>(), ["pearson", "spearman", "mse"]);
    assert!(scores.iter().all(|s| s.1.is_finite()), "{scores:?}");
    let start: Vec<(String, Vec<f32>)> = fresh().tensors().unwrap().into_iter().map(|(n, _, v)| (n, v)).collect();
    assert!(relative(&one, &start) > 1e-3, "training changed nothing");
    for workers in [2, 3] {
        let (many, _, their_scores) = run(workers);
        let rel = relative(&many, &one);
        assert!(rel <= 1e-5, "{workers} workers: relative difference {rel}");
        assert!((their_scores[0].1 - scores[0].1).abs() < 1e-3, "{their_scores:?} vs {scores:?}");
    }
}
