//! A run never loses a checkpoint and never prints a wrong score (issue 42), through the `arbor`
//! binary: checkpoint folders are guarded (another run's checkpoints refused or overwritten on
//! request, one writer at a time, readers see whole checkpoints), memory is checked before it
//! is allocated, every split is scored honestly, flags a model ignores are refused, and errors
//! say what to fix.

use arbor::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn arbor<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_arbor")).args(args).output().expect("the arbor binary runs")
}

/// A fresh temporary folder, removed when dropped.
struct Temp(PathBuf);

impl Temp {
    fn new(name: &str) -> Temp {
        let dir = std::env::temp_dir().join(format!("arbor-safety-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).expect("the temporary folder can be created");
        Temp(dir)
    }

    /// `name` inside the folder, as a string.
    fn at(&self, name: &str) -> String {
        self.0.join(name).to_str().expect("temporary paths are UTF-8").to_string()
    }

    fn write(&self, name: &str, bytes: impl AsRef<[u8]>) {
        let path = self.0.join(name);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("a folder can be made");
        std::fs::write(path, bytes).expect("a temporary file can be written");
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// The one-line error of a run that must fail, checked to hold each of `words`.
fn refused<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S], words: &[&str]) -> String {
    let out = arbor(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{args:?} succeeded: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    let line = err.lines().last().unwrap_or_default().to_string();
    assert!(line.starts_with("arbor: ") || line.starts_with("error"), "{args:?}: {err}");
    for w in words {
        assert!(line.contains(w), "{args:?}: `{w}` not in `{line}`");
    }
    line
}

/// The summary JSON line of a run that must succeed, and its standard error.
fn run(args: &[&str]) -> (serde_json::Value, String) {
    let out = arbor(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{args:?}: {err}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    (serde_json::from_str(stdout.lines().last().expect("a summary line")).expect("the last line is JSON"), err)
}

fn summary(args: &[&str]) -> serde_json::Value {
    run(args).0
}

const SMALL: [&str; 6] = ["--hidden", "4", "--embed", "4", "--epochs", "1"];

/// `arbor train` at the small sizes of [`SMALL`], with `extra` flags (which replace a size
/// they name).
fn train(extra: &[&str]) -> Vec<String> {
    let mut args = vec!["train".to_string()];
    for pair in SMALL.chunks(2) {
        if !extra.contains(&pair[0]) {
            args.extend(pair.iter().map(|s| s.to_string()));
        }
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A SICK folder of `pairs` short sentence pairs per split (scores spread over 1..=5).
fn sick_folder(tmp: &Temp, name: &str, pairs: usize) {
    for split in ["train", "dev", "test"] {
        let line = |k: usize| ["a dog runs", "the cat sleeps", "a man plays"][k % 3].to_string();
        let files = [
            ("a.toks", (0..pairs).map(line).collect::<Vec<_>>()),
            ("b.toks", (0..pairs).map(|k| line(k + 1)).collect()),
            ("a.parents", vec!["2 3 0".to_string(); pairs]),
            ("b.parents", vec!["2 3 0".to_string(); pairs]),
            ("sim.txt", (0..pairs).map(|k| format!("{}", 1 + k % 5)).collect()),
        ];
        for (file, lines) in files {
            tmp.write(&format!("{name}/{split}/{file}"), lines.join("\n") + "\n");
        }
    }
}

/// A TU data set `X` of 8 small graphs (rings of 3 or 4 nodes) whose graph labels are `labels`.
fn tu_folder(tmp: &Temp, name: &str, labels: [i32; 8], bom: bool) {
    let (mut a, mut indicator, mut nodes) = (String::new(), String::new(), String::new());
    let mut first = 1;
    for g in 0..8 {
        let n = 3 + g % 2;
        for k in 0..n {
            let (u, v) = (first + k, first + (k + 1) % n);
            a += &format!("{u}, {v}\n{v}, {u}\n");
            indicator += &format!("{}\n", g + 1);
            nodes += &format!("{}\n", k % 2);
        }
        first += n;
    }
    let labels: String = labels.iter().map(|l| format!("{l}\n")).collect();
    let mark = if bom { "\u{feff}" } else { "" };
    for (file, text) in [("A", a), ("graph_indicator", indicator), ("graph_labels", labels), ("node_labels", nodes)] {
        tmp.write(&format!("{name}/X_{file}.txt"), format!("{mark}{text}"));
    }
}

/// The `"hidden"` a checkpoint recorded.
fn hidden_of(dir: &Path) -> u64 {
    Checkpoint::load(dir).expect("the checkpoint loads").meta["hidden"].as_u64().expect("a hidden size")
}

#[test]
fn a_folder_holding_another_run_is_refused_unless_resumed_or_overwritten() {
    let tmp = Temp::new("overwrite");
    let ck = tmp.at("ck");
    summary(&strs(&train(&["--max-steps", "5", "--checkpoint", &ck])));
    let second = train(&["--hidden", "8", "--max-steps", "5", "--checkpoint", &ck]);
    refused(&strs(&second), &["--checkpoint", "another run's checkpoints", "--overwrite"]);
    assert_eq!(hidden_of(&tmp.0.join("ck/last")), 4, "the refused run wrote into the folder");
    // --overwrite replaces the whole run: no `best/` or `last/` of the old one stays.
    summary(&[&strs(&second)[..], &["--overwrite"]].concat());
    assert_eq!(hidden_of(&tmp.0.join("ck/last")), 8);
    // Resuming without --checkpoint keeps saving where the run saved.
    let v = summary(&strs(&train(&["--hidden", "8", "--max-steps", "9", "--resume", &ck])));
    assert_eq!(v["steps"], 9, "{v}");
    assert_eq!(Checkpoint::load(&tmp.0.join("ck/last")).unwrap().meta["steps"], 9);
    // A resumed run may write into another, empty folder; not into one of a third run.
    let other = tmp.at("other");
    summary(&strs(&train(&["--hidden", "8", "--max-steps", "12", "--resume", &ck, "--checkpoint", &other])));
    assert_eq!(Checkpoint::load(&tmp.0.join("other/last")).unwrap().meta["steps"], 12);
    let again = train(&["--hidden", "8", "--max-steps", "15", "--resume", &ck, "--checkpoint", &other]);
    refused(&strs(&again), &["another run's checkpoints"]);
    refused(&strs(&train(&["--overwrite"])), &["--overwrite", "--checkpoint"]);
    refused(&strs(&train(&["--resume", &ck, "--checkpoint", &ck, "--overwrite"])), &["--overwrite"]);
}

/// Starts a long training run writing `last/` every step into `ck`.
fn spawn_writer(ck: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(train(&["--epochs", "1000", "--checkpoint", ck, "--checkpoint-every", "1"]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the arbor binary runs")
}

#[test]
fn one_writer_at_a_time_and_readers_see_whole_checkpoints() {
    let tmp = Temp::new("lock");
    let ck = tmp.at("ck");
    let mut writer = spawn_writer(&ck);
    let last = tmp.0.join("ck/last");
    let start = Instant::now();
    while !last.join("meta.json").exists() {
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint after 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let line = refused(&strs(&train(&["--checkpoint", &ck, "--overwrite"])), &["in use by arbor pid"]);
    assert!(line.contains(&writer.id().to_string()), "the holder is not named: {line}");
    // Every read while the writer commits a checkpoint per step gets a whole one.
    let mut steps = Vec::new();
    for _ in 0..200 {
        let ck = Checkpoint::load(&last).expect("a whole checkpoint");
        steps.push(ck.meta["steps"].as_u64().unwrap_or_default());
    }
    assert!(steps.first() < steps.last(), "the writer did not move: {steps:?}");
    writer.kill().ok();
    writer.wait().ok();
    // Its lock went with it: resuming the killed run is allowed.
    let v =
        summary(&strs(&train(&["--epochs", "1000", "--resume", &ck, "--max-steps", &format!("{}", steps[199] + 3)])));
    assert!(v["steps"].as_u64() >= Some(steps[199] + 1), "{v}");
}

#[test]
fn memory_is_checked_before_it_is_allocated() {
    let need = ["GiB", "available"];
    let tmp = Temp::new("memory");
    // One word heading 199,999 dependents: memory grows with the edges, so it trains.
    sick_folder(&tmp, "sick", 3);
    let n = 200_000;
    tmp.write("sick/train/a.toks", format!("{}\nthe cat sleeps\na man plays\n", vec!["w"; n].join(" ")));
    let heads: Vec<String> = (0..n).map(|t| if t == 0 { "0".into() } else { "1".into() }).collect();
    tmp.write("sick/train/a.parents", format!("{}\n2 3 0\n2 3 0\n", heads.join(" ")));
    let sick = tmp.at("sick");
    let (v, _) = run(&["train", "--model", "sick", "--data", &sick, "--epochs", "1", "--hidden", "4", "--embed", "4"]);
    assert!(v["steps"].as_u64() > Some(0), "{v}");
    sick_folder(&tmp, "sick", 3);
    refused(&["train", "--model", "sick", "--data", &sick, "--embed", "1000000000"], &["--embed", "GiB"]);
    tu_folder(&tmp, "tu", [0, 1, 0, 1, 0, 1, 0, 1], false);
    let tu = tmp.at("tu");
    for flags in [["--hidden", "1000000"], ["--embed", "100000000"], ["--steps", "1000000000"]] {
        refused(&[&["train", "--model", "ggnn", "--data", &tu, "--folds", "2"][..], &flags].concat(), &need);
    }
    refused(&["bench", "--model", "tree-fc", "--leaves", "100000000"], &["--leaves", "GiB", "available"]);
    refused(&["bench", "--sentences", "10000000000"], &["--sentences", "GiB"]);
    // Every layer's engine, every worker's replica and every pipeline stage costs memory of its own.
    refused(&strs(&train(&["--batch", "100000", "--workers", "50000"])), &["--workers", "GiB"]);
    refused(&strs(&train(&["--layers", "20000", "--stages", "20000"])), &["--layers, --stages", "GiB"]);
    refused(
        &strs(&train(&["--layers", "2", "--stages", "2", "--micro-batches", "1000000000"])),
        &["--micro-batches", "--batch 25"],
    );
    // Sizes that fit train.
    let (v, _) = run(&["train", "--model", "ggnn", "--data", &tu, "--folds", "2", "--epochs", "1", "--hidden", "4"]);
    assert!(v["cv_acc_mean"].as_f64().is_some(), "{v}");
}

#[test]
fn every_split_is_scored_honestly() {
    let tmp = Temp::new("scores");
    // `best/` that exists but cannot be read is an error, not a fallback to `last/`.
    let ck = tmp.at("ck");
    summary(&strs(&train(&["--checkpoint", &ck])));
    std::fs::remove_file(tmp.0.join("ck/best/meta.json")).unwrap();
    refused(&["eval", "--checkpoint", &ck], &["best", "meta.json"]);
    // An empty dev split: dev is null for one layer and stacks alike, test is scored at the last
    // epoch (with a warning), and `eval` agrees.
    let tree = "(3 (2 a) (3 b))\n(1 (2 a) (1 c))\n";
    for (file, text) in [("sst/train.txt", tree), ("sst/dev.txt", ""), ("sst/test.txt", tree)] {
        tmp.write(file, text);
    }
    let sst = tmp.at("sst");
    for (k, extra) in [&[][..], &["--layers", "2"], &["--layers", "2", "--stages", "2"]].iter().enumerate() {
        let ck = tmp.at(&format!("empty-dev-{k}"));
        let mut args = train(&["--data", &sst, "--epochs", "2"]);
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(["--checkpoint".into(), ck.clone()]);
        let (v, err) = run(&strs(&args));
        assert!(v["dev_acc"].is_null(), "{extra:?}: {v}");
        assert!(v["test_acc"].as_f64().is_some(), "{extra:?}: {v}");
        assert!(err.contains("no epoch had a finite dev score"), "{extra:?}: {err}");
        let out = arbor(&["eval", "--checkpoint", &ck]);
        let e: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii()).expect("eval's JSON");
        assert_eq!(e["test_acc"], v["test_acc"], "{extra:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("no epoch ended with a finite dev score"));
    }
    // --average with --max-steps: training and eval score the same (averaged) weights.
    let avg = tmp.at("avg");
    let v = summary(&strs(&train(&["--max-steps", "30", "--average", "0.9", "--checkpoint", &avg])));
    let e = summary(&["eval", "--checkpoint", &avg]);
    assert_eq!(e["test_acc"], v["test_acc"], "{e} after {v}");
    // A checkpoint meets data of other classes: refused, naming both.
    refused(&["eval", "--checkpoint", &avg, "--data", &sst], &["3 classes", "synthetic", "5 classes"]);
    sick_folder(&tmp, "sick", 6);
    refused(&["eval", "--checkpoint", &tmp.at("empty-dev-0"), "--data", &tmp.at("sick")], &["tree-lstm", "test.txt"]);
    // A TU set of one class is refused; with a byte-order mark it reads as without.
    tu_folder(&tmp, "one", [1; 8], true);
    refused(&["train", "--model", "ggnn", "--data", &tmp.at("one")], &["two classes", "one class"]);
    tu_folder(&tmp, "bom", [0, 1, 0, 1, 0, 1, 0, 1], true);
    let ggnn = ["train", "--model", "ggnn", "--folds", "2", "--epochs", "1", "--hidden", "4", "--seed", "3"];
    tu_folder(&tmp, "plain", [0, 1, 0, 1, 0, 1, 0, 1], false);
    let plain = summary(&[&ggnn[..], &["--data", &tmp.at("plain")]].concat());
    let marked = summary(&[&ggnn[..], &["--data", &tmp.at("bom")]].concat());
    assert_eq!(plain["cv_acc_mean"], marked["cv_acc_mean"]);
}

#[test]
fn a_resumed_epoch_reports_the_whole_epochs_loss_and_plots_no_nan() {
    let tmp = Temp::new("resume-loss");
    let epoch_loss = |err: &str| err.lines().find(|l| l.starts_with("epoch 1:")).map(str::to_string);
    let (_, straight) = run(&strs(&train(&["--checkpoint", &tmp.at("a")])));
    summary(&strs(&train(&["--checkpoint", &tmp.at("b"), "--max-steps", "70"])));
    let (_, resumed) = run(&strs(&train(&["--resume", &tmp.at("b")])));
    assert_eq!(epoch_loss(&resumed), epoch_loss(&straight), "{resumed}");
    // A NaN dev score (empty dev split) is left out of the plot.
    let tree = "(3 (2 a) (3 b))\n";
    for (file, text) in [("sst/train.txt", tree), ("sst/dev.txt", ""), ("sst/test.txt", tree)] {
        tmp.write(file, text);
    }
    let plot = tmp.at("curves.svg");
    summary(&strs(&train(&["--data", &tmp.at("sst"), "--epochs", "2", "--plot", &plot])));
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(!svg.contains("NaN") && svg.contains("<polyline"), "{svg}");
}

#[test]
fn sick_records_its_folder_in_full() {
    let tmp = Temp::new("sick-path");
    sick_folder(&tmp, "sick", 6);
    let ck = tmp.at("ck");
    let args = ["train", "--model", "sick", "--hidden", "4", "--embed", "4", "--epochs", "3", "--data"];
    let out = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(args)
        .args(["sick", "--checkpoint", &ck, "--max-steps", "1"])
        .current_dir(&tmp.0)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let recorded = Checkpoint::load(&tmp.0.join("ck/last")).unwrap().meta["data"].clone();
    assert_eq!(recorded.as_str().map(Path::new), Some(tmp.0.join("sick").canonicalize().unwrap().as_path()));
    // From another folder, eval finds it; --resume spelled `./sick/` is no mismatch.
    summary(&["eval", "--checkpoint", &ck]);
    let out = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(args)
        .args(["./sick/", "--resume", "ck", "--max-steps", "2"])
        .current_dir(&tmp.0)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn flags_a_model_ignores_are_refused() {
    let tmp = Temp::new("ignored");
    tu_folder(&tmp, "tu", [0, 1, 0, 1, 0, 1, 0, 1], false);
    sick_folder(&tmp, "sick", 3);
    let (tu, sick) = (tmp.at("tu"), tmp.at("sick"));
    let cases: [(&[&str], &str); 11] = [
        (&["--model", "var-lstm", "--loss", "all"], "--loss all"),
        (&["--model", "ggnn", "--data", &tu, "--distributed", "mpi"], "--distributed"),
        (&["--model", "ggnn", "--data", &tu, "--max-steps", "3"], "--max-steps"),
        (&["--model", "ggnn", "--data", &tu, "--lowercase"], "--lowercase"),
        (&["--model", "ggnn", "--data", &tu, "--loss", "root"], "--loss"),
        (&["--model", "sick", "--data", &sick, "--loss", "root"], "--loss"),
        (&["--model", "sick", "--data", &sick, "--folds", "3"], "--folds"),
        (&["--model", "sick", "--data", &sick, "--steps", "3"], "--steps"),
        (&["--folds", "3"], "--folds"),
        (&["--model", "child-sum", "--steps", "3"], "--steps"),
        (&["--model", "var-lstm", "--folds", "3"], "--folds"),
    ];
    for (flags, flag) in cases {
        let line = refused(&[&["train"][..], flags].concat(), &[flag, "a model that uses it"]);
        let model = flags.iter().skip_while(|f| **f != "--model").nth(1).unwrap_or(&"tree-lstm");
        assert!(line.contains(&format!("--model {model}")), "{line}");
    }
}

#[test]
fn errors_say_what_to_fix() {
    let tmp = Temp::new("messages");
    refused(&strs(&train(&["--dropout", "-0.1"])), &["--dropout", "a rate in [0, 1)", "-0.1"]);
    refused(&strs(&train(&["--clip", "-1"])), &["--clip", "-1"]);
    refused(&strs(&train(&["--timeout", "0", "--workers", "2"])), &["--timeout", "above 0"]);
    refused(&strs(&train(&["--lr-decay", "0"])), &["--lr-decay", "above 0 and at most 1"]);
    refused(&strs(&train(&["--patience", "0"])), &["--patience", "at least 1"]);
    refused(
        &strs(&train(&["--layers", "2", "--stages", "auto", "--workers", "2"])),
        &["--workers", "the planner chooses the replicas"],
    );
    // Resuming a SICK checkpoint as a tree model (and back) names both models.
    sick_folder(&tmp, "sick", 6);
    let (sick, sick_ck, tree_ck) = (tmp.at("sick"), tmp.at("sick-ck"), tmp.at("tree-ck"));
    let sick_args = ["train", "--model", "sick", "--data", &sick, "--hidden", "4", "--embed", "4", "--epochs", "2"];
    summary(&[&sick_args[..], &["--max-steps", "1", "--checkpoint", &sick_ck]].concat());
    summary(&strs(&train(&["--max-steps", "1", "--checkpoint", &tree_ck])));
    refused(&strs(&train(&["--epochs", "2", "--resume", &sick_ck])), &["--resume", "\"tree-lstm\"", "\"sick\""]);
    refused(&[&sick_args[..], &["--resume", &tree_ck]].concat(), &["--resume", "\"sick\"", "\"tree-lstm\""]);
    // A run killed during its first save left only a partial folder: nothing to resume.
    tmp.write("k9/.last.partial/model-x.safetensors", "");
    refused(&strs(&train(&["--resume", &tmp.at("k9")])), &["--resume", "complete checkpoint"]);
    // A file, or a link that leads nowhere, as the checkpoint folder.
    tmp.write("afile", "");
    refused(&strs(&train(&["--checkpoint", &tmp.at("afile")])), &["--checkpoint", "a file"]);
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(tmp.0.join("loop"), tmp.0.join("loop")).unwrap();
        refused(&strs(&train(&["--checkpoint", &tmp.at("loop")])), &["--checkpoint", "a link"]);
    }
    // Cased word vectors with --lowercase: `the` keeps its own line, `The` is counted as merged.
    let trees = "(3 (2 The) (3 film))\n";
    for split in ["train", "dev", "test"] {
        tmp.write(&format!("sst/{split}.txt"), trees);
    }
    tmp.write("vectors.txt", "\u{feff}The 1 1 1 1\nthe 2 2 2 2\nfilm 3 3 3 3\n");
    let glove = ["--data", &tmp.at("sst"), "--lowercase", "--embeddings", &tmp.at("vectors.txt"), "--max-steps", "1"];
    let (_, err) = run(&strs(&train(&glove)));
    assert!(err.contains("2 of 4 words have vectors") && err.contains("(1 case variant merged"), "{err}");
    // SICK text: a no-break space inside a word is part of it; bad UTF-8 and cycles name the
    // line and the token as the file counts them.
    sick_folder(&tmp, "odd", 3);
    tmp.write("odd/train/a.toks", "a dog\u{a0}x runs\nthe cat sleeps\na man plays\n");
    summary(&[
        "train",
        "--model",
        "sick",
        "--data",
        &tmp.at("odd"),
        "--hidden",
        "4",
        "--embed",
        "4",
        "--max-steps",
        "1",
    ]);
    tmp.write("odd/train/b.toks", b"a dog runs\nthe \xff sleeps\na man plays\n");
    refused(&["train", "--model", "sick", "--data", &tmp.at("odd")], &["b.toks:2:", "UTF-8"]);
    sick_folder(&tmp, "odd", 3);
    tmp.write("odd/dev/b.parents", "2 3 0\n2 4 0\n2 1 0\n");
    refused(&["train", "--model", "sick", "--data", &tmp.at("odd")], &["b.parents:2:", "head `4` of token 2"]);
    tmp.write("odd/dev/b.parents", "2 3 0\n2 3 0\n2 1 0\n");
    refused(&["train", "--model", "sick", "--data", &tmp.at("odd")], &["b.parents:3:", "token 1 lies on a cycle"]);
}
