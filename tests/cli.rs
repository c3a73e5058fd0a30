//! The `arbor` command: the summary JSON line, and one-line errors with a non-zero exit.

use std::process::Command;

fn arbor(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_arbor")).args(args).output().expect("the arbor binary runs")
}

#[test]
fn train_prints_a_json_summary_last() {
    let out = arbor(&["train", "--epochs", "1", "--hidden", "8", "--embed", "8"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let last = stdout.lines().last().expect("a summary line");
    let v: serde_json::Value = serde_json::from_str(last).expect("the last line is JSON");
    for key in ["model", "epochs", "train_seconds", "sent_per_s", "dev_acc", "test_acc"] {
        assert!(v.get(key).is_some(), "missing {key} in {last}");
    }
    assert_eq!(v["model"], "tree-lstm");
    let acc = v["test_acc"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc));
}

#[test]
fn bad_input_gives_one_line_and_a_failure() {
    let bad: [&[&str]; 26] = [
        &["train", "--data", "/no/such/dir"],
        &["train", "--average", "1"],
        &["train", "--layers", "2", "--stages", "auto", "--workers", "2"],
        &["train", "--readout", "sum"],
        &["train", "--word-dropout=-1"],
        &["train", "--model", "sick", "--word-dropout", "0.25"],
        &["train", "--batch", "0"],
        &["train", "--dropout", "1"],
        &["train", "--dropout", "NaN"],
        &["train", "--model", "gin", "--every-step", "--dropout", "1"],
        &["train", "--model", "sick", "--input-dropout", "0.5"],
        &["train", "--model", "ggnn", "--recurrent-dropout", "0.25"],
        &["train", "--hidden", "x"],
        &["train", "--checkpoint-every", "soon"],
        &["train", "--checkpoint-overhead", "0"],
        &["train", "--batch", "soon"],
        &["train", "--batch", "auto", "--workers", "2"],
        &["train", "--batch", "auto", "--layers", "2", "--stages", "2"],
        &["train", "--model", "gin", "--batch", "auto"],
        &["train", "--per-step"],
        &["train", "--model", "ggnn", "--data", ".", "--per-step"],
        &["train", "--ensemble", "2"],
        &["train", "--model", "gin", "--ensemble", "0"],
        &["bench", "--precision", "bf16"],
        &["bench", "--precision", "f8"],
        &["bench", "--workers", "0"],
    ];
    for args in bad {
        let out = arbor(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.lines().next().is_some_and(|l| l.contains("error") || l.starts_with("arbor:")), "{args:?}: {err}");
    }
    let out = arbor(&["train", "--data", "/no/such/dir"]);
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), "arbor: /no/such/dir: not a directory");
    let out = arbor(&["train", "--dropout=-0.1"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dropout: expected a rate in [0, 1)"));
    let out = arbor(&["train", "--model", "ggnn"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--data DIR with a TU data set"));
    let out = arbor(&["train", "--every-step"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--every-step: expected a graph model"));
    let out = arbor(&["train", "--cycles", "6"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--cycles: expected a graph model"));
    let out = arbor(&["train", "--ensemble", "3"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ensemble: expected a graph model"));
    let out = arbor(&["train", "--model", "gin", "--data", ".", "--ensemble", "0"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ensemble: expected at least 1 model per fold"));
    let mutag = arbor::data::data_dir().join("mutag");
    let out = arbor(&["train", "--model", "gin", "--data", mutag.to_str().unwrap(), "--cycles", "2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--cycles: expected a cycle length of at least 3"));
    for model in ["gat", "tree-lstm"] {
        let out = arbor(&["train", "--model", model, "--data", ".", "--per-step"]);
        assert!(String::from_utf8_lossy(&out.stderr).contains("--per-step: expected --model gin"), "{model}");
    }
    let out = arbor(&["train", "--model", "ggnn", "--data", ".", "--plot", "x.svg"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--plot, which applies to tree and sequence models only"));
    if !arbor::cuda::is_available() {
        let out = arbor(&["bench", "--device", "cuda", "--sentences", "4"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.trim().starts_with("arbor: --device cuda: expected a usable CUDA device"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

#[test]
fn malformed_data_names_file_and_line() {
    let dir = std::env::temp_dir().join(format!("arbor-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("train.txt"), "(3 (2 a) (2 b))\n(3 (2 a) (7 b))\n").unwrap();
    std::fs::write(dir.join("dev.txt"), "(3 (2 a) (2 b))\n").unwrap();
    std::fs::write(dir.join("test.txt"), "(3 (2 a) (2 b))\n").unwrap();
    let out = arbor(&["train", "--data", dir.to_str().unwrap(), "--epochs", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    std::fs::remove_dir_all(&dir).ok();
    assert!(!out.status.success());
    assert!(err.contains("train.txt:2:") && err.contains("label `7`"), "{err}");
}

fn last_json(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().expect("a summary line")).expect("JSON")
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("arbor-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

const SMALL: [&str; 6] = ["--hidden", "3", "--embed", "3", "--lr", "0.002"];

/// `arbor eval` of `best/` gives the test accuracy training reported, also when training
/// scored a moving average of the weights, for a stack of two layers, and for two layers
/// trained in two pipeline stages (with a weight average).
#[test]
fn eval_reproduces_the_checkpoint_accuracy_exactly() {
    let ck = temp("eval");
    let pipelined = ["--layers", "2", "--stages", "2", "--average", "0.9"];
    for extra in [&[][..], &["--average", "0.9"], &["--layers", "2", "--dropout", "0.1"], &pipelined] {
        std::fs::remove_dir_all(&ck).ok();
        let mut args = vec!["train", "--epochs", "1", "--checkpoint", ck.to_str().unwrap()];
        args.extend(SMALL);
        args.extend(extra);
        let trained = last_json(&arbor(&args));
        let evaluated = last_json(&arbor(&["eval", "--checkpoint", ck.to_str().unwrap()]));
        let acc = trained["test_acc"].as_f64().unwrap();
        assert!(acc < 1.0, "the tiny model should not be perfect ({acc}), or this test shows nothing");
        assert_eq!(trained["test_acc"], evaluated["test_acc"], "{extra:?}");
        assert_eq!(trained["layers"], evaluated["layers"], "{extra:?}");
    }
    // A corrupted tensor file is refused with a checksum error.
    let file = arbor::checkpoint::Checkpoint::tensors_path(&ck.join("best")).unwrap();
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let out = arbor(&["eval", "--checkpoint", ck.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("checksum mismatch"));
    std::fs::remove_dir_all(&ck).ok();
}

/// One epoch, then a second resumed from its checkpoint, ends bitwise where two uninterrupted
/// epochs end: for one model, and for two layers in two pipeline stages (PipeDream-2BW).
#[test]
fn resume_continues_exactly() {
    let (full, half) = (temp("full"), temp("half"));
    let pipelined = ["--layers", "2", "--stages", "2", "--schedule", "2bw", "--micro-batches", "2"];
    for extra in [&[][..], &pipelined] {
        let run = |epochs: &str, dir: &std::path::Path, resume: bool| {
            let mut args = vec!["train", "--epochs", epochs, "--checkpoint", dir.to_str().unwrap()];
            if resume {
                args.extend(["--resume", dir.to_str().unwrap()]);
            }
            args.extend(SMALL);
            args.extend(extra);
            last_json(&arbor(&args))
        };
        std::fs::remove_dir_all(&full).ok();
        std::fs::remove_dir_all(&half).ok();
        run("2", &full, false);
        run("1", &half, false);
        run("2", &half, true);
        let a = std::fs::read(arbor::checkpoint::Checkpoint::tensors_path(&full.join("last")).unwrap()).unwrap();
        let b = std::fs::read(arbor::checkpoint::Checkpoint::tensors_path(&half.join("last")).unwrap()).unwrap();
        assert!(a == b, "{extra:?}: parameters after 1 + 1 resumed epochs differ from 2 uninterrupted epochs");
    }
    std::fs::remove_dir_all(&full).ok();
    std::fs::remove_dir_all(&half).ok();
}

#[test]
fn plot_writes_both_curves() {
    let dir = temp("plot");
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("curves.svg");
    let mut args = vec!["train", "--epochs", "3", "--plot", svg.to_str().unwrap()];
    args.extend(SMALL);
    last_json(&arbor(&args));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    assert_eq!(text.matches("<polyline").count(), 2);
    assert_eq!(text.matches("<circle").count(), 6, "three epochs on two curves");
    assert!(text.contains("training loss") && text.contains("dev root accuracy"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Pipelined runs: a two-stage run prints its layout in the summary, one with dropout reaches
/// test accuracy 0.95 in two epochs with micro-batches defaulting to 4; one stage of two layers
/// trains data-parallel (no micro-batches, two workers); bad pipeline settings get one-line
/// errors that name them.
#[test]
fn pipeline_flags() {
    let small = ["train", "--hidden", "8", "--embed", "8", "--max-steps", "8", "--layers", "2"];
    let out = arbor(&[&small[..], &["--stages", "2", "--schedule", "2bw", "--micro-batches", "2"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!((v["stages"].as_u64(), v["layers"].as_u64(), v["steps"].as_u64()), (Some(2), Some(2), Some(8)));
    assert_eq!(v["schedule"], "2bw");
    // One stage is no pipeline: the stack trains by the data-parallel loop, on two workers here.
    let out = arbor(&[&small[..], &["--workers", "2"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8(out.stdout).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!((v["layers"].as_u64(), v["workers"].as_u64(), v["steps"].as_u64()), (Some(2), Some(2), Some(8)), "{v}");
    assert!(v.get("micro_batches").is_none() && v.get("stages").is_none(), "{v}");
    // A stacked model with dropout (of rows, recurrent updates, vectors and words) in two stages
    // learns the synthetic treebank.
    let out = arbor(&[
        "train",
        "--layers",
        "2",
        "--stages",
        "2",
        "--dropout",
        "0.1",
        "--input-dropout",
        "0.1",
        "--recurrent-dropout",
        "0.1",
        "--word-dropout",
        "0.25",
        "--epochs",
        "2",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8(out.stdout).unwrap().lines().last().unwrap()).unwrap();
    assert!(v["test_acc"].as_f64().is_some_and(|a| a >= 0.95), "{v}");
    assert_eq!(v["micro_batches"].as_u64(), Some(4), "{v}");
    for (extra, says) in [
        (&["--stages", "3"][..], "between 1 and the number of layers (2)"),
        (&["--stages", "2", "--schedule", "2bw", "--micro-batches", "1"], "at least the number of stages (2) for 2BW"),
        (&["--stages", "auto", "--workers", "2"], "the planner chooses the replicas"),
        (&["--micro-batches", "2"], "--stages above 1"),
        (&["--schedule", "2bw"], "--stages above 1"),
        (&["--timeout", "inf"], "--timeout"),
    ] {
        let out = arbor(&[&small[..], extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.starts_with("arbor: ") && err.contains(says) && err.lines().count() == 1, "{extra:?}: {err}");
    }
}

/// `--batch auto` times a step, says how, and trains with a batch chosen as it goes: the summary
/// reports the trajectory from 25, the checkpoint records `batch` as `auto` and the state of the
/// choice, a resumed run takes the checkpoint's timing instead of timing again; what it cannot
/// measure one model's noise in is refused by name.
#[test]
fn batch_auto_reports_its_trajectory() {
    let dir = std::env::temp_dir().join(format!("arbor-cli-batch-auto-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let ck = dir.to_str().unwrap();
    let out =
        arbor(&["train", "--hidden", "8", "--embed", "8", "--epochs", "2", "--batch", "auto", "--checkpoint", ck]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("--batch auto: from 25") && err.contains("ms an example"), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    let trajectory = v["batch_trajectory"].as_array().unwrap_or_else(|| panic!("no trajectory: {v}"));
    assert_eq!(trajectory[0], serde_json::json!([0, 25]), "{v}");
    assert!(trajectory.iter().all(|p| p[1].as_u64().is_some_and(|b| (3..=400).contains(&b))), "{v}");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("last").join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["batch"], "auto");
    assert_eq!(meta["batch_size"]["trajectory"].as_array().map(Vec::len), Some(trajectory.len()), "{meta}");
    // Resumed, it goes on with the checkpoint's step-time model and times nothing.
    let out = arbor(&["train", "--hidden", "8", "--embed", "8", "--epochs", "3", "--batch", "auto", "--resume", ck]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("a step timed at"), "{err}");
    let ms = meta["batch_size"]["settings"]["pass_seconds"].as_f64().unwrap() * 1e3;
    assert!(err.contains(&format!("the checkpoint's step-time model ({ms:.2} ms")), "{err}");
    std::fs::remove_dir_all(&dir).ok();
    for (extra, says) in [
        (&["--workers", "2"][..], "--workers: expected one worker and one stage with --batch auto"),
        (&["--layers", "2", "--stages", "2"], "--stages: expected one worker and one stage"),
        (&["--model", "sick"], "--batch auto: expected a model that uses it"),
    ] {
        let out = arbor(&[&["train", "--batch", "auto"][..], extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{extra:?}: {err}");
    }
}

/// `--stages auto` times the layers, prints the plan it chose (stages, micro-batches, the
/// predicted step) and keeps it in the checkpoint, then trains that shape; a memory budget no
/// layer fits is an error that says so, and the flags the planner sets are refused beside it.
#[test]
fn stages_auto_plans_the_pipeline() {
    let dir = std::env::temp_dir().join(format!("arbor-cli-auto-{}", std::process::id()));
    let small = ["train", "--hidden", "8", "--embed", "8", "--max-steps", "8", "--layers", "2", "--stages", "auto"];
    let out = arbor(&[&small[..], &["--checkpoint", dir.to_str().unwrap()]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("--stages auto: ") && err.contains("predicted") && err.contains("a step"), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(String::from_utf8(out.stdout).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!(v["steps"].as_u64(), Some(8), "{v}");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("last").join("meta.json")).unwrap()).unwrap();
    let chosen = &meta["stages_auto"];
    let stages: Vec<u64> = chosen["stages"].as_array().unwrap().iter().filter_map(|s| s.as_u64()).collect();
    assert_eq!(stages.iter().sum::<u64>(), 2, "{chosen}");
    assert_eq!(v["stages"].as_u64().unwrap_or(1), stages.len() as u64, "the run has the planned stages: {v}");
    let replicas = chosen["replicas"].as_u64().unwrap_or_else(|| panic!("no replicas planned: {chosen}"));
    let workers = stages.len() as u64 * replicas;
    assert_eq!(v["workers"].as_u64(), Some(workers), "the run has the planned workers: {v}");
    assert!(chosen["predicted_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{chosen}");
    std::fs::remove_dir_all(&dir).ok();
    for (extra, says) in [
        (&["--memory-budget", "0.001"][..], "worker memory"),
        (&["--micro-batches", "2"], "the planner chooses them"),
        (&["--workers", "2"], "the planner chooses the replicas"),
    ] {
        let out = arbor(&[&small[..], extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.starts_with("arbor: ") && err.contains(says), "{extra:?}: {err}");
    }
    let out = arbor(&["train", "--memory-budget", "100"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--stages auto"), "the budget is the planner's");
}

#[test]
fn bench_runs_on_workers_in_both_modes() {
    for mode in ["infer", "train"] {
        let args = ["bench", "--workers", "2", "--mode", mode, "--sentences", "24", "--batch", "4"];
        let v = last_json(&arbor(&[&args[..], &SMALL[..4]].concat()));
        assert_eq!(v["workers"], 2, "{v}");
        assert_eq!(v["sentences"], 24, "{v}");
        assert!(v["sent_per_s"].as_f64().unwrap() > 0.0 && v["gflops"].as_f64().unwrap() > 0.0, "{v}");
    }
}

/// `bench --profile` splits a training step's time by activity, each launch kind apart: a
/// Tree-LSTM step runs products, fused kernels, fills, scatters and row sums, each timed.
#[test]
fn bench_profiles_each_kind_of_launch() {
    let args = ["bench", "--mode", "train", "--sentences", "32", "--batch", "8", "--profile"];
    let v = last_json(&arbor(&[&args[..], &SMALL[..4]].concat()));
    let spent = &v["profile_ms_per_step"];
    for key in ["products", "fused", "fills", "scatters", "row_sums", "update", "step"] {
        assert!(spent[key].as_f64().is_some_and(|ms| ms > 0.0), "{key} in {spent}");
    }
    for key in ["plan", "lower", "upload", "attention", "read"] {
        assert!(spent[key].as_f64().is_some(), "{key} in {spent}");
    }
}

/// `ARBOR_CPU_ISA` with a value that names no instruction set is refused before anything runs;
/// a level below the CPU's is what `bench` reports using.
#[test]
fn the_instruction_set_switch_is_checked_and_reported() {
    let run = |isa: &str, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_arbor")).env("ARBOR_CPU_ISA", isa).args(args).output().unwrap()
    };
    let out = run("avx3", &["train", "--epochs", "1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.trim(),
        "arbor: environment variable ARBOR_CPU_ISA: expected one of avx512, avx2, baseline, got `avx3`"
    );
    let out = run("baseline", &["bench", "--sentences", "8", "--batch", "8", "--hidden", "8", "--embed", "8"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["cpu_isa"], "baseline");
}

/// `arbor train --model sick` keeps the epoch of the best dev Pearson, ends with its test
/// Pearson, Spearman and MSE, and `arbor eval` of its checkpoint gives the same numbers; flags it
/// does not take are refused.
#[test]
fn sick_trains_and_its_checkpoint_evaluates_the_same() {
    let data = arbor::data::data_dir().join("sick");
    let data = data.to_str().expect("a UTF-8 data path");
    let ck = std::env::temp_dir().join(format!("arbor-cli-sick-{}", std::process::id()));
    let ck = ck.to_str().unwrap();
    let args = ["train", "--model", "sick", "--data", data, "--epochs", "2", "--hidden", "16", "--embed", "16"];
    let out = arbor(&[&args[..], &["--max-steps", "30", "--checkpoint", ck]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let last = |out: &std::process::Output| -> serde_json::Value {
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        serde_json::from_str(stdout.lines().last().expect("a summary line")).expect("the last line is JSON")
    };
    let trained = last(&out);
    assert_eq!((trained["model"].as_str(), trained["steps"].as_u64()), (Some("sick"), Some(30)));
    assert!(trained["test_pearson"].as_f64().is_some_and(|p| p > 0.0 && p <= 1.0), "{trained}");
    let out = arbor(&["eval", "--checkpoint", ck]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let evaluated = last(&out);
    for key in ["test_pearson", "test_spearman", "test_mse"] {
        assert_eq!(evaluated[key], trained[key], "{key}: {evaluated} after {trained}");
    }
    assert_eq!(evaluated["pairs"], 4927);
    // `arbor predict` scores pairs: the test split's pairs, given as tokens and heads, get the
    // relatedness whose Pearson correlation with the gold scores is the one eval reports; a pair
    // of plain sentences typed on the command line gets one line.
    let test = std::path::Path::new(data).join("test");
    let file = |name: &str| std::fs::read_to_string(test.join(name)).expect("a SICK test file");
    let [a, ah, b, bh, sim] = ["a.toks", "a.parents", "b.toks", "b.parents", "sim.txt"].map(file);
    let lines: Vec<String> = a
        .lines()
        .zip(ah.lines())
        .zip(b.lines().zip(bh.lines()))
        .map(|((a, ah), (b, bh))| format!("{a}\t{ah}\t{b}\t{bh}"))
        .collect();
    let input = format!("{ck}-pairs.txt");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = arbor(&["predict", "--checkpoint", ck, "--input", &input]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let predicted: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["relatedness"].as_f64().unwrap())
        .collect();
    // The gold scores as the reader keeps them (f32).
    let gold: Vec<f64> = sim.lines().map(|s| f64::from(s.trim().parse::<f32>().unwrap())).collect();
    assert_eq!(serde_json::json!(arbor::metrics::pearson(&predicted, &gold)), evaluated["test_pearson"]);
    let out = arbor(&["predict", "--checkpoint", ck, "a man is playing a guitar\ta person plays music"]);
    let line: serde_json::Value = serde_json::from_slice(out.stdout.trim_ascii()).expect("one JSON line");
    assert!(line["relatedness"].as_f64().is_some_and(|r| (1.0..=5.0).contains(&r)), "{line}");
    let out = arbor(&["predict", "--checkpoint", ck, "a man\tplays\tmusic"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("argument") && err.contains("3 tab-separated fields"), "{err}");
    std::fs::remove_file(&input).ok();
    std::fs::remove_dir_all(ck).ok();
    let out = arbor(&[&args[..], &["--layers", "2"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--model sick") && err.contains("--layers"), "{err}");
}

/// `arbor predict` classifies new sentences with a checkpoint: on the SST test trees its
/// predicted classes against their root labels give exactly the accuracy `arbor eval` reports
/// (one layer, a stack of two and a chain model); plain words and unlabelled brackets typed on
/// the command line each get one line with probabilities that sum to 1.
#[test]
fn predict_classifies_sentences_as_eval_scores_them() {
    let sst = arbor::data::data_dir().join("sst");
    let test = sst.join("test.txt");
    let ck = temp("predict");
    for extra in [&["--model", "tree-lstm"][..], &["--layers", "2"], &["--model", "var-lstm"]] {
        std::fs::remove_dir_all(&ck).ok();
        let mut args = vec!["train", "--data", sst.to_str().unwrap(), "--max-steps", "20", "--batch", "10"];
        args.extend(["--hidden", "8", "--embed", "8", "--checkpoint", ck.to_str().unwrap()]);
        args.extend(extra);
        last_json(&arbor(&args));
        let eval = last_json(&arbor(&["eval", "--checkpoint", ck.to_str().unwrap()]));
        let out = arbor(&["predict", "--checkpoint", ck.to_str().unwrap(), "--input", test.to_str().unwrap()]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<serde_json::Value> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
        assert_eq!(lines.len() as u64, eval["trees"].as_u64().unwrap(), "{extra:?}");
        let right = lines.iter().filter(|l| l["class"] == l["gold"]).count();
        assert_eq!(right as f64 / lines.len() as f64, eval["test_acc"].as_f64().unwrap(), "{extra:?}");
        let typed = ["a fine , funny film", "((a (fine film)) .)"];
        let out = arbor(&[&["predict", "--checkpoint", ck.to_str().unwrap()][..], &typed].concat());
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout.lines().count(), 2, "{extra:?}: {stdout}");
        for line in stdout.lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("JSON");
            let p: Vec<f64> = v["probabilities"].as_array().unwrap().iter().map(|p| p.as_f64().unwrap()).collect();
            assert_eq!(p.len(), 5);
            assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-5, "{v}");
            assert!(v["gold"].is_null() && v["class"].as_u64() < Some(5), "{v}");
        }
    }
    let out = arbor(&["predict", "--checkpoint", ck.to_str().unwrap(), "(a (b"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("argument:1:") && err.contains("never closed"), "{err}");
    std::fs::remove_dir_all(&ck).ok();
}

/// `--freeze NAME` leaves that tensor as it was initialised while the rest trains, is recorded
/// for `--resume`, and a name the model has no tensor of is refused, listing the names.
#[test]
fn frozen_tensors_stay_as_they_were() {
    let dir = temp("freeze");
    let run = |name: &str, extra: &[&str]| {
        let ck = dir.join(name);
        let mut args = vec!["train", "--epochs", "1", "--checkpoint", ck.to_str().unwrap()];
        args.extend(SMALL);
        args.extend(extra);
        last_json(&arbor(&args));
        arbor::checkpoint::Checkpoint::load(&ck.join("last")).unwrap()
    };
    let start = run("start", &["--max-steps", "0"]);
    let frozen = run("frozen", &["--max-steps", "20", "--freeze", "embedding", "--freeze", "cell.b"]);
    let free = run("free", &["--max-steps", "20"]);
    for name in ["embedding", "cell.b"] {
        assert_eq!(frozen.tensor(name).unwrap(), start.tensor(name).unwrap(), "{name} moved");
        assert_ne!(free.tensor(name).unwrap(), start.tensor(name).unwrap(), "{name} did not train");
    }
    assert_ne!(frozen.tensor("cell.W").unwrap(), start.tensor("cell.W").unwrap());
    assert_eq!(frozen.meta["freeze"], serde_json::json!(["embedding", "cell.b"]));
    let out = arbor(&["train", "--epochs", "1", "--freeze", "cell.V"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--freeze cell.V") && err.contains("cell.W"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `arbor eval --checkpoint DIR`, with no other flag, gives back every model's training scores:
/// the tree models on the synthetic treebank, and `ggnn`'s and a per-step `gin`'s
/// cross-validation (each fold's model scored on the graphs it held out; their mean the
/// training's `cv_acc_mean`).
#[test]
fn eval_reproduces_every_models_training_scores() {
    let ck = temp("every-model");
    for model in ["child-sum", "var-lstm", "tree-fc"] {
        std::fs::remove_dir_all(&ck).ok();
        let mut args = vec!["train", "--model", model, "--epochs", "1", "--checkpoint", ck.to_str().unwrap()];
        args.extend(SMALL);
        let trained = last_json(&arbor(&args));
        let evaluated = last_json(&arbor(&["eval", "--checkpoint", ck.to_str().unwrap()]));
        assert_eq!(trained["test_acc"], evaluated["test_acc"], "{model}");
    }
    std::fs::remove_dir_all(&ck).ok();
    let mutag = arbor::data::data_dir().join("mutag");
    let graphs = [
        "train",
        "--model",
        "ggnn",
        "--data",
        mutag.to_str().unwrap(),
        "--folds",
        "3",
        "--epochs",
        "2",
        "--hidden",
        "8",
        "--checkpoint",
        ck.to_str().unwrap(),
    ];
    let trained = last_json(&arbor(&graphs));
    let evaluated = last_json(&arbor(&["eval", "--checkpoint", ck.to_str().unwrap()]));
    assert_eq!(trained["cv_acc_mean"], evaluated["cv_acc_mean"], "{trained} {evaluated}");
    assert_eq!(evaluated["fold_scores"].as_array().map(Vec::len), Some(3), "{evaluated}");
    // Beside it, the epoch the held-out folds themselves would choose (GIN's tables' protocol).
    let best_epoch = trained["cv_best_epoch"].as_u64().unwrap();
    assert!((1..=2).contains(&best_epoch), "{trained}");
    assert!(trained["cv_acc_best_epoch"].as_f64().unwrap() >= trained["cv_acc_mean"].as_f64().unwrap(), "{trained}");
    // One fold's folder scores that fold alone.
    let fold = last_json(&arbor(&["eval", "--checkpoint", ck.join("fold-1").to_str().unwrap()]));
    assert_eq!(fold["fold_scores"][0], evaluated["fold_scores"][1], "{fold}");
    // GIN with weights per step: its cell pulls the step, which the checkpoint's model keeps;
    // its nodes labelled by their rings too, which eval repeats from what the checkpoint records.
    std::fs::remove_dir_all(&ck).ok();
    let per_step = [&graphs[..2], &["gin", "--per-step", "--every-step", "--cycles", "6"], &graphs[3..]].concat();
    let trained = last_json(&arbor(&per_step));
    let evaluated = last_json(&arbor(&["eval", "--checkpoint", ck.to_str().unwrap()]));
    assert_eq!((trained["per_step"].as_bool(), &trained["cv_acc_mean"]), (Some(true), &evaluated["cv_acc_mean"]));
    assert_eq!(trained["cycles"], 6, "{trained}");
    // An ensemble of two GINs per fold: each member's checkpoints in its fold's `member-m`,
    // scored together again by eval; the members' own mean beside the ensemble's.
    std::fs::remove_dir_all(&ck).ok();
    let ensemble = [&graphs[..2], &["gin", "--ensemble", "2"], &graphs[3..]].concat();
    let trained = last_json(&arbor(&ensemble));
    assert!(ck.join("fold-2").join("member-1").join("last").is_dir(), "{trained}");
    let evaluated = last_json(&arbor(&["eval", "--checkpoint", ck.to_str().unwrap()]));
    assert_eq!((trained["ensemble"].as_u64(), &trained["cv_acc_mean"]), (Some(2), &evaluated["cv_acc_mean"]));
    assert!(trained["cv_acc_member_mean"].as_f64().is_some_and(|a| a > 0.5), "{trained}");
    std::fs::remove_dir_all(&ck).ok();
}
