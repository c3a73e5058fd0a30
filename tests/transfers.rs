//! What a training step and a scoring pass move between the host and a device, counted by a
//! backend that runs on the CPU but, as a GPU, keeps no host memory the engine may change in
//! place and reads rows as the CUDA backend does: the optimizer's part of a step moves nothing
//! parameter-sized — one read of sums of squares per engine — an SST step moves the minibatch's
//! ids and indices and the rows between the cells and the head (under 4 KiB back at batch 1),
//! and scoring reads back only the rows the head uses and its outputs. The counts (bytes each way, synchronizing reads, backend calls) are
//! printed for BENCHMARKS.md.

use arbor::backend::{Gemm, IndexLoc, Loc, Mem, OptimAt, Rows};
use arbor::data::labelled::Labelled;
use arbor::data::sst;
use arbor::fusion::Kernel;
use arbor::layers::LossOn;
use arbor::model::{AsExample, Example, Model};
use arbor::optim::{Config, Optimizer, Rule, Update};
use arbor::rng::Rng;
use arbor::{nn, Backend, CpuBackend, HostBuffer};
use std::io::Write;
use std::sync::{Arc, Mutex};

/// Host–device traffic so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Counts {
    /// Bytes copied to the device (values and indices).
    up: usize,
    /// Bytes copied back.
    down: usize,
    /// Copies back (each waits for the device).
    reads: usize,
    /// The largest single copy either way, in bytes.
    largest: usize,
    /// Compute calls (kernel launches on a GPU).
    calls: usize,
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        let (up, down, reads, calls) = (self.up - o.up, self.down - o.down, self.reads - o.reads, self.calls - o.calls);
        Counts { up, down, reads, calls, largest: self.largest }
    }
}

/// The CPU backend, counting what a device backend would copy and launch.
#[derive(Default)]
struct Counting {
    cpu: CpuBackend,
    counts: Arc<Mutex<Counts>>,
}

impl Counting {
    fn now(&self) -> Counts {
        *self.counts.lock().unwrap()
    }
    /// Starts the largest-copy record afresh.
    fn reset_largest(&self) {
        self.counts.lock().unwrap().largest = 0;
    }
    fn copy(&self, up: bool, bytes: usize) {
        let mut c = self.counts.lock().unwrap();
        if up {
            c.up += bytes;
        } else {
            c.down += bytes;
            c.reads += 1;
        }
        c.largest = c.largest.max(bytes);
    }
    fn call(&self) {
        self.counts.lock().unwrap().calls += 1;
    }
}

/// The same memory, as the CPU backend's.
fn cpu<'a>(mem: &'a mut Mem<'_, Counting>) -> Mem<'a, CpuBackend> {
    Mem { data: &mut *mem.data, index: mem.index }
}

impl Backend for Counting {
    type Buffer = HostBuffer;
    type Index = Vec<u32>;

    fn name(&self) -> &'static str {
        "counting"
    }
    fn replica(&self) -> arbor::Result<Counting> {
        Ok(Counting { cpu: CpuBackend::new(), counts: Arc::clone(&self.counts) })
    }
    fn alloc(&self, len: usize) -> arbor::Result<HostBuffer> {
        self.cpu.alloc(len)
    }
    fn alloc_index(&self, len: usize) -> arbor::Result<Vec<u32>> {
        self.cpu.alloc_index(len)
    }
    fn allocations(&self) -> usize {
        self.cpu.allocations()
    }
    fn len(&self, buf: &HostBuffer) -> usize {
        buf.len()
    }
    fn index_len(&self, buf: &Vec<u32>) -> usize {
        buf.len()
    }
    fn write(&self, buf: &mut HostBuffer, offset: usize, src: &[f32]) -> arbor::Result<()> {
        self.copy(true, 4 * src.len());
        self.cpu.write(buf, offset, src)
    }
    fn write_index(&self, buf: &mut Vec<u32>, offset: usize, src: &[u32]) -> arbor::Result<()> {
        self.copy(true, 4 * src.len());
        self.cpu.write_index(buf, offset, src)
    }
    fn read(&self, buf: &HostBuffer, offset: usize, dst: &mut [f32]) -> arbor::Result<()> {
        self.copy(false, 4 * dst.len());
        self.cpu.read(buf, offset, dst)
    }
    /// As the CUDA backend reads rows: one copy of the span they lie in where they are close
    /// together, else their numbers sent and only they read back.
    fn read_rows(
        &self,
        buf: &HostBuffer,
        offset: usize,
        block: usize,
        rows: &[u32],
        dst: &mut [f32],
    ) -> arbor::Result<()> {
        let (lo, hi) = (rows.iter().min().copied().unwrap_or(0), rows.iter().max().map_or(0, |&r| r + 1));
        if (hi - lo) as usize <= 2 * rows.len() {
            self.copy(false, 4 * block * (hi - lo) as usize);
        } else {
            self.copy(true, 4 * rows.len());
            self.copy(false, 4 * block * rows.len());
        }
        self.cpu.read_rows(buf, offset, block, rows, dst)
    }
    fn fill(&self, mem: &mut Mem<'_, Self>, dst: Loc, len: usize, value: f32) -> arbor::Result<()> {
        self.call();
        self.cpu.fill(&mut cpu(mem), dst, len, value)
    }
    fn gemm(&self, mem: &mut Mem<'_, Self>, g: &Gemm) -> arbor::Result<()> {
        self.call();
        self.cpu.gemm(&mut cpu(mem), g)
    }
    fn fused(
        &self,
        mem: &mut Mem<'_, Self>,
        k: &Kernel,
        n: usize,
        loads: &[Rows],
        stores: &[Loc],
    ) -> arbor::Result<()> {
        self.call();
        self.cpu.fused(&mut cpu(mem), k, n, loads, stores)
    }
    fn scatter_add(&self, mem: &mut Mem<'_, Self>, src: Loc, block: usize, n: usize, dst: &Rows) -> arbor::Result<()> {
        self.call();
        self.cpu.scatter_add(&mut cpu(mem), src, block, n, dst)
    }
    fn sum_rows(
        &self,
        mem: &mut Mem<'_, Self>,
        src: Loc,
        rows: usize,
        cols: usize,
        dst: Loc,
        accumulate: bool,
    ) -> arbor::Result<()> {
        self.call();
        self.cpu.sum_rows(&mut cpu(mem), src, rows, cols, dst, accumulate)
    }
    fn update(&self, mem: &mut Mem<'_, Self>, u: &Update, at: &OptimAt, len: usize) -> arbor::Result<()> {
        self.call();
        self.cpu.update(&mut cpu(mem), u, at, len)
    }
    fn update_rows(
        &self,
        mem: &mut Mem<'_, Self>,
        u: &Update,
        at: &OptimAt,
        table: (usize, usize),
        rows: IndexLoc,
        n: usize,
    ) -> arbor::Result<()> {
        self.call();
        self.cpu.update_rows(&mut cpu(mem), u, at, table, rows, n)
    }
    fn sum_squares(&self, mem: &mut Mem<'_, Self>, regions: &[(Loc, usize)]) -> arbor::Result<Vec<f64>> {
        self.calls_then_copy(regions.len());
        self.cpu.sum_squares(&mut cpu(mem), regions)
    }
    fn scale(&self, mem: &mut Mem<'_, Self>, dst: Loc, len: usize, s: f32) -> arbor::Result<()> {
        self.call();
        self.cpu.scale(&mut cpu(mem), dst, len, s)
    }
}

impl Counting {
    /// A sum of squares of `regions` regions: a launch each, then one read of 8 bytes each.
    fn calls_then_copy(&self, regions: usize) {
        (0..regions).for_each(|_| self.call());
        self.copy(false, 8 * regions);
    }
}

/// The SST Tree-LSTM of the benchmarks (hidden 150, embed 300, root loss) on the counting
/// backend, with the parameters' tensors and bytes (cell and head).
fn sst_model(vocab: usize, rng: &mut Rng) -> (Model<Counting>, Counting, (usize, usize)) {
    let backend = Counting::default();
    let cell = nn::tree_lstm(300, 150).unwrap();
    let readout = Labelled::readout(LossOn::Root);
    let model =
        arbor::zoo::tree_classifier_on(&backend, vec![cell], vocab, sst::CLASSES, readout, rng).expect("the model");
    let dense: Vec<usize> =
        model.tensors().unwrap().iter().filter(|t| t.0 != "embedding").map(|t| 4 * t.2.len()).collect();
    let counter = Counting { cpu: CpuBackend::new(), counts: Arc::clone(&backend.counts) };
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
        counter.reset_largest();
        let before = counter.now();
        let mut grads = model.gradients_kept(&examples, batch).unwrap();
        let formed = counter.now();
        counter.reset_largest();
        assert!(model.apply(&mut grads, &mut opt, Some(5.0)).unwrap());
        let applied = counter.now() - formed;
        // The update: per engine (the cell's, the head's) one read of its sums of squares (8
        // bytes each: all its parameters' gradients, and the cell's word vectors'), one update of
        // all its tensors (they share the rule), and the word vectors' rows; nothing sent.
        let want = Counts { up: 0, down: 24, reads: 2, calls: 6, largest: 16 };
        assert_eq!(applied, want, "the update of {tensors} tensors");
        let step = counter.now() - before;
        // What crosses is the minibatch's ids and index arrays, the roots' rows between the cell
        // and the head and their gradients, the losses and the sums of squares: at batch 1 under
        // 8 KiB up and 4 KiB back, at batch 64 under 192 KiB and 96 KiB; never a parameter, a
        // word vector or a whole pass's rows (the parameters are 1.8 MB, a batch's word vectors
        // 1.7 MB, its pushed rows' gradients 1.7 MB).
        let (up, down) = if batch == 1 { (8 << 10, 4 << 10) } else { (192 << 10, 96 << 10) };
        assert!(step.up <= up && step.down <= down && step.reads <= 8, "batch {batch}: {step:?}");
        if batch == 1 {
            assert!((formed - before).largest < params / 32, "batch 1: {step:?}");
        }
        report.push(format!(
            "transfers: SST Tree-LSTM h150 e300, batch {batch}: {} bytes to the device, {} back in {} reads, \
             {} backend calls (the update: {} calls, {} bytes back in {} reads)",
            step.up, step.down, step.reads, step.calls, applied.calls, applied.down, applied.reads
        ));
    }
    let _ = writeln!(std::io::stderr(), "{}", report.join("\n"));
}

/// Scoring 64 test sentences (a root readout) reads back the roots' rows for the head and the
/// head's outputs, nothing more (the engine asks for the roots only, and rows far apart are
/// gathered on the device before they are read).
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
    // 64 roots of 150 values, and per example the head's outputs (a loss, 5 probabilities, …).
    let roots = 4 * 64 * 150;
    assert!(scored.down <= roots + 4 * 64 * 16, "scoring read back {scored:?}");
    let _ = writeln!(
        std::io::stderr(),
        "transfers: scoring 64 SST sentences: {} bytes to the device, {} back in {} reads, {} backend calls",
        scored.up,
        scored.down,
        scored.reads,
        scored.calls
    );
}
