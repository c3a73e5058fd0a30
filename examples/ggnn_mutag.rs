//! Gated graph network on MUTAG, 10-fold cross-validated, each fold a fresh model trained by the
//! one loop (`Run`): `cargo run --release --example ggnn_mutag`.

use arbor::data::{data_dir, tu};
use arbor::zoo::{cross_validate_graphs, GraphCell, GraphTraining};
use arbor::CpuBackend;

fn main() -> arbor::Result<()> {
    let data = tu::read(&data_dir().join("mutag"), "MUTAG")?;
    // `arbor train --model ggnn`'s settings: 4 steps, 16-wide node-label vectors, 32-wide
    // states, the last step mean-pooled, 100 epochs of Adam at 0.005 on minibatches of 25.
    let cfg = GraphTraining::new(GraphCell::Ggnn);

    // Told (fold from 0, epoch from 1) after every epoch.
    let r = cross_validate_graphs(&CpuBackend::new(), &data, &cfg, &mut |fold, epoch| {
        if epoch == cfg.epochs {
            eprintln!("fold {} done", fold + 1);
        }
    })?;
    let folds: Vec<String> = r.fold_scores.iter().map(|a| format!("{a:.2}")).collect();
    println!("fold accuracies {}", folds.join(" "));
    println!("10-fold accuracy {:.4} ± {:.4} ({:.0} graphs/s)", r.mean, r.std, r.examples_per_s);
    Ok(())
}
