//! A pipeline-parallel run: a two-layer stacked Tree-LSTM (layer 2 pulls layer 1's state at every
//! vertex) cut into two stages on two threads, trained with PipeDream-2BW on the synthetic
//! treebank: `cargo run --release --example pipeline [1f1b|2bw]`.

use arbor::data::{synthetic, PAD};
use arbor::dist::pipeline::{PipeSettings, Stack, Stage};
use arbor::dist::schedule::Kind;
use arbor::dist::DEFAULT_TIMEOUT;
use arbor::layers::LossOn;
use arbor::nn::Model;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use arbor::trainer::{on_threads, Event, Splits};

fn main() -> arbor::Result<()> {
    let kind = match std::env::args().nth(1).as_deref() {
        Some("1f1b") => Kind::OneFOneBFlush,
        _ => Kind::TwoBw,
    };
    let (train, dev, test) =
        (synthetic::generate(4000, 12, 1), synthetic::generate(500, 12, 2), synthetic::generate(500, 12, 3));
    let mut rng = Rng::new(1);
    let vocab = synthetic::vocab().len();
    let stack = Stack::new(Model::TreeLstm, 2, 32, 64, vocab, Some(PAD), synthetic::CLASSES, &mut rng)?;
    let stages: Vec<Stage> = stack
        .split(2)?
        .into_iter()
        .map(|part| Stage::new(part, Optimizer::new(Config::new(Rule::Adam, 0.01)), rng.clone()))
        .collect();
    let plan = PipeSettings {
        kind,
        micro_batches: 2,
        epochs: 3,
        batch: 25,
        loss_on: LossOn::All,
        clip: Some(5.0),
        max_steps: None,
    };
    let splits = Splits { train: &train, dev: &dev, test: &test };
    let mut events = |e: Event| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
        }
    };
    // The last stage holds the classifier, so it reports.
    let results = on_threads(stages, DEFAULT_TIMEOUT, 1, &mut events, |mut stage, coll, report| {
        let summary = stage.fit(splits, &plan, coll, report)?;
        Ok((summary, stage.test_acc))
    })?;
    if let Some((summary, test_acc)) = results.last() {
        println!(
            "{kind:?}: {:.0} sentences/s, test root accuracy {test_acc:.4}",
            summary.sentences as f64 / summary.train_seconds
        );
    }
    Ok(())
}
