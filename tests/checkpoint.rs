//! Checkpoints of `arbor train` end to end: a run stopped mid-epoch and resumed equals an
//! uninterrupted one bit for bit (parameters and optimizer state, one worker or two), a process
//! killed while it persists a checkpoint leaves the previous one loadable and resumable, and a
//! corrupted checkpoint is refused with a one-line error that changes no file.

use arbor::checkpoint::Checkpoint;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Small sizes keep a debug build fast.
const SMALL: [&str; 4] = ["--hidden", "8", "--embed", "8"];
/// Optimizer steps in one epoch of the built-in synthetic treebank (4000 trees) at the default
/// `--batch 25`.
const EPOCH_STEPS: u64 = 160;

fn arbor(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_arbor")).args(args).output().expect("the arbor binary runs")
}

/// Runs `arbor train` with `args` and the small sizes; returns the summary JSON (the last line on
/// stdout), failing with the process's stderr if the run failed.
fn train(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["train"];
    all.extend(args);
    all.extend(SMALL);
    let out = arbor(&all);
    assert!(out.status.success(), "arbor {all:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_else(|| panic!("arbor {all:?} printed no summary line"));
    serde_json::from_str(last).unwrap_or_else(|e| panic!("arbor {all:?}: summary `{last}` is not JSON: {e}"))
}

/// A fresh temporary folder, removed when dropped (also when the test fails).
struct Temp(PathBuf);

impl Temp {
    fn new(name: &str) -> Temp {
        let dir = std::env::temp_dir().join(format!("arbor-checkpoint-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).expect("the temporary folder can be created");
        Temp(dir)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn s(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

fn load(dir: &Path) -> Checkpoint {
    Checkpoint::load(dir).unwrap_or_else(|e| panic!("{} does not load: {e}", dir.display()))
}

fn steps_of(ck: &Checkpoint) -> u64 {
    ck.meta["steps"].as_u64().unwrap_or_else(|| panic!("meta.json has no `steps`: {}", ck.meta))
}

/// A description of the first tensor whose name, shape or any value's bits differ between `a` and `b`.
fn first_difference(a: &Checkpoint, b: &Checkpoint) -> Option<String> {
    let names = |c: &Checkpoint| c.tensors.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
    if names(a) != names(b) {
        return Some(format!("tensor names differ: {:?} vs {:?}", names(a), names(b)));
    }
    for ((name, sa, va), (_, sb, vb)) in a.tensors.iter().zip(&b.tensors) {
        if sa != sb {
            return Some(format!("`{name}`: shape {sa:?} vs {sb:?}"));
        }
        if let Some(i) = va.iter().zip(vb).position(|(x, y)| x.to_bits() != y.to_bits()) {
            return Some(format!("`{name}`[{i}]: {} vs {}", va[i], vb[i]));
        }
    }
    None
}

/// Runs A (straight to 200 steps) and B (100 steps, then resumed to 200) with `extra` flags and
/// checks that their `last/` checkpoints are bitwise equal, parameters and optimizer state.
fn resume_is_exact(name: &str, extra: &[&str]) {
    let tmp = Temp::new(name);
    let (a, b) = (tmp.join("a"), tmp.join("b"));
    let run = |dir: &Path, max_steps: &str, resume: bool| {
        let mut args = vec!["--epochs", "2", "--max-steps", max_steps, "--checkpoint", s(dir)];
        if resume {
            args.extend(["--resume", s(dir)]);
        }
        args.extend(extra);
        train(&args)
    };
    // Step 100 is inside epoch 1; steps 101..200 cross the epoch boundary and stop inside epoch 2.
    const { assert!(100 < EPOCH_STEPS && EPOCH_STEPS < 200) };
    assert_eq!(run(&a, "200", false)["steps"], 200);
    assert_eq!(run(&b, "100", false)["steps"], 100);
    let halfway = load(&b.join("last"));
    assert_eq!(steps_of(&halfway), 100);
    assert_eq!(halfway.meta["position"]["epoch"], 1, "{}", halfway.meta);
    assert_eq!(halfway.meta["position"]["step_in_epoch"], 100, "{}", halfway.meta);
    assert_eq!(run(&b, "200", true)["steps"], 200);

    let (ca, cb) = (load(&a.join("last")), load(&b.join("last")));
    assert_eq!(steps_of(&ca), 200);
    assert_eq!(steps_of(&cb), 200);
    assert_eq!(ca.meta["position"], cb.meta["position"]);
    assert_eq!(ca.meta["position"]["epoch"], 2, "{}", ca.meta);
    assert_eq!(ca.meta["position"]["step_in_epoch"], 200 - EPOCH_STEPS, "{}", ca.meta);
    assert_eq!(ca.meta["best_dev_acc"], cb.meta["best_dev_acc"]);
    let optimizer = ca.tensors.iter().filter(|t| t.0.starts_with("opt.")).count();
    assert!(
        optimizer > 0,
        "no optimizer state in the checkpoint: {:?}",
        ca.tensors.iter().map(|t| &t.0).collect::<Vec<_>>()
    );
    assert!(ca.tensors.len() > optimizer, "no parameters in the checkpoint");
    let averaged = ca.tensors.iter().any(|t| t.0.starts_with("avg."));
    assert_eq!(averaged, extra.contains(&"--average"), "weight averages in the checkpoint: {averaged}");
    // The second half trained: the comparison below is not between two copies of step 100.
    assert!(first_difference(&halfway, &ca).is_some(), "steps 101..200 changed nothing");
    if let Some(diff) = first_difference(&ca, &cb) {
        panic!("200 uninterrupted steps and 100 + 100 resumed steps differ ({extra:?}): {diff}");
    }
}

/// The largest difference between `a`'s and `b`'s values, relative to `1 + |b|`, over the
/// tensors both hold (same names and shapes asserted).
fn largest_difference(a: &Checkpoint, b: &Checkpoint) -> (f32, String) {
    let names = |c: &Checkpoint| c.tensors.iter().map(|t| (t.0.clone(), t.1.clone())).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "the checkpoints hold other tensors");
    let mut worst = (0.0, String::new());
    for ((name, _, va), (_, _, vb)) in a.tensors.iter().zip(&b.tensors) {
        for (i, (x, y)) in va.iter().zip(vb).enumerate() {
            let d = (x - y).abs() / (1.0 + y.abs());
            if d > worst.0 {
                worst = (d, format!("`{name}`[{i}]: {x} vs {y}"));
            }
        }
    }
    worst
}

/// Elastic resume: 100 steps with `before`, resumed to 200 with `after`, against 200 straight
/// with `after`: the same data position and, to rounding (the workers' gradients are summed in
/// another order), the same parameters and optimizer state.
fn resumes_elsewhere(name: &str, before: &[&str], after: &[&str]) {
    let tmp = Temp::new(name);
    let (a, b) = (tmp.join("a"), tmp.join("b"));
    let run = |dir: &Path, max_steps: &str, resume: bool, flags: &[&str]| {
        let mut args = vec!["--epochs", "2", "--max-steps", max_steps, "--checkpoint", s(dir)];
        if resume {
            args.extend(["--resume", s(dir)]);
        }
        args.extend(flags);
        train(&args)
    };
    assert_eq!(run(&a, "200", false, after)["steps"], 200);
    assert_eq!(run(&b, "100", false, before)["steps"], 100);
    let resumed = run(&b, "200", true, after);
    assert_eq!(resumed["steps"], 200);
    let (ca, cb) = (load(&a.join("last")), load(&b.join("last")));
    let (pa, pb) = (&ca.meta["position"], &cb.meta["position"]);
    for key in ["epoch", "step_in_epoch", "epoch_rng"] {
        assert_eq!(pa[key], pb[key], "{key}: {pa} vs {pb}");
    }
    let loss = |p: &serde_json::Value| p["epoch_loss"].as_f64().expect("the epoch's loss so far");
    assert!((loss(pa) - loss(pb)).abs() < 1e-5 * loss(pa), "{pa} vs {pb}");
    let (worst, at) = largest_difference(&cb, &ca);
    assert!(worst < 1e-4, "{before:?} then {after:?} against {after:?} throughout: {worst:e} at {at}");
}

/// A checkpoint written before a run counted its epoch's examples (no
/// `position.examples_in_epoch`) resumes where its minibatches say — `step_in_epoch` of the run's
/// batch — bitwise as an uninterrupted run.
#[test]
fn a_checkpoint_without_the_examples_counted_resumes_exactly() {
    let tmp = Temp::new("old-position");
    let (a, b) = (tmp.join("a"), tmp.join("b"));
    let run = |dir: &Path, max_steps: &str, resume: bool| {
        let mut args = vec!["--epochs", "2", "--max-steps", max_steps, "--checkpoint", s(dir)];
        if resume {
            args.extend(["--resume", s(dir)]);
        }
        train(&args)
    };
    run(&a, "200", false);
    run(&b, "100", false);
    let mut halfway = load(&b.join("last"));
    let position = halfway.meta["position"].as_object_mut().expect("a position");
    assert_eq!(position.remove("examples_in_epoch"), Some(serde_json::json!(100 * 25)), "{position:?}");
    halfway.save(&b.join("last")).expect("the older checkpoint written");
    run(&b, "200", true);
    let (ca, cb) = (load(&a.join("last")), load(&b.join("last")));
    assert_eq!(steps_of(&cb), 200);
    assert!(ca.tensors == cb.tensors, "the resumed run ends elsewhere");
}

/// A checkpoint of two data-parallel workers resumes on one, and one of one on three.
#[test]
fn resume_on_another_number_of_workers() {
    resumes_elsewhere("elastic-2-1", &["--workers", "2"], &["--workers", "1"]);
    resumes_elsewhere("elastic-1-3", &["--workers", "1"], &["--workers", "3"]);
}

/// A checkpoint of a two-stage pipeline resumes unpipelined (the layers on one stage).
#[test]
fn a_pipelined_run_resumes_unpipelined() {
    resumes_elsewhere("elastic-pipe", &["--layers", "2", "--stages", "2"], &["--layers", "2"]);
}

/// An unpipelined checkpoint resumes as a two-stage 1F1B pipeline, and a two-stage one on three
/// stages: a pipeline that flushes every minibatch trains on the weights one stage would.
#[test]
fn a_run_resumes_pipelined_on_another_number_of_stages() {
    resumes_elsewhere("elastic-unpipe", &["--layers", "2"], &["--layers", "2", "--stages", "2"]);
    resumes_elsewhere("elastic-2-3", &["--layers", "3", "--stages", "2"], &["--layers", "3", "--stages", "3"]);
}

/// A pipeline whose stages are replicated (2 stages × 2 workers) checkpoints the whole model
/// once and resumes unpipelined on one worker, and a checkpoint of one worker resumes as 2 × 2,
/// as straight runs of the new shape train (elastic in both the stages and the replicas).
#[test]
fn a_replicated_pipeline_resumes_elsewhere_and_is_resumed() {
    let grid = ["--layers", "2", "--stages", "2", "--workers", "2"];
    resumes_elsewhere("elastic-2x2-1", &grid, &["--layers", "2"]);
    resumes_elsewhere("elastic-1-2x2", &["--layers", "2", "--workers", "3"], &grid);
}

/// 2BW's one-step-stale weights are part of what a checkpoint means: a 1F1B checkpoint does not
/// resume as 2BW (nor a 2BW one as another 2BW shape), and the refusal names the setting.
#[test]
fn a_checkpoint_resumes_as_2bw_only_from_the_same_2bw_run() {
    let tmp = Temp::new("elastic-2bw");
    let dir = tmp.join("a");
    let flushed = ["--layers", "2", "--stages", "2", "--max-steps", "20", "--checkpoint", s(&dir)];
    train(&flushed);
    let two_bw = ["--schedule", "2bw", "--micro-batches", "2", "--max-steps", "40", "--resume", s(&dir)];
    let mut args = vec!["train", "--layers", "2", "--stages", "2", "--checkpoint", s(&dir)];
    args.extend(two_bw);
    args.extend(SMALL);
    let out = arbor(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    let named = ["`stages`", "`schedule`", "`micro_batches`"].iter().any(|k| err.contains(k));
    assert!(!out.status.success() && named, "{err}");
}

/// `--checkpoint-every auto` (CheckFreq): the summary reports the interval chosen last and the
/// snapshots' measured share of the training time; snapshots taken whenever the measured times
/// say leave training as it was (a resumed run equals an uninterrupted one bit for bit).
#[test]
fn an_automatic_checkpoint_interval_is_reported_and_changes_nothing() {
    let tmp = Temp::new("auto-every");
    let dir = tmp.join("a");
    let v = train(&["--epochs", "2", "--max-steps", "100", "--checkpoint", s(&dir), "--checkpoint-every", "auto"]);
    let interval = v["checkpoint_every"].as_u64().unwrap_or_else(|| panic!("no interval in {v}"));
    let overhead = v["checkpoint_overhead"].as_f64().unwrap_or_else(|| panic!("no overhead in {v}"));
    assert!(interval >= 1 && overhead.is_finite() && overhead > 0.0, "{v}");
    assert_eq!(steps_of(&load(&dir.join("last"))), 100);
    // A fixed interval reports itself.
    let fixed =
        train(&["--epochs", "1", "--max-steps", "20", "--checkpoint", s(&tmp.join("b")), "--checkpoint-every", "4"]);
    assert_eq!(fixed["checkpoint_every"], 4, "{fixed}");
    resume_is_exact("exact-auto", &["--checkpoint-every", "auto", "--checkpoint-overhead", "0.2"]);
}

/// The interval an automatic cadence chose is kept in `last/`: a run resumed from it goes on at
/// that interval (reported though the run ends before its next snapshot) instead of measuring
/// afresh a few steps in.
#[test]
fn a_resumed_run_keeps_its_automatic_checkpoint_interval() {
    let tmp = Temp::new("auto-kept");
    let dir = tmp.join("a");
    let auto = ["--epochs", "2", "--checkpoint", s(&dir), "--checkpoint-every", "auto"];
    train(&[&auto[..], &["--max-steps", "100"]].concat());
    let kept = load(&dir.join("last")).meta["checkpoint_cadence"]["interval"].as_u64().expect("an interval kept");
    assert!(kept > 2, "snapshots cost more than a step: {kept}");
    let v = train(&[&auto[..], &["--max-steps", "102", "--resume", s(&dir)]].concat());
    assert_eq!(v["checkpoint_every"].as_u64(), Some(kept), "{v}");
}

/// Stopping at step 100 (mid-epoch) and resuming to step 200 (across an epoch boundary) gives
/// bitwise the same parameters and optimizer state as running straight to step 200.
#[test]
fn resume_mid_epoch_is_bitwise_exact() {
    resume_is_exact("exact-1", &[]);
}

/// As [`resume_mid_epoch_is_bitwise_exact`], with dropout (of rows, recurrent updates, vectors
/// and words): the resumed run draws the masks the uninterrupted one drew.
#[test]
fn resume_with_dropout_is_bitwise_exact() {
    let rates = ["--dropout", "0.3", "--input-dropout", "0.2", "--recurrent-dropout", "0.1", "--word-dropout", "0.5"];
    resume_is_exact("exact-dropout", &rates);
}

/// As [`resume_mid_epoch_is_bitwise_exact`], with two data-parallel workers in every run.
#[test]
fn resume_mid_epoch_is_bitwise_exact_with_two_workers() {
    resume_is_exact("exact-2", &["--workers", "2"]);
}

/// As [`resume_mid_epoch_is_bitwise_exact`], with a moving average of the weights on two
/// workers: the average is kept in `last/` and resumed.
#[test]
fn resume_with_a_weight_average_is_bitwise_exact() {
    resume_is_exact("exact-average", &["--average", "0.99", "--workers", "2"]);
}

/// As [`resume_mid_epoch_is_bitwise_exact`], for a stack of two layers with dropout and a
/// weight average on two workers: one stage of `--layers` trains by the same loop.
/// A learning rate that decays per epoch (`--lr-decay`): the resumed run trains epoch 2 at the
/// rate the uninterrupted one did.
#[test]
fn resume_with_a_decaying_learning_rate_is_bitwise_exact() {
    resume_is_exact("lr-decay", &["--lr-decay", "0.5"]);
}

/// `--patience` stops a run once dev has not improved for that many epochs; resuming the stopped
/// run is refused as having nothing left to train, unless the patience is raised.
#[test]
fn patience_stops_early_and_a_stopped_run_resumes_only_with_more() {
    let tmp = Temp::new("patience");
    let ck = tmp.join("p");
    let args = ["--epochs", "40", "--patience", "1", "--checkpoint", s(&ck)];
    let steps = train(&args)["steps"].as_u64().unwrap();
    assert!(steps < 40 * EPOCH_STEPS && steps.is_multiple_of(EPOCH_STEPS), "{steps} steps");
    let last = load(&ck.join("last"));
    let (epoch, best) = (last.meta["last_epoch"]["epoch"].as_u64(), last.meta["best_epoch"].as_u64());
    assert_eq!(epoch.zip(best).map(|(e, b)| e - b), Some(1), "{}", last.meta);
    let mut resume = vec!["train", "--epochs", "40", "--patience", "1", "--resume", s(&ck)];
    resume.extend(SMALL);
    let out = arbor(&resume);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("training left to do") && err.contains("--patience"), "{err}");
    let more =
        train(&["--epochs", "40", "--patience", "2", "--resume", s(&ck), "--max-steps", &(steps + 1).to_string()]);
    assert_eq!(more["steps"].as_u64(), Some(steps + 1));
}

#[test]
fn resume_of_a_stacked_model_is_bitwise_exact() {
    resume_is_exact("exact-layers", &["--layers", "2", "--dropout", "0.2", "--average", "0.99", "--workers", "2"]);
}

/// The tensor file `meta.json` in `dir` names now, if it can be read.
fn committed_file(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("meta.json")).ok()?;
    let meta: serde_json::Value = serde_json::from_str(&text).ok()?;
    meta["tensors_file"].as_str().map(String::from)
}

/// Tensor files in `dir` (finished or temporary) other than the committed one: a write in flight
/// or one cut short.
fn uncommitted_files(dir: &Path, committed: &str) -> Vec<String> {
    let entries = std::fs::read_dir(dir).map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
    entries
        .iter()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| (n.starts_with("model-") || n.starts_with(".model-")) && n != committed)
        .collect()
}

/// Kills (SIGKILL on Unix) a run in the middle of writing checkpoints, at several moments: the
/// previous checkpoint still loads, and a run resumes from it.
#[test]
fn kill_while_persisting_leaves_the_previous_checkpoint() {
    let mut interrupted = 0;
    // Each write pauses 200 ms between its tensor file and its meta.json; the kill comes this
    // long after a new tensor file appears (the last one after that write has committed).
    for (i, delay_ms) in [0u64, 100, 260].into_iter().enumerate() {
        let tmp = Temp::new(&format!("kill-{i}"));
        let ck = tmp.join("c");
        let last = ck.join("last");
        let log = std::fs::File::create(tmp.join("stderr.txt")).expect("a log file can be created");
        let mut args = vec!["train", "--checkpoint", s(&ck), "--checkpoint-every", "1", "--persist-pause-ms", "200"];
        args.extend(["--epochs", "1"]);
        args.extend(SMALL);
        let mut child = Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the arbor binary starts");
        let log_text = || std::fs::read_to_string(tmp.join("stderr.txt")).unwrap_or_default();
        // Wait for a committed checkpoint, then for the next write to put down its tensor file.
        let start = Instant::now();
        loop {
            if let Some(committed) = committed_file(&last) {
                if !uncommitted_files(&last, &committed).is_empty() {
                    break;
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("arbor ended ({status}) before a second checkpoint write began: {}", log_text());
            }
            if start.elapsed() > Duration::from_secs(120) {
                child.kill().ok();
                child.wait().ok();
                panic!("no second checkpoint write began within 120 s: {}", log_text());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().expect("the child can be killed");
        let status = child.wait().expect("the killed child can be waited for");
        assert!(!status.success(), "arbor finished before it was killed: {}", log_text());

        let committed = committed_file(&last).expect("meta.json survives the kill");
        if !uncommitted_files(&last, &committed).is_empty() {
            interrupted += 1;
        }
        let ck_killed = load(&last);
        let steps = steps_of(&ck_killed);
        assert!(steps >= 1, "delay {delay_ms} ms: the surviving checkpoint is at step {steps}");
        assert!(ck_killed.tensors.iter().any(|t| t.0.starts_with("opt.")), "no optimizer state at `last/`");

        let target = (steps + 2).to_string();
        let summary = train(&["--epochs", "1", "--checkpoint", s(&ck), "--resume", s(&ck), "--max-steps", &target]);
        assert_eq!(summary["steps"], steps + 2, "delay {delay_ms} ms: {summary}");
        let resumed = load(&last);
        assert_eq!(steps_of(&resumed), steps + 2);
        let committed = committed_file(&last).expect("the resumed run commits a checkpoint");
        let stale: Vec<_> =
            uncommitted_files(&last, &committed).into_iter().filter(|n| n.starts_with("model-")).collect();
        assert!(stale.is_empty(), "delay {delay_ms} ms: the resumed run left stale tensor files {stale:?}");
    }
    assert!(interrupted > 0, "no kill landed in the middle of a checkpoint write, so this test showed nothing");
}

/// Every file under `dir`, by path relative to `dir`, with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a readable folder entry").path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                out.insert(path.strip_prefix(root).expect("under the root").to_path_buf(), bytes);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// A checkpoint whose tensor file has one flipped byte is refused with a one-line checksum
/// error, and the refused resume writes, adds and removes nothing in the checkpoint folder.
#[test]
fn corrupted_checkpoint_is_refused_and_nothing_is_overwritten() {
    let tmp = Temp::new("corrupt");
    let ck = tmp.join("d");
    assert_eq!(train(&["--max-steps", "5", "--checkpoint", s(&ck)])["steps"], 5);
    let file = Checkpoint::tensors_path(&ck.join("last")).expect("last/ names its tensor file");
    let mut bytes = std::fs::read(&file).expect("the tensor file is readable");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&file, &bytes).expect("the tensor file is writable");
    let before = snapshot(&ck);
    assert!(before.keys().any(|p| p.ends_with("meta.json")), "{:?}", before.keys().collect::<Vec<_>>());

    let mut args = vec!["train", "--resume", s(&ck), "--checkpoint", s(&ck), "--max-steps", "10"];
    args.extend(SMALL);
    let out = arbor(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a corrupted checkpoint was accepted: {err}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let first = err.lines().next().unwrap_or_default();
    assert!(first.starts_with("arbor:") && first.contains("checksum mismatch"), "first line of stderr: {err}");
    assert!(first.contains(s(&file)), "the error names the corrupted file: {err}");

    let after = snapshot(&ck);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>(),
        "the refused resume added or removed files"
    );
    for (path, bytes) in &before {
        assert!(after[path] == *bytes, "the refused resume changed {}", path.display());
    }
}

/// The metadata is checksummed too: an edited `steps` in `meta.json` is refused.
#[test]
fn edited_metadata_is_refused() {
    let tmp = Temp::new("meta");
    let ck = tmp.join("m");
    train(&["--max-steps", "5", "--checkpoint", s(&ck)]);
    let meta = ck.join("last").join("meta.json");
    let text = std::fs::read_to_string(&meta).expect("meta.json is readable");
    assert!(text.contains("\"steps\":5"), "{text}");
    std::fs::write(&meta, text.replace("\"steps\":5", "\"steps\":6")).expect("meta.json is writable");
    let err = Checkpoint::load(&ck.join("last")).expect_err("the edited metadata loads").to_string();
    assert!(err.contains("meta.json") && err.contains("checksum mismatch"), "{err}");
}

/// Resuming with other settings (batch, seed, learning rates, dropout), or from a checkpoint without
/// optimizer state (`best/`), is refused with an error naming the reason.
#[test]
fn resume_refuses_other_settings_and_best_checkpoints() {
    let tmp = Temp::new("settings");
    let ck = tmp.join("r");
    train(&["--epochs", "1", "--checkpoint", s(&ck)]);
    let refused = |extra: &[&str]| {
        let mut args = vec!["train", "--resume"];
        args.extend(extra);
        args.extend(SMALL);
        let out = arbor(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let last = s(&ck);
    let err = refused(&[last, "--batch", "30"]);
    assert!(err.starts_with("arbor: resuming from a checkpoint with `batch` = 25"), "{err}");
    let err = refused(&[last, "--seed", "3"]);
    assert!(err.starts_with("arbor: resuming from a checkpoint with `seed` = 1"), "{err}");
    // A long setting shows only what differs: the learning rate inside the optimizer's.
    let err = refused(&[last, "--lr", "0.02"]);
    assert!(err.contains("`optimizer` = …lr: 0.01…") && err.contains("got …lr: 0.02…"), "{err}");
    // A flag recorded only as `null` when unused is still compared.
    let err = refused(&[last, "--embed-lr", "0.005"]);
    assert!(err.starts_with("arbor: resuming from a checkpoint with `embed_lr` = null"), "{err}");
    let err = refused(&[last, "--average", "0.99"]);
    assert!(err.starts_with("arbor: resuming from a checkpoint with `average` = null"), "{err}");
    // And the number of layers (`null` for one).
    let err = refused(&[last, "--layers", "2"]);
    assert!(err.starts_with("arbor: resuming from a checkpoint with `layers` = null"), "{err}");
    // So are the dropout rates, both ways.
    let err = refused(&[last, "--dropout", "0.1"]);
    assert!(err.starts_with("arbor: resuming from a checkpoint with `output_dropout` = null"), "{err}");
    let dropped = tmp.join("d");
    train(&["--epochs", "1", "--recurrent-dropout", "0.1", "--checkpoint", s(&dropped)]);
    let err = refused(&[s(&dropped), "--epochs", "2"]);
    assert!(err.starts_with("arbor: resuming from a checkpoint with `recurrent_dropout` = 0.1: "), "{err}");
    let best = ck.join("best");
    let err = refused(&[s(&best), "--epochs", "2"]);
    assert!(err.contains("a `best/` folder is for `arbor eval`"), "{err}");
}

/// The SICK pair model trains by the same loop: 20 steps, then resumed to 40 with two workers
/// in both runs, gives bitwise the checkpoint of 40 straight steps.
#[test]
fn a_pair_model_resumes_bitwise_exact() {
    let tmp = Temp::new("exact-sick");
    let data = arbor::data::data_dir().join("sick");
    let (a, b) = (tmp.join("a"), tmp.join("b"));
    let run = |dir: &Path, max_steps: &str, resume: bool| {
        let mut args = vec!["--model", "sick", "--data", s(&data), "--workers", "2", "--max-steps", max_steps];
        args.extend(["--checkpoint", s(dir)]);
        if resume {
            args.extend(["--resume", s(dir)]);
        }
        train(&args)
    };
    assert_eq!(run(&a, "40", false)["steps"], 40);
    let halfway = run(&b, "20", false);
    assert_eq!(halfway["steps"], 20);
    assert!(halfway["test_pearson"].as_f64().is_some(), "a run stopped inside an epoch is scored: {halfway}");
    assert_eq!(run(&b, "40", true)["steps"], 40);
    let (ca, cb) = (load(&a.join("last")), load(&b.join("last")));
    assert!(ca.tensors.iter().any(|t| t.0 == "head.W") && ca.tensors.iter().any(|t| t.0.starts_with("opt.")));
    if let Some(diff) = first_difference(&ca, &cb) {
        panic!("40 uninterrupted steps and 20 + 20 resumed steps differ: {diff}");
    }
}

/// Kills a run 20 times around the moment its first `best/` is written (each write pausing
/// 20 ms between its tensor file and its metadata): after every kill, `best/` is absent or whole,
/// and `arbor eval` reads the folder (its `best/`, else its `last/`).
#[test]
fn kills_around_the_first_best_leave_a_folder_eval_reads() {
    let mut inside = 0;
    for i in 0..20u64 {
        let tmp = Temp::new(&format!("kill-best-{i}"));
        let ck = tmp.join("c");
        let mut args = vec!["train", "--checkpoint", s(&ck), "--checkpoint-every", "1", "--persist-pause-ms", "20"];
        args.extend(["--epochs", "2", "--batch", "400"]);
        args.extend(SMALL);
        let mut child = Command::new(env!("CARGO_BIN_EXE_arbor"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the arbor binary starts");
        let (partial, best) = (ck.join(".best.partial"), ck.join("best"));
        let start = Instant::now();
        while !partial.exists() && !best.exists() {
            assert!(start.elapsed() < Duration::from_secs(120), "no best/ within 120 s");
            if let Ok(Some(status)) = child.try_wait() {
                panic!("arbor ended ({status}) before writing best/");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // From the write's start to well after it: 0, 3, …, 57 ms.
        std::thread::sleep(Duration::from_millis(3 * i));
        child.kill().ok();
        child.wait().ok();
        if partial.exists() {
            inside += 1;
        }
        if best.exists() {
            load(&best);
        }
        let out = arbor(&["eval", "--checkpoint", s(&ck)]);
        assert!(out.status.success(), "kill {i}: eval failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    assert!(inside > 0, "no kill landed while best/ was being written, so this test showed nothing");
}
