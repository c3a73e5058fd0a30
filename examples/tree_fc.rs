//! Tree-FC, the Cavs benchmark cell, on complete binary trees: times forward + backward passes.
//! `cargo run --release --example tree_fc [LEAVES] [HIDDEN]`.

use arbor::rng::Rng;
use arbor::Pass;
use arbor::{nn, CpuBackend, Engine, InputGraph, Pull};
use std::time::Instant;

fn main() -> arbor::Result<()> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().ok());
    let leaves = args.next().flatten().unwrap_or(256);
    let hidden = args.next().flatten().unwrap_or(256);
    let cell = nn::tree_fc(hidden, hidden)?;
    let mut rng = Rng::new(1);
    let params = cell.init_params(&mut rng);
    let mut engine = Engine::new(CpuBackend::new(), cell, &params)?;
    let trees: Vec<InputGraph> = (0..16).map(|_| InputGraph::balanced_binary(leaves)).collect();
    let refs: Vec<&InputGraph> = trees.iter().collect();
    let n: usize = trees.iter().map(InputGraph::len).sum();
    let x: Vec<f32> = (0..n * hidden).map(|_| rng.range(-1.0, 1.0)).collect();
    let dh = vec![1e-3; n * hidden];
    engine.run(Pass::train(&refs, &[Pull::Rows(&x)]))?;
    engine.backward(&[&dh])?;
    let start = Instant::now();
    let reps = 5;
    for _ in 0..reps {
        engine.run(Pass::train(&refs, &[Pull::Rows(&x)]))?;
        engine.backward(&[&dh])?;
    }
    let secs = start.elapsed().as_secs_f64() / reps as f64;
    println!(
        "16 trees of {leaves} leaves, hidden {hidden}: {:.1} ms per step, {:.0} vertices/s",
        secs * 1e3,
        n as f64 / secs
    );
    println!("{}", engine.schedule().stats());
    Ok(())
}
