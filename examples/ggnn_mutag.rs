//! Gated graph network on MUTAG, 10-fold cross-validated: `cargo run --release --example ggnn_mutag`.

use arbor::data::{data_dir, tu};
use arbor::optim::{Config, Rule};
use arbor::train::{cross_validate, GraphTraining};

fn main() -> arbor::Result<()> {
    let data = tu::read(&data_dir().join("mutag"), "MUTAG")?;
    let cfg = GraphTraining {
        steps: 4,
        features: 16,
        hidden: 32,
        epochs: 100,
        batch: 25,
        folds: 10,
        seed: 1,
        optimizer: Config::new(Rule::Adam, 0.005),
        clip: Some(5.0),
    };
    let r = cross_validate(&data, &cfg, &mut |fold, epoch| {
        if epoch + 1 == cfg.epochs {
            eprintln!("fold {} done", fold + 1);
        }
    })?;
    println!("10-fold accuracy {:.4} ± {:.4} ({:.0} graphs/s)", r.mean, r.std, r.graphs_per_s);
    Ok(())
}
