//! A pipeline-parallel run: a model of two stacked Tree-LSTMs (layer 2 pulls layer 1's state at
//! every vertex) with a softmax classifier at every vertex, cut into two stages on two threads,
//! trained with PipeDream-2BW on the synthetic treebank:
//! `cargo run --release --example pipeline [1f1b|2bw]`.

use arbor::data::labelled::Labelled;
use arbor::data::{synthetic, PAD};
use arbor::dist::schedule::Kind;
use arbor::dist::DEFAULT_TIMEOUT;
use arbor::head::softmax_classifier;
use arbor::layers::{Embedding, LossOn};
use arbor::model::{Feed, Model};
use arbor::optim::{Config, Optimizer, Rule};
use arbor::pipeline::{Part, PipeSettings, Stage};
use arbor::readout::Readout;
use arbor::rng::Rng;
use arbor::trainer::{fit_together, Event, Run, Settings, Splits};
use arbor::{nn, CpuBackend};

fn main() -> arbor::Result<()> {
    let kind = match std::env::args().nth(1).as_deref() {
        Some("1f1b") => Kind::OneFOneBFlush,
        _ => Kind::TwoBw,
    };
    let trees = [synthetic::generate(4000, 12, 1), synthetic::generate(500, 12, 2), synthetic::generate(500, 12, 3)];
    let [train, dev, test] = trees.each_ref().map(|t| Labelled::all(t, LossOn::All, synthetic::CLASSES));
    let mut rng = Rng::new(1);
    let words = Embedding::new(synthetic::vocab().len(), 32, 0.1, &mut rng).with_padding(PAD);
    let head = softmax_classifier(64, synthetic::CLASSES)?;
    let model = Model::init(&CpuBackend::new(), words, nn::tree_lstm(32, 64)?, vec![Feed::Words], head, &mut rng)?
        .with_readout(Readout::Vertices)
        .stack(nn::tree_lstm(64, 64)?, &mut rng)?;
    // Each stage is trained by a run of its own in the one loop (with checkpoints, resume and a
    // weight average as any run): its optimizer holds the state of its part's tensors.
    let pipe = PipeSettings { kind, micro_batches: 2 };
    let mut runs: Vec<Run<Stage>> = Part::split(&model, 2)?
        .into_iter()
        .map(|part| Run::new(Stage::new(part, pipe), Optimizer::new(Config::new(Rule::Adam, 0.01)), &rng))
        .collect();
    let plan = Settings::new(3, 25);
    let splits = Splits { train: &train, dev: &dev, test: &test };
    let mut events = |e: Event| {
        if let Event::EpochEnd { epoch, loss, dev } = e {
            println!("epoch {epoch}: loss {loss:.4}, dev root accuracy {dev:.4}");
        }
    };
    // One thread per stage; the last stage holds the head, so it reports.
    let summary = fit_together(runs.iter_mut().collect(), DEFAULT_TIMEOUT, splits, &plan, &mut events)?;
    println!(
        "{kind:?}: {:.0} sentences/s, test root accuracy {:.4}",
        summary.sentences as f64 / summary.train_seconds,
        runs[0].test_acc()
    );
    Ok(())
}
