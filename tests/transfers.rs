//! What a training step and a scoring pass move between the host and a device, counted by a
//! backend that runs on the CPU but, as a GPU, keeps no host memory the engine may change in
//! place and reads rows as the CUDA backend does: an SST step moves the minibatch's ids and
//! indices and under 4 KiB of values up, and reads back under 4 KiB — the step's gate and the
//! head's outputs — in **one** read, after its last launch: the test of the gradients, the
//! clipping and the optimizer run on the device; the rows between the cells and the head stay
//! on the device, and scoring reads back only the head's outputs. The counts (bytes each way,
//! synchronizing reads, backend calls) are printed for BENCHMARKS.md.

mod common;

use arbor::data::labelled::Labelled;
use arbor::data::sst;
use arbor::layers::LossOn;
use arbor::model::{AsExample, Example, Model};
use arbor::nn;
use arbor::optim::{Config, Optimizer, Rule};
use arbor::rng::Rng;
use common::watched::{Watch, Watched};
use std::io::Write;
use std::sync::{Arc, Mutex};

/// Host–device traffic so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Counts {
    /// Bytes copied to the device (values and indices).
    up: usize,
    /// Of them, indices (the minibatch's index arrays: children, word ids, rows).
    index: usize,
    /// Bytes copied back.
    down: usize,
    /// Copies back (each waits for the device).
    reads: usize,
    /// The largest single copy either way, in bytes.
    largest: usize,
    /// Compute calls (kernel launches on a GPU).
    calls: usize,
    /// Whether a copy back came since the marks were reset.
    read_done: bool,
    /// Compute calls made after such a copy: work the host launched only once it had waited.
    after_read: usize,
    /// Whether the engine is in a launch list a device may hold ([`arbor::Backend::hold_launches`]).
    holding: bool,
    /// Launch lists, and the compute calls in them.
    lists: usize,
    held: usize,
    /// The most calls in one list.
    longest: usize,
    /// Calls in the list now.
    in_list: usize,
    /// Copies either way made inside a launch list (each would end a device's held run early).
    copies_held: usize,
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        let (up, down, reads, calls) = (self.up - o.up, self.down - o.down, self.reads - o.reads, self.calls - o.calls);
        let after_read = self.after_read - o.after_read;
        let (lists, held, copies_held) = (self.lists - o.lists, self.held - o.held, self.copies_held - o.copies_held);
        let index = self.index - o.index;
        Counts { up, index, down, reads, calls, after_read, lists, held, copies_held, ..self }
    }
}

/// What a device backend would copy and launch, counted (shared with replicas).
#[derive(Clone, Default)]
struct Counter(Arc<Mutex<Counts>>);

impl Counter {
    fn now(&self) -> Counts {
        *self.0.lock().unwrap()
    }
    /// Starts the largest-copy and longest-list records and the read mark afresh.
    fn reset_marks(&self) {
        let mut c = self.0.lock().unwrap();
        (c.largest, c.longest, c.read_done) = (0, 0, false);
    }
}

impl Watch for Counter {
    fn replica(&self) -> Counter {
        self.clone()
    }
    fn copy(&self, up: bool, bytes: usize) {
        let mut c = self.0.lock().unwrap();
        c.copies_held += usize::from(c.holding);
        if up {
            c.up += bytes;
        } else {
            c.down += bytes;
            c.reads += 1;
            c.read_done = true;
        }
        c.largest = c.largest.max(bytes);
    }
    fn index(&self, bytes: usize) {
        self.0.lock().unwrap().index += bytes;
        self.copy(true, bytes);
    }
    fn call(&self) {
        let mut c = self.0.lock().unwrap();
        c.calls += 1;
        c.after_read += usize::from(c.read_done);
        if c.holding {
            c.held += 1;
            c.in_list += 1;
        }
    }
    fn hold(&self, on: bool) {
        let mut c = self.0.lock().unwrap();
        if !on && c.holding {
            (c.lists, c.longest, c.in_list) = (c.lists + 1, c.longest.max(c.in_list), 0);
        }
        c.holding = on;
    }
}

/// The CPU backend, counting what a device backend would copy and launch.
type Counting = Watched<Counter>;

/// The SST Tree-LSTM of the benchmarks (hidden 150, embed 300, root loss) on the counting
/// backend, with the parameters' tensors and bytes (cell and head).
fn sst_model(vocab: usize, rng: &mut Rng) -> (Model<Counting>, Counter, (usize, usize)) {
    let backend = Counting::new(Counter::default());
    let cell = nn::tree_lstm(300, 150).unwrap();
    let readout = Labelled::readout(LossOn::Root);
    let model =
        arbor::zoo::tree_classifier_on(&backend, vec![cell], vocab, sst::CLASSES, readout, rng).expect("the model");
    let dense: Vec<usize> =
        model.tensors().unwrap().iter().filter(|t| t.0 != "embedding").map(|t| 4 * t.2.len()).collect();
    let counter = backend.watch.clone();
    (model, counter, (dense.len(), dense.iter().sum()))
}

#[test]
fn a_training_step_moves_nothing_parameter_sized() {
    let splits = sst::read_splits(&arbor::data::data_dir().join("sst"), false)
        .unwrap_or_else(|e| panic!("SST data not found ({e}); set ARBOR_DATA to the folder holding sst/"));
    let mut rng = Rng::new(45);
    let (mut model, counter, (tensors, params)) = sst_model(splits.vocab.len(), &mut rng);
    let train = Labelled::all(&splits.train, LossOn::Root, sst::CLASSES);
    let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.05));
    let mut report = Vec::new();
    for batch in [64, 1] {
        let examples: Vec<Example<'_>> = train[..batch].iter().map(|e| e.example()).collect();
        // A first step allocates what later steps reuse.
        model.step(&examples, &mut opt, Some(5.0)).unwrap();
        counter.reset_marks();
        let (before, calls_before) = (counter.now(), model.calls());
        let mut grads = model.gradients_kept(&examples, batch).unwrap();
        let formed = counter.now();
        // Forming the gradients launches everything and reads nothing back.
        assert_eq!((formed - before).reads, 0, "batch {batch}: {:?}", formed - before);
        assert!(model.apply(&mut grads, &mut opt, Some(5.0)).unwrap());
        let applied = counter.now() - formed;
        let passes = formed - before;
        // The update: per engine (the cell's, the head's) a zeroing of its partial sums and a
        // sum of squares per region (the cell's parameters and word vectors, the head's), the
        // gate, the head's outputs copied beside it, one update of all of an engine's tensors
        // (they share the rule) and of the word vectors' rows; nothing sent, and one read — the
        // gate and the outputs — after the last launch.
        let outputs = 4 * grads.outputs.iter().map(Vec::len).sum::<usize>();
        let want = Counts { up: 0, down: 8 + outputs, reads: 1, calls: 10, after_read: 0, ..Counts::default() };
        // (The outputs' copy beside the gate is a launch list of its own.)
        let (largest, longest, lists, held) = (0, 0, 0, 0);
        let applied_calls = Counts { largest, read_done: false, longest, lists, held, ..applied };
        assert_eq!(applied_calls, want, "the update of {tensors} tensors");
        // The passes' launch lists, which a device may issue whole (as CUDA graphs), hold
        // nothing but launches: no copy either way inside one.
        assert_eq!(passes.copies_held, 0, "batch {batch}: copies inside a launch list: {passes:?}");
        assert!(passes.lists >= 4 && passes.held * 10 >= passes.calls * 7, "batch {batch}: {passes:?}");
        assert_eq!(grads.outputs.len(), 2, "batch {batch}: the head's outputs (loss, prediction) came with the gate");
        assert_eq!(grads.outputs[0].len(), batch, "batch {batch}: one loss per example");
        let step = counter.now() - before;
        // The engines count every call the backend saw (what `arbor bench` reports per step).
        assert_eq!(model.calls() - calls_before, step.calls as u64, "batch {batch}: the engines' count of calls");
        // What crosses is the minibatch's ids and index arrays plus under 4 KiB of values (the
        // targets and the head's output gradients) up, and under 4 KiB back in one read: the
        // gate and the head's outputs (the losses among them). The roots' rows pass from the
        // cells to the head, and their gradients back, on the device; never a parameter, a word
        // vector or a whole pass's rows (the parameters are 1.8 MB, a batch's word vectors
        // 1.7 MB, its pushed rows' gradients 1.7 MB).
        assert!(step.up - step.index <= 4 << 10, "batch {batch}: {step:?}");
        assert!(step.down <= 4 << 10 && step.reads == 1 && step.after_read == 0, "batch {batch}: {step:?}");
        if batch == 1 {
            assert!((formed - before).largest < params / 32, "batch 1: {step:?}");
        }
        report.push(format!(
            "transfers: SST Tree-LSTM h150 e300, batch {batch}: {} bytes to the device ({} of them indices), \
             {} back in {} reads, {} backend calls (the update: {} calls, {} bytes back in {} reads); \
             the passes' {} calls in {} launch lists, the longest {}",
            step.up,
            step.index,
            step.down,
            step.reads,
            step.calls,
            applied.calls,
            applied.down,
            applied.reads,
            passes.held,
            passes.lists,
            passes.longest
        ));
    }
    // A weight average kept in the engines moves nothing either: a copy to start it, then one
    // call per buffer (the cells' parameters and word vectors, the head's parameters).
    model.average_in_place(0.9).unwrap();
    let before = counter.now();
    model.average_in_place(0.9).unwrap();
    let avg = counter.now() - before;
    assert_eq!((avg.up, avg.down, avg.reads, avg.calls), (0, 0, 0, 3), "a weight average's update: {avg:?}");
    let _ = writeln!(std::io::stderr(), "{}", report.join("\n"));
}

/// Scoring 64 test sentences (a root readout) reads back the head's outputs, nothing more, in
/// one read: the roots' rows pass from the cells to the head on the device.
#[test]
fn inference_reads_back_the_rows_it_uses() {
    let splits = sst::read_splits(&arbor::data::data_dir().join("sst"), false)
        .unwrap_or_else(|e| panic!("SST data not found ({e}); set ARBOR_DATA to the folder holding sst/"));
    let mut rng = Rng::new(45);
    let (mut model, counter, _) = sst_model(splits.vocab.len(), &mut rng);
    let test = Labelled::all(&splits.test[..64], LossOn::Root, sst::CLASSES);
    model.score(&test).unwrap();
    let before = counter.now();
    model.score(&test).unwrap();
    let scored = counter.now() - before;
    // Per example the head's outputs (a loss, 5 probabilities, …), no root's row, in one read.
    assert!(scored.down <= 4 * 64 * 16 && scored.reads == 1, "scoring read back {scored:?}");
    let _ = writeln!(
        std::io::stderr(),
        "transfers: scoring 64 SST sentences: {} bytes to the device, {} back in {} reads, {} backend calls",
        scored.up,
        scored.down,
        scored.reads,
        scored.calls
    );
}
