//! The generated CUDA C compiled by the real NVRTC, through the backend's own compile function
//! and options (`arbor::cuda::nvrtc::compile`), with no driver or device: every fused kernel of
//! every cell of the zoo — every fused step of every plan bound as the engine binds it, with
//! stores left out, and every kernel the engine asks a backend for while it trains and infers on
//! random minibatches (leaf tasks with missing children bound as zeros, stores a task never reads
//! left out) — plus the backend's helper module, for sm_80, sm_90 and the newest architecture
//! the installed NVRTC knows. A compile error or a kernel that spills registers fails the test.
//!
//! Without NVRTC (`libnvrtc.so.13` on the library path; `.ci/run` installs it from PyPI) the test
//! says so in one line and passes.

mod common;

use arbor::backend::Rows;
use arbor::cuda::cache::KernelCache;
use arbor::cuda::codegen::{generate, Binding};
use arbor::cuda::nvrtc::{self, Usage};
use arbor::fusion::Kernel;
use arbor::rng::Rng;
use arbor::testing::strategy::with_edge_features;
use arbor::Pass;
use arbor::{nn, Engine, InputGraph, Pull, VertexFn};
use common::kernels::{bindings, cells, kernels};
use common::watched::{Watch, Watched};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Write;

/// Writes past the test harness's capture, so CI's log shows the counts of a passing run.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Whether NVRTC can be loaded; says once when it cannot. With `ARBOR_REQUIRE_NVRTC` set (as
/// `.ci/run` sets it) a missing NVRTC fails the test instead.
///
/// On a machine with a CUDA driver, NVRTC serves modules it compiled before from the driver's
/// compute cache, and then ptxas reports nothing (no registers, no spills): the first call turns
/// that cache off for this process (`CUDA_CACHE_DISABLE=1`), before any test compiles.
fn have_nvrtc() -> bool {
    static SAID: std::sync::Once = std::sync::Once::new();
    static UNCACHED: std::sync::Once = std::sync::Once::new();
    UNCACHED.call_once(|| std::env::set_var("CUDA_CACHE_DISABLE", "1"));
    let have = nvrtc::is_available();
    assert!(
        have || std::env::var_os("ARBOR_REQUIRE_NVRTC").is_none(),
        "ARBOR_REQUIRE_NVRTC is set but NVRTC (libnvrtc.so.13) is not on the library path"
    );
    if !have {
        SAID.call_once(|| {
            report("nvrtc: NVRTC (libnvrtc.so.13) not found on the library path: generated CUDA not compiled")
        });
    }
    have
}

/// Every fused kernel and binding the engine runs, labelled with the phase the test sets.
#[derive(Default)]
struct Recording {
    phase: RefCell<&'static str>,
    seen: RefCell<Vec<(String, Kernel, Vec<Binding>)>>,
}

impl Watch for Recording {
    fn replica(&self) -> Recording {
        Recording::default()
    }
    fn fused(&self, k: &Kernel, loads: &[Rows]) {
        let label = format!("engine {} {}", self.phase.borrow(), self.seen.borrow().len());
        self.seen.borrow_mut().push((label, k.clone(), loads.iter().map(Binding::of).collect()));
    }
}

/// The CPU backend, noting every fused kernel and binding the engine runs.
type Recorder = Watched<Recording>;

/// The fused kernels the engine runs for `f` while it trains (forward, backward) and infers on a
/// random minibatch of 24 graphs, labelled, with their bindings.
fn engine_kernels(f: &VertexFn, seed: u64) -> Vec<(String, Kernel, Vec<Binding>)> {
    let mut rng = Rng::new(seed);
    let params = f.init_params(&mut rng);
    let arity = if f.max_children().is_none() { 0 } else { f.arity() };
    let dag = arity == 0;
    // A function of no children (a head) runs over vertices without edges.
    let graphs: Vec<InputGraph> = (0..24)
        .map(|_| {
            let n = 1 + rng.below(30);
            if f.max_children() == Some(0) {
                InputGraph::isolated(n)
            } else {
                let g = InputGraph::random(&mut rng, n, arity, dag);
                with_edge_features(g, f.edge_feature_width(), &mut rng)
            }
        })
        .collect();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let total: usize = graphs.iter().map(InputGraph::len).sum();
    let pulls: Vec<Vec<f32>> =
        f.inputs().iter().map(|p| (0..total * p.shape.numel()).map(|_| rng.range(-1.0, 1.0)).collect()).collect();
    let pulls: Vec<Pull> = pulls.iter().map(|p| Pull::Rows(p)).collect();
    let grads: Vec<Vec<f32>> = f.outputs().iter().map(|o| vec![0.5; total * o.shape.numel()]).collect();
    let grads: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
    let mut engine = Engine::new(Recorder::new(Recording::default()), f.clone(), &params).unwrap();
    let phase = |engine: &Engine<Recorder>, name| *engine.backend().watch.phase.borrow_mut() = name;
    phase(&engine, "forward");
    engine.run(Pass::train(&refs, &pulls)).unwrap();
    phase(&engine, "backward");
    engine.backward(&grads).unwrap();
    phase(&engine, "inference");
    engine.run(Pass::infer(&refs, &pulls)).unwrap();
    // Rows pulled from three distinct ones: products over the distinct rows, their copies to the
    // vertices, and the output gradients summed per distinct row.
    let shared: Vec<Vec<f32>> = f
        .inputs()
        .iter()
        .map(|p| {
            let w = p.shape.numel();
            let rows: Vec<f32> = (0..3 * w).map(|_| rng.range(-1.0, 1.0)).collect();
            (0..total).flat_map(|v| rows[v % 3 * w..][..w].iter().copied()).collect()
        })
        .collect();
    let shared: Vec<Pull> = shared.iter().map(|p| Pull::Rows(p)).collect();
    phase(&engine, "shared backward");
    engine.run(Pass::train(&refs, &shared)).unwrap();
    engine.backward(&grads).unwrap();
    engine.backend().watch.seen.take()
}

/// The planned kernels of `f`, each bound with gathers by index (`gathered`) and contiguous.
fn planned(f: &VertexFn) -> Vec<(String, Kernel, Vec<Binding>)> {
    kernels(f)
        .into_iter()
        .flat_map(|(label, k)| {
            [(false, "gathered"), (true, "contiguous")]
                .map(|(plain, how)| (format!("{label} {how}"), k.clone(), bindings(f, &k, plain)))
        })
        .collect()
}

/// The Tree-LSTM of the SST benchmarks (embed 300) at hidden 150 and 512.
fn sst_tree_lstms() -> [(String, VertexFn); 2] {
    [150, 512].map(|h| (format!("tree-lstm h{h}"), nn::tree_lstm(300, h).unwrap()))
}

/// Every module to compile: `(what it is, its source)`, each distinct source once.
fn modules() -> Vec<(String, String)> {
    let mut sources = BTreeMap::new();
    sources.insert(arbor::cuda::helpers::helpers(), "helper kernels".to_string());
    let zoo = cells().into_iter().map(|f| (f.name().to_string(), f));
    for (seed, (name, f)) in zoo.chain(sst_tree_lstms()).enumerate() {
        for (label, k, b) in planned(&f).into_iter().chain(engine_kernels(&f, seed as u64)) {
            let g = generate(&k, &b).unwrap();
            sources.entry(g.source).or_insert_with(|| format!("{name} {label}"));
        }
    }
    sources.into_iter().map(|(source, what)| (what, source)).collect()
}

/// Compiles every module for `arch` on two threads: per module, what it is and the result.
fn compile_all(modules: &[(String, String)], arch: &str) -> Vec<(String, arbor::Result<Vec<Usage>>)> {
    let half = modules.len().div_ceil(2);
    std::thread::scope(|s| {
        let parts: Vec<_> = modules
            .chunks(half.max(1))
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|(what, src)| (what.clone(), nvrtc::compile(src, arch).map(|c| c.usage)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts.into_iter().flat_map(|p| p.join().unwrap()).collect()
    })
}

#[test]
fn every_generated_kernel_compiles_without_spills() {
    if !have_nvrtc() {
        return;
    }
    let (major, minor) = nvrtc::version().unwrap();
    let archs = nvrtc::architectures().unwrap();
    let newest = archs.last().expect("NVRTC knows an architecture").clone();
    let mut targets = vec!["sm_80".to_string(), "sm_90".to_string()];
    if !targets.contains(&newest) {
        targets.push(newest);
    }
    let modules = modules();
    let mut failures = Vec::new();
    for arch in &targets {
        let results = compile_all(&modules, arch);
        let mut kernels = 0;
        let mut registers = Vec::new();
        for (what, result) in results {
            match result {
                Err(e) => failures.push(format!("{arch} {what}: {e}")),
                Ok(usage) if usage.is_empty() => failures.push(format!("{arch} {what}: ptxas reported no kernel")),
                Ok(usage) => {
                    for u in usage {
                        println!(
                            "{arch} {}: {} registers, {} bytes stack, spills {}/{} bytes ({what})",
                            u.kernel, u.registers, u.stack, u.spill_stores, u.spill_loads
                        );
                        if u.spills() {
                            failures.push(format!("{arch} {what}: {} spills ({u:?})", u.kernel));
                        }
                        kernels += 1;
                        registers.push(u.registers);
                    }
                }
            }
        }
        let (lo, hi) = (registers.iter().min().unwrap_or(&0), registers.iter().max().unwrap_or(&0));
        report(&format!(
            "nvrtc {major}.{minor} {arch}: {kernels} kernels in {} modules compiled, {lo}–{hi} registers",
            modules.len()
        ));
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    assert!(modules.len() >= 120, "only {} modules: the zoo's kernels were not all enumerated", modules.len());
}

/// Registers per thread and spills of the Tree-LSTM's forward and backward kernels (gathers by
/// index, as the engine binds internal vertices) at hidden 150 and 512, per architecture: the
/// table in BENCHMARKS.md.
#[test]
fn tree_lstm_registers_per_architecture() {
    if !have_nvrtc() {
        return;
    }
    let newest = nvrtc::architectures().unwrap().pop().unwrap();
    let archs = ["sm_80".to_string(), "sm_90".to_string(), newest];
    report(&format!("| kernel | {} |", archs.join(" | ")));
    for (name, f) in sst_tree_lstms() {
        for (label, k, b) in planned(&f).into_iter().filter(|(l, ..)| l.ends_with(" gathered") && !l.contains("pruned"))
        {
            let source = generate(&k, &b).unwrap().source;
            let cells: Vec<String> = archs
                .iter()
                .map(|arch| {
                    let u = &nvrtc::compile(&source, arch).unwrap().usage[0];
                    assert!(!u.spills(), "{name} {label} spills on {arch}: {u:?}");
                    format!("{} registers, {} spilled", u.registers, u.spill_stores)
                })
                .collect();
            report(&format!("| {name} {} | {} |", label.trim_end_matches(" gathered"), cells.join(" | ")));
        }
    }
}

/// Modules compiled without a device are what the kernel cache keeps for a later run on a GPU:
/// CUBIN images, found on disk by a fresh cache under the key the backend uses (architecture and
/// NVRTC version), and compiled afresh for another architecture.
#[test]
fn compiled_modules_are_cached_for_a_later_run() {
    if !have_nvrtc() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("arbor-nvrtc-cache-{}", std::process::id()));
    let source = arbor::cuda::helpers::helpers();
    let compile = |arch: &'static str| move |src: &str, _: &str| nvrtc::compile(src, arch).map(|c| c.image);
    let sm90 = nvrtc::target("sm_90").unwrap();
    let mut first = KernelCache::new(Some(dir.clone()));
    let image = first.get_or_compile(&source, &sm90, compile("sm_90")).unwrap();
    assert_eq!(&image[..4], b"\x7fELF", "a CUBIN is an ELF image");
    let mut later = KernelCache::new(Some(dir.clone()));
    let found = later.get_or_compile(&source, &sm90, |_, _| panic!("compiled again")).unwrap();
    assert_eq!((found, later.compiled()), (image, 0));
    later.get_or_compile(&source, &nvrtc::target("sm_80").unwrap(), compile("sm_80")).unwrap();
    assert_eq!(later.compiled(), 1, "another architecture is compiled for itself");
    let _ = std::fs::remove_dir_all(dir);
}

/// A kernel NVRTC refuses is an error that carries NVRTC's log, naming what is wrong.
#[test]
fn a_broken_kernel_fails_with_the_compiler_log() {
    if !have_nvrtc() {
        return;
    }
    let source = format!(
        "{}extern \"C\" __global__ void broken(float* p) {{ p[0] = arbor_no_such_function(p[1]); }}\n",
        arbor::cuda::codegen::PRELUDE
    );
    let e = nvrtc::compile(&source, "sm_90").unwrap_err().to_string();
    assert!(e.contains("compiling for sm_90"), "{e}");
    assert!(e.contains("arbor_no_such_function") && e.contains("undefined"), "{e}");
}
