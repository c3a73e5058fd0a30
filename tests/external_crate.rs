//! arbor used as a library, as a user's crate uses it: a crate outside the workspace (written to
//! `target/external-crate/`, depending on arbor by path with only the `testing` feature) declares
//! a cell of its own and tests it with `arbor::testing` — gradient check, batched check and a
//! proptest over the strategies. Its tests pass; with its `wrong` feature the cell's gradient
//! misses a path, and the failure names the parameter.

use std::path::{Path, PathBuf};
use std::process::Command;

const MANIFEST: &str = r#"[package]
name = "my-cells"
version = "0.1.0"
edition = "2021"
publish = false

[workspace]

[features]
wrong = []

[dependencies]
arbor = { path = "ARBOR", default-features = false, features = ["testing"] }

[dev-dependencies]
proptest = "1.7"

[profile.dev.package."*"]
opt-level = 3
"#;

const LIB: &str = r#"//! A Tree-GRU cell, as a user writes one.
use arbor::{Builder, Init, VertexFn};

/// `h = (1 − z)·h̃ + z·(h₀ + h₁)/2`, `z = σ(x·Wz + (h₀ + h₁)·Uz)`, `h̃ = tanh(x·W + (r ⊙ (h₀ + h₁))·U)`.
pub fn tree_gru(embed: usize, hidden: usize) -> VertexFn {
    let f = Builder::new("tree-gru", 2);
    let x = f.pull("x", embed);
    let sum = f.gather(0, "h", hidden) + f.gather(1, "h", hidden);
    let param = |name: &str, rows: usize| f.param(name, [rows, hidden], Init::Xavier);
    let z = (x.matmul(param("Wz", embed)) + sum.matmul(param("Uz", hidden))).sigmoid();
    let r = (x.matmul(param("Wr", embed)) + sum.matmul(param("Ur", hidden))).sigmoid();
    let mut pre = x.matmul(param("W", embed)) + (r * sum).matmul(param("U", hidden));
    if cfg!(feature = "wrong") {
        // A path autodiff does not follow: `Uz` also shifts the candidate through a row maximum.
        pre = pre + sum.matmul(param("Uz2", hidden)).detached_max_cols().broadcast_cols(hidden);
    }
    let h = (1.0 - z) * pre.tanh() + z * sum.scale(0.5);
    f.scatter("h", h);
    f.push("h", h);
    f.build().expect("the cell builds")
}
"#;

const TESTS: &str = r#"use arbor::testing::{check_batched, check_gradients, strategy, GradCheck};
use my_cells::tree_gru;
use proptest::prelude::*;

#[test]
fn gradients_match_finite_differences() {
    let mut rng = arbor::rng::Rng::new(5);
    let graphs: Vec<_> = (0..3).map(|_| strategy::tree(&mut rng, 8, 2)).collect();
    let report = check_gradients(&tree_gru(3, 4), &graphs, &GradCheck::default()).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.params > 0 && report.norm > 1e-2);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]
    #[test]
    fn batched_equals_one_graph_at_a_time(graphs in strategy::minibatches(strategy::trees(2, 1..=15), 1..=5), seed: u64) {
        check_batched(&tree_gru(3, 4), &graphs, seed).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}
"#;

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    // Unchanged files keep their times, so a second run builds nothing again.
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap();
    }
}

/// Runs the crate's tests (with `features`); its exit status and output.
fn cargo_test(dir: &Path, features: &[&str]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(dir).args(["test", "--quiet"]);
    for f in features {
        cmd.args(["--features", f]);
    }
    // Not the variables of the cargo running this test (its features, its target directory).
    for (key, _) in std::env::vars() {
        if key.starts_with("CARGO_") && key != "CARGO_HOME" {
            cmd.env_remove(key);
        }
    }
    cmd.env("CARGO_TARGET_DIR", dir.join("target"));
    let out = cmd.output().expect("cargo runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn a_users_crate_tests_its_cell_with_the_testing_kit() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("target").join("external-crate");
    write(&dir.join("Cargo.toml"), &MANIFEST.replace("ARBOR", &root.display().to_string()));
    write(&dir.join("src/lib.rs"), LIB);
    write(&dir.join("tests/cell.rs"), TESTS);
    // The workspace's versions of every dependency: nothing to resolve or download.
    if !dir.join("Cargo.lock").exists() {
        std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    }
    let (ok, out) = cargo_test(&dir, &[]);
    assert!(ok, "the user's tests fail:\n{out}");
    assert!(out.contains("2 passed"), "{out}");
    let (ok, out) = cargo_test(&dir, &["wrong"]);
    assert!(!ok, "a wrong gradient passes:\n{out}");
    assert!(out.contains("gradients of `tree-gru` over 3 graphs") && out.contains("param `Uz2`["), "{out}");
}

/// `arbor = { default-features = false }` is the library alone: neither the command line's
/// crates (clap, indicatif) nor the CUDA backend's (cudarc), nor proptest.
#[test]
fn the_library_alone_pulls_neither_the_cli_nor_cuda() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tree = |features: &[&str]| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(&root).args(["tree", "-p", "arbor", "-e", "normal", "--prefix", "none", "--offline"]);
        cmd.args(features);
        let out = cmd.output().expect("cargo tree runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let names: std::collections::BTreeSet<String> =
            text.lines().filter_map(|l| l.split(' ').next()).map(str::to_string).collect();
        names
    };
    let heavy = ["clap", "indicatif", "cudarc", "arbor-cuda", "proptest"];
    let alone = tree(&["--no-default-features"]);
    assert!(alone.contains("arbor-core") && alone.contains("gemm"), "{alone:?}");
    for name in heavy {
        assert!(!alone.contains(name), "the library alone pulls {name}: {alone:?}");
    }
    let default = tree(&[]);
    for name in ["clap", "indicatif", "cudarc"] {
        assert!(default.contains(name), "the default build lacks {name}: {default:?}");
    }
    assert!(tree(&["--no-default-features", "--features", "testing"]).contains("proptest"));
}
