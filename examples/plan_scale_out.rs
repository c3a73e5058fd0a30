//! The planner's choices for a simulated scale-out (`arbor::dist::planner`): the SST Tree-LSTM
//! of four stacked layers (h150 e300, root loss) is measured here (`Model::layer_costs`: a few
//! training steps at batch 64 on the CPU, each layer's time its share of the executed FLOPs, its
//! memory the arena a pass used), then planned for 8, 64 and 512 workers at two memory sizes,
//! with the model of step time the planner uses. `cargo run --release --example plan_scale_out [DATA_DIR]`.

use arbor::data::labelled::Labelled;
use arbor::data::sst;
use arbor::dist::planner::{plan, Machine};
use arbor::dist::schedule::Kind;
use arbor::layers::LossOn;
use arbor::model::{AsExample, Example};
use arbor::optim::{Config, Rule};
use arbor::rng::Rng;
use arbor::{nn, CpuBackend};

fn main() -> arbor::Result<()> {
    let dir = std::env::args().nth(1).map_or_else(|| arbor::data::data_dir().join("sst"), Into::into);
    let splits = sst::read_splits(&dir, false)?;
    let train = Labelled::all(&splits.train, LossOn::Root, sst::CLASSES);
    let mut rng = Rng::new(1);
    let cells =
        vec![nn::tree_lstm(300, 150)?, nn::tree_lstm(150, 150)?, nn::tree_lstm(150, 150)?, nn::tree_lstm(150, 150)?];
    let readout = Labelled::readout(LossOn::Root);
    let model =
        arbor::zoo::tree_classifier_on(&CpuBackend::new(), cells, splits.vocab.len(), sst::CLASSES, readout, &mut rng)?;
    let batches: Vec<Vec<Example<'_>>> =
        train.chunks(64).take(9).map(|c| c.iter().map(AsExample::example).collect()).collect();
    let layers = model.layer_costs(&batches, Config::new(Rule::Adagrad, 0.05), Some(5.0))?;
    let per_example: f64 = layers.iter().map(|l| l.seconds).sum();
    let per_pass: f64 = layers.iter().map(|l| l.pass_seconds).sum();
    println!(
        "measured on this CPU (8 steps at batch 64, then in quarters): {:.2} ms a pass + {:.3} ms an example",
        per_pass * 1e3,
        per_example * 1e3
    );
    for (k, l) in layers.iter().enumerate() {
        println!(
            "  layer {k}{}: {:.0} µs a pass + {:.1} µs an example, {:.2} MB of parameters ({:.2} MB summed a step), \
             {:.1} KB kept an example",
            if k + 1 == layers.len() { " (and the head)" } else { "" },
            l.pass_seconds * 1e6,
            l.seconds * 1e6,
            l.param_bytes / 1e6,
            l.sum_bytes / 1e6,
            l.kept_bytes / 1e3
        );
    }
    println!("machine: 100 Gb/s links (12.5 GB/s), 5 µs a message; minibatches of 256 examples");
    for memory in [1e9, 1.2e8] {
        for workers in [8, 64, 512] {
            let machine = Machine { workers, memory, bandwidth: 12.5e9, latency: 5e-6 };
            for kind in [Kind::OneFOneBFlush, Kind::TwoBw] {
                let p = match plan(&layers, 256, kind, &machine, None) {
                    Ok(p) => p,
                    Err(e) => {
                        println!("{workers:>4} workers, {:>4.0} MB each, {kind:?}: {e}", memory / 1e6);
                        continue;
                    }
                };
                println!(
                    "{workers:>4} workers, {:>4.0} MB each, {kind:?}: stages {:?} × {} replicas, {} micro-batches: \
                     {:.3} ms a step ({:.0} examples/s), {:.1} MB on the fullest worker",
                    memory / 1e6,
                    p.stages,
                    p.replicas,
                    p.micro_batches,
                    p.step_seconds * 1e3,
                    256.0 / p.step_seconds,
                    p.memory / 1e6
                );
            }
        }
    }
    Ok(())
}
