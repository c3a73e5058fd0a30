//! Gated graph network on MUTAG, 10-fold cross-validated, each fold a fresh model trained by the
//! one loop (`Run`): `cargo run --release --example ggnn_mutag`.

use arbor::data::{data_dir, tu};
use arbor::optim::{Config, Rule};
use arbor::zoo::{cross_validate_graphs, GraphCell, GraphTraining};
use arbor::CpuBackend;

fn main() -> arbor::Result<()> {
    let data = tu::read(&data_dir().join("mutag"), "MUTAG")?;
    let cfg = GraphTraining {
        cell: GraphCell::Ggnn,
        steps: 4,
        features: 16,
        hidden: 32,
        epochs: 100,
        batch: 25,
        folds: 10,
        seed: 1,
        optimizer: Config::new(Rule::Adam, 0.005),
        clip: Some(5.0),
        checkpoint: None,
        meta: serde_json::Value::Null,
    };
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
