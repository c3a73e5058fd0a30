//! `arbor predict`: a checkpoint classifies new sentences, one JSON line each.

use crate::args::PrecisionArg;
use crate::args::PredictArgs;
use crate::eval::{scored_checkpoint, vocabulary, Restored};
use crate::{on_device, OnDevice};
use arbor::checkpoint::Checkpoint;
use arbor::data::{sick, sst, TreeExample, Vocab};
use arbor::head::{argmax, probabilities};
use arbor::model::Model;
use arbor::nn::CellKind;
use arbor::{Backend, Error, Result};
use serde_json::json;
use std::io::BufRead;

/// Sentences classified per pass.
const CHUNK: usize = 256;

/// Classifies the sentences of `args` (arguments, `--input` or standard input) with the
/// checkpoint's tree or sequence model and prints, per sentence, its predicted class, the
/// probabilities of every class and, for an SST tree with a root label, that label as `gold`.
pub(crate) fn predict(args: &PredictArgs) -> Result<()> {
    let (_, ck) = scored_checkpoint(&args.checkpoint, "predicting with")?;
    let name = ck.meta["model"].as_str().unwrap_or_default().to_string();
    if name == "sick" {
        return relate(args, &ck);
    }
    let kind = CellKind::from_name(&name)?;
    let (words, lowercase) = vocabulary(&ck.meta);
    let vocab = Vocab::from_words(&words, lowercase);
    struct Work<'a>(&'a Checkpoint, &'a PredictArgs, CellKind, &'a Vocab, usize);
    impl OnDevice for Work<'_> {
        type Out = ();
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<()> {
            classify(Restored::from(backend, self.2, self.0, self.4)?, self.1, self.2, self.3)
        }
    }
    on_device(args.device, PrecisionArg::F32, Work(&ck, args, kind, &vocab, words.len()))
}

/// A sentence read and waiting for its pass: its text, its tree and its gold class, if any.
type Pending = (String, TreeExample, Option<u32>);

/// [`predict`] with `model`: reads every sentence, classifying them [`CHUNK`] at a time.
fn classify<B: Backend>(mut model: Restored<B>, args: &PredictArgs, kind: CellKind, vocab: &Vocab) -> Result<()> {
    let mut pending: Vec<Pending> = Vec::new();
    let mut read = |text: String, file: &str, number: usize| -> Result<()> {
        if !text.trim().is_empty() {
            let (tree, gold) = sst::parse_input(&text, file, number, vocab)?;
            pending.push((text, if kind.chains() { tree.to_chain() } else { tree }, gold));
        }
        if pending.len() >= CHUNK {
            print(&mut model, &mut pending)?;
        }
        Ok(())
    };
    each_input(args, &mut read)?;
    print(&mut model, &mut pending)
}

/// Calls `read` with every input of `args` (the arguments, else the lines of --input, else those
/// of standard input), with the file and line it came from.
fn each_input(args: &PredictArgs, read: &mut dyn FnMut(String, &str, usize) -> Result<()>) -> Result<()> {
    if !args.sentences.is_empty() {
        for (k, sentence) in args.sentences.iter().enumerate() {
            read(sentence.clone(), "argument", k + 1)?;
        }
    } else if let Some(path) = &args.input {
        let file = path.display().to_string();
        for line in arbor::data::lines::lines(path)? {
            let (number, text) = line?;
            read(text, &file, number)?;
        }
    } else {
        for (k, line) in std::io::stdin().lock().lines().enumerate() {
            let text = line.map_err(|e| Error::Parse { file: "stdin".into(), line: k + 1, msg: e.to_string() })?;
            read(text, "stdin", k + 1)?;
        }
    }
    Ok(())
}

/// Scores the sentence pairs of `args` (each `A<TAB>B`, or with heads as in the SICK files:
/// [`sick::parse_pair`]) with the checkpoint's relatedness model, printing per pair its expected
/// relatedness (1 to 5).
fn relate(args: &PredictArgs, ck: &Checkpoint) -> Result<()> {
    let (words, lowercase) = vocabulary(&ck.meta);
    let vocab = Vocab::from_words(&words, lowercase);
    struct Work<'a>(&'a Checkpoint, &'a PredictArgs, &'a Vocab);
    impl OnDevice for Work<'_> {
        type Out = ();
        fn run<B: Backend<Buffer: Send, Index: Send> + Send>(self, backend: B) -> Result<()> {
            let mut model = Model::from_checkpoint(self.0, &backend)?;
            let mut pending: Vec<(String, sick::Pair)> = Vec::new();
            let mut flush = |pending: &mut Vec<(String, sick::Pair)>| -> Result<()> {
                let pairs: Vec<sick::Pair> = pending.iter().map(|(_, p)| p.clone()).collect();
                for ((text, _), score) in pending.drain(..).zip(sick::predict(&mut model, &pairs)?) {
                    println!("{}", json!({"input": text.trim(), "relatedness": score}));
                }
                Ok(())
            };
            each_input(self.1, &mut |text, file, number| {
                if !text.trim().is_empty() {
                    pending.push((text.clone(), sick::parse_pair(&text, file, number, self.2)?));
                }
                if pending.len() >= CHUNK {
                    flush(&mut pending)?;
                }
                Ok(())
            })?;
            flush(&mut pending)
        }
    }
    on_device(args.device, PrecisionArg::F32, Work(ck, args, &vocab))
}

/// Classifies the `pending` sentences and prints a JSON line for each.
fn print<B: Backend>(model: &mut Restored<B>, pending: &mut Vec<Pending>) -> Result<()> {
    if pending.is_empty() {
        return Ok(());
    }
    let trees: Vec<TreeExample> = pending.iter().map(|(_, t, _)| t.clone()).collect();
    for ((text, _, gold), logits) in pending.drain(..).zip(model.root_logits(&trees)?) {
        let mut line = json!({"input": text.trim(), "class": argmax(&logits), "probabilities": probabilities(&logits)});
        if let Some(gold) = gold {
            line["gold"] = json!(gold);
        }
        println!("{line}");
    }
    Ok(())
}
