//! The optimizer's backend calls run on any backend the same way: four steps of a dense update
//! and of table rows under gates that clip and skip, a scaling, a sum of squares and the gate
//! decided from it, for every rule with and without weight decay, on random values.

use arbor::backend::{IndexLoc, Loc, Mem, OptimAt};
use arbor::gate::{self, GATE_LEN, SUM_WORDS};
use arbor::optim::{Config, Rule, Update};
use arbor::rng::Rng;
use arbor::Backend;

/// Every rule, with and without weight decay.
pub fn configs() -> Vec<Config> {
    let rules = [Rule::Sgd { momentum: 0.0 }, Rule::Sgd { momentum: 0.9 }, Rule::Adagrad, Rule::Adam, Rule::AdamW];
    rules.iter().flat_map(|&r| [0.0, 0.01].map(|wd| Config { weight_decay: wd, ..Config::new(r, 0.05) })).collect()
}

/// The rows each of the four steps updates (of a table of [`VOCAB`] rows of [`DIM`]).
pub const ROWS: [&[u32]; 4] = [&[0, 2, 5], &[1, 2], &[2, 3, 4, 5], &[1, 4]];
/// The gate of each step ([`arbor::gate`]): none, one that halves the gradients (clipping), one
/// that leaves them, one that skips the step.
pub const GATES: [Option<[f32; GATE_LEN]>; 4] = [None, Some([0.5, 1.0]), Some([1.0, 1.0]), Some([0.75, 0.0])];
/// The norm the decided gate clips to.
pub const CLIP: f32 = 1.0;
/// The table's rows and their width.
pub const VOCAB: usize = 6;
/// See [`VOCAB`].
pub const DIM: usize = 4;
/// The dense tensor's length.
pub const N: usize = 37;

/// The starting values and the gradients of the three steps.
pub struct Data {
    /// The dense tensor.
    pub p: Vec<f32>,
    /// The table.
    pub table: Vec<f32>,
    /// The dense gradient of each step ([`ROWS`]`.len()` steps).
    pub dense: Vec<Vec<f32>>,
    /// The rows' gradient of each step.
    pub rows: Vec<Vec<f32>>,
}

/// [`Data`] drawn from `seed`.
pub fn data(seed: u64) -> Data {
    let mut rng = Rng::new(seed);
    let mut values = |len: usize| (0..len).map(|_| rng.range(-1.5, 1.5)).collect::<Vec<f32>>();
    let (p, table) = (values(N), values(VOCAB * DIM));
    let dense = (0..ROWS.len()).map(|_| values(N)).collect();
    let rows = ROWS.iter().map(|r| values(r.len() * DIM)).collect();
    Data { p, table, dense, rows }
}

/// What [`run`] and [`host_reference`] give: the values and state after (`p`, `m`, `v`, table,
/// its `m`, its `v`, the scaled values, the average), the sum of squares of `p`, and the gate
/// decided from the sums of squares of `p` and of the table clipping to [`CLIP`].
pub type Outcome = (Vec<Vec<f32>>, f64, [f32; GATE_LEN]);

/// Runs the four steps of `config` on `backend` over [`data`]`(seed)` — the dense tensor, the
/// table's rows, each step under its gate of [`GATES`] — then scales the dense values by 0.4,
/// moves a weight average (over `m`) toward them and decides a gate from the sums of squares of
/// the values and the table.
pub fn run<B: Backend>(backend: &B, config: Config, seed: u64) -> Outcome {
    let Data { p, table, dense, rows } = data(seed);
    let w = VOCAB * DIM;
    // One buffer: [p | m | v | table | em | ev | g | row gradient | gate | sums | decided gate];
    // one index buffer.
    let mut at = vec![0, N, 2 * N, 3 * N, 3 * N + w, 3 * N + 2 * w, 3 * N + 3 * w, 4 * N + 3 * w];
    at.push(at[7] + 4 * DIM);
    at.push(at[8] + GATE_LEN);
    at.push(at[9] + 2 * SUM_WORDS);
    let len = at[10] + GATE_LEN;
    let mut buf = backend.alloc(len).unwrap();
    backend.write(&mut buf, at[0], &p).unwrap();
    backend.write(&mut buf, at[3], &table).unwrap();
    let mut index = backend.alloc_index(4).unwrap();
    let loc = |k: usize| Loc { buf: 0, offset: at[k] };
    for (t, gate) in GATES.iter().enumerate() {
        backend.write(&mut buf, at[6], &dense[t]).unwrap();
        backend.write(&mut buf, at[7], &rows[t]).unwrap();
        backend.write_index(&mut index, 0, ROWS[t]).unwrap();
        if let Some(g) = gate {
            backend.write(&mut buf, at[8], g).unwrap();
        }
        let gate = gate.map(|_| loc(8));
        let dense_at = OptimAt { p: loc(0), g: loc(6), m: loc(1), v: loc(2), gate };
        let rows_at = OptimAt { p: loc(3), g: loc(7), m: loc(4), v: loc(5), gate };
        let u = Update::new(config, t as u64 + 1);
        let (mut bufs, indexes) = ([buf], [index]);
        let mut mem = Mem { data: &mut bufs, index: &indexes };
        backend.update(&mut mem, &u, &dense_at, N).unwrap();
        let rows_index = IndexLoc { buf: 0, offset: 0 };
        backend.update_rows(&mut mem, &u, &rows_at, (DIM, VOCAB), rows_index, ROWS[t].len()).unwrap();
        let [b] = bufs;
        let [i] = indexes;
        (buf, index) = (b, i);
    }
    let mut bufs = [buf];
    let mut mem = Mem { data: &mut bufs, index: &[] };
    backend.sum_squares(&mut mem, &[(loc(0), N), (loc(3), w)], loc(9)).unwrap();
    backend.decide(&mut mem, loc(9), 2, CLIP, loc(10)).unwrap();
    let sum = gate::region_sums(&backend.read_vec(&bufs[0], at[9], SUM_WORDS).unwrap(), 1)[0];
    let decided = backend.read_vec(&bufs[0], at[10], GATE_LEN).unwrap();
    let mut all = backend.read_vec(&bufs[0], 0, at[6]).unwrap();
    let mut mem = Mem { data: &mut bufs, index: &[] };
    backend.scale(&mut mem, loc(0), N, 0.4).unwrap();
    all.extend(backend.read_vec(&bufs[0], 0, N).unwrap());
    // A weight average (over the first state tensor) moved toward the scaled values.
    let mut mem = Mem { data: &mut bufs, index: &[] };
    backend.average(&mut mem, loc(1), loc(0), N, 0.9).unwrap();
    all.extend(backend.read_vec(&bufs[0], at[1], N).unwrap());
    let parts = [N, N, N, w, w, w, N, N];
    let mut rest = all.as_slice();
    let out = parts
        .iter()
        .map(|&k| {
            let (a, b) = rest.split_at(k);
            rest = b;
            a.to_vec()
        })
        .collect();
    (out, sum, [decided[0], decided[1]])
}

/// What the host optimizer makes of [`data`]`(seed)` under `config`, as [`run`] returns it: the
/// steps [`GATES`] applies, their gradients multiplied by the gate's factor, then the values
/// clipped from norm 2.5 to 1 (scaled by 0.4), the weight average, the sum of squares of the
/// values and the gate of the values' and the table's norm.
pub fn host_reference(config: Config, seed: u64) -> Outcome {
    use arbor::layers::SparseGrad;
    use arbor::optim::{clip_to, sum_squares, Optimizer};
    let Data { mut p, mut table, mut dense, mut rows } = data(seed);
    let mut opt = Optimizer::new(config);
    for (t, gate) in GATES.iter().enumerate() {
        let [factor, applied] = gate.unwrap_or([1.0, 1.0]);
        if applied == 0.0 {
            continue;
        }
        if factor != 1.0 {
            dense[t].iter_mut().chain(rows[t].iter_mut()).for_each(|g| *g *= factor);
        }
        opt.begin_step();
        opt.dense("w", &mut p, &dense[t]);
        let g = SparseGrad { rows: ROWS[t].to_vec(), values: rows[t].clone() };
        opt.sparse("embedding", &mut table, DIM, &g);
    }
    let mut scaled = p.clone();
    clip_to(&mut [scaled.as_mut_slice()], 2.5, 1.0);
    let sum = sum_squares(&[p.clone().as_mut_slice()]);
    let mut words = vec![0.0; 2 * SUM_WORDS];
    gate::put_f64(&mut words, sum);
    gate::put_f64(&mut words[SUM_WORDS..], sum_squares(&[table.clone().as_mut_slice()]));
    let (w, e) = (&opt.slots["w"], &opt.slots["embedding"]);
    // The weight average over the first state tensor, toward the scaled values.
    let mut avg = w.m.clone();
    arbor::optim::average(&mut avg, &scaled, 0.9);
    let out = [&p, &w.m, &w.v, &table, &e.m, &e.v, &scaled, &avg].map(|v| v.to_vec()).to_vec();
    (out, sum, gate::decide(&words, 2, CLIP))
}
