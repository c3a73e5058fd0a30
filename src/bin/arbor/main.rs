//! The `arbor` command: train, evaluate and benchmark models from the command line.

mod args;
mod bench;
mod decide;
mod eval;
mod graphs;
mod predict;
mod resume;
mod sick;
mod train;

use arbor::data::{sst, synthetic, TreeExample, Vocab};
use arbor::nn::CellKind;
use arbor::{Backend, Error, Result};
use args::{Cli, Command};
use args::{Device, PrecisionArg};
use bench::bench;
use clap::Parser;
use eval::eval;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use std::path::Path;
use train::train;

/// Has glibc's malloc keep freed memory for reuse. Every training step allocates and frees the
/// same large gradient buffers; by default glibc hands such memory back to the kernel (unmapping
/// large blocks, trimming worker threads' heaps), so each step faults it back in page by page
/// (`perf stat -e page-faults arbor bench --workers 2`: about 700 faults per step without this,
/// none with it).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's thresholds; it runs before any other thread.
    unsafe {
        // Blocks up to 32 MiB come from the heap, and up to 1 GiB of free heap stays mapped.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() {
    keep_freed_memory();
    let cli = Cli::parse();
    let result = arbor::isa::requested().and_then(|_| match cli.command {
        Command::Train(args) => train(&args),
        Command::Eval(args) => eval(&args),
        Command::Bench(args) => bench(&args),
        Command::Predict(args) => predict::predict(&args),
    });
    if let Err(e) = result {
        eprintln!("arbor: {e}");
        std::process::exit(1);
    }
}

/// Work generic over the backend, run by [`on_device`] on the backend `--device` names.
pub(crate) trait OnDevice {
    /// What the work gives.
    type Out;
    /// Runs the work on `backend`.
    fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<Self::Out>;
}

/// The one place a `--device` becomes a backend: runs `work` on the CPU, or on the first CUDA
/// device (named on stderr) with its products at `precision`.
pub(crate) fn on_device<W: OnDevice>(device: Device, precision: PrecisionArg, work: W) -> Result<W::Out> {
    match device {
        Device::Cpu if precision != PrecisionArg::F32 => Err(Error::input(
            "--precision",
            "f32 on the CPU (reduced precision is for --device cuda)",
            format!("{precision:?}").to_lowercase(),
        )),
        Device::Cpu => work.run(arbor::CpuBackend::new()),
        Device::Cuda => work.run(cuda_backend(precision)?),
    }
}

/// The first CUDA device with its products at `precision`.
#[cfg(feature = "cuda")]
fn cuda_backend(precision: PrecisionArg) -> Result<arbor::cuda::CudaBackend> {
    use arbor::cuda::Precision;
    let gpu = arbor::cuda::CudaBackend::new(0)
        .map_err(|e| Error::input("--device cuda", "a usable CUDA device", e.to_string()))?;
    eprintln!("arbor: on {}", gpu.description());
    gpu.set_precision(match precision {
        PrecisionArg::F32 => Precision::F32,
        PrecisionArg::Tf32 => Precision::Tf32,
        PrecisionArg::Bf16 => Precision::Bf16,
        PrecisionArg::F16 => Precision::F16,
    });
    Ok(gpu)
}

/// `--device cuda` in a build without the `cuda` feature: an error saying so.
#[cfg(not(feature = "cuda"))]
fn cuda_backend(_: PrecisionArg) -> Result<arbor::CpuBackend> {
    Err(Error::input("--device cuda", "a build with the `cuda` feature", "arbor was built without it"))
}

pub(crate) struct Data {
    pub(crate) name: String,
    pub(crate) train: Vec<TreeExample>,
    pub(crate) dev: Vec<TreeExample>,
    pub(crate) test: Vec<TreeExample>,
    pub(crate) vocab: Vocab,
    pub(crate) classes: usize,
}

/// The synthetic treebank of `seed`, or the SST splits in `dir`; sentences as chains for `model`.
pub(crate) fn load(dir: Option<&Path>, seed: u64, lowercase: bool, model: CellKind) -> Result<Data> {
    let mut data = match dir {
        None => Data {
            name: "synthetic".into(),
            train: synthetic::generate(4000, 12, seed),
            dev: synthetic::generate(500, 12, seed + 1_000_003),
            test: synthetic::generate(500, 12, seed + 2_000_003),
            vocab: synthetic::vocab(),
            classes: synthetic::CLASSES,
        },
        Some(dir) => {
            if !dir.is_dir() {
                return Err(Error::Io { path: dir.display().to_string(), msg: "not a directory".into() });
            }
            let s = sst::read_splits(dir, lowercase)?;
            if !model.chains() {
                let arity = model.cell(1, 1)?.arity();
                for (split, trees) in [("train", &s.train), ("dev", &s.dev), ("test", &s.test)] {
                    check_arity(&dir.join(format!("{split}.txt")), trees, arity, model)?;
                }
            }
            Data {
                name: dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()).display().to_string(),
                train: s.train,
                dev: s.dev,
                test: s.test,
                vocab: s.vocab,
                classes: sst::CLASSES,
            }
        }
    };
    if model.chains() {
        for split in [&mut data.train, &mut data.dev, &mut data.test] {
            *split = split.iter().map(TreeExample::to_chain).collect();
        }
    }
    Ok(data)
}

/// Refuses a tree read from `file` with a node of more children than `model`'s cell takes,
/// naming the tree's line (the trees are the file's non-blank lines, in order).
fn check_arity(file: &Path, trees: &[TreeExample], arity: usize, model: CellKind) -> Result<()> {
    let wide = |t: &TreeExample| (0..t.graph.len()).map(|v| t.graph.children(v).len()).find(|&n| n > arity);
    let Some((k, n)) = trees.iter().enumerate().find_map(|(k, t)| wide(t).map(|n| (k, n))) else { return Ok(()) };
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let line = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()).nth(k).map_or(0, |(i, _)| i + 1);
    Err(Error::Parse {
        file: file.display().to_string(),
        line,
        msg: format!("a node with {n} children; the {} cell takes at most {arity} (binarize the tree)", model.name()),
    })
}

pub(crate) fn bar(len: usize, msg: String) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} trees, {per_sec}, eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg);
    pb
}

pub(crate) fn meta_usize(meta: &Value, key: &str) -> Result<usize> {
    meta[key]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| Error::input("checkpoint metadata", format!("a number `{key}`"), meta[key].to_string()))
}

/// The learned values of an embedding of `vocab × embed`, the vertex functions `fns` and a
/// `hidden × classes` output layer.
pub(crate) fn model_floats(
    vocab: usize,
    embed: usize,
    fns: &[&arbor::VertexFn],
    hidden: usize,
    classes: usize,
) -> u128 {
    let params: u128 = fns.iter().flat_map(|f| f.params()).map(|p| p.shape.numel() as u128).sum();
    vocab as u128 * embed as u128 + params + hidden as u128 * classes as u128
}
