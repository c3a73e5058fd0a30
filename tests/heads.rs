//! Heads and losses (`arbor::head`): every loss against its formula and against central
//! differences, a head batched over examples equal to one example at a time, and a whole pair
//! model (a Tree-LSTM over two trees per example, a relatedness head, a KL loss) whose gradients
//! match finite differences of its loss — with no gradient written by hand.

use arbor::head::{binary_cross_entropy, kl_divergence, mean_squared_error, softmax_cross_entropy, Head};
use arbor::rng::Rng;
use arbor::testing::{check_model_gradients, GradCheck};
use arbor::Pass;
use arbor::{nn, Builder, CpuBackend, Engine, Init, InputGraph, Pull, Var, VertexFn};
use proptest::prelude::*;

const WIDTH: usize = 5;

/// A loss built from head ops: logits (or predictions) and targets to one value per example.
type Loss = for<'b> fn(Var<'b>, Var<'b>) -> Var<'b>;

/// A head pulling logits `z` and targets `t` (both `WIDTH` wide) and pushing `loss(z, t)`.
fn loss_head(name: &str, loss: Loss) -> Head<CpuBackend> {
    let f = Builder::new(name, 0);
    let (z, t) = (f.pull("z", WIDTH), f.pull("t", WIDTH));
    f.push("loss", loss(z, t));
    Head::new(CpuBackend::new(), f.build().unwrap(), &[]).unwrap()
}

/// Random rows of `WIDTH` values in `lo..hi`.
fn rows(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n * WIDTH).map(|_| lo + (hi - lo) * rng.uniform()).collect()
}

/// Rows that are distributions (a one-hot row first).
fn distributions(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut t = rows(rng, n, 0.0, 1.0);
    for (k, row) in t.chunks_mut(WIDTH).enumerate() {
        if k == 0 {
            row.iter_mut().enumerate().for_each(|(j, v)| *v = f32::from(j == 2));
        }
        let s: f32 = row.iter().sum();
        row.iter_mut().for_each(|v| *v /= s);
    }
    t
}

fn log_softmax(z: &[f64]) -> Vec<f64> {
    let m = z.iter().copied().fold(f64::MIN, f64::max);
    let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    z.iter().map(|v| v - lse).collect()
}

/// Each loss per example against its formula in f64, and the gradient of the summed loss with
/// respect to the logits against central differences.
#[test]
fn losses_match_their_formulas_and_finite_differences() {
    type Formula = fn(&[f64], &[f64]) -> f64;
    let ce: Formula = |z, t| -t.iter().zip(log_softmax(z)).map(|(t, l)| t * l).sum::<f64>();
    let kl: Formula =
        |z, p| p.iter().zip(log_softmax(z)).map(|(p, l)| if *p > 0.0 { p * (p.ln() - l) } else { 0.0 }).sum();
    let mse: Formula = |z, t| z.iter().zip(t).map(|(a, b)| (a - b).powi(2)).sum::<f64>() / WIDTH as f64;
    let bce: Formula = |z, t| {
        z.iter()
            .zip(t)
            .map(|(z, t)| -(t * (1.0 / (1.0 + (-z).exp())).ln() + (1.0 - t) * (1.0 / (1.0 + z.exp())).ln()))
            .sum()
    };
    let cases: [(&str, Loss, Formula); 4] = [
        ("cross-entropy", softmax_cross_entropy, ce),
        ("kl", |z, p| kl_divergence(z.log_softmax(), p), kl),
        ("mse", mean_squared_error, mse),
        ("bce", binary_cross_entropy, bce),
    ];
    let n = 4;
    for (seed, (name, loss, formula)) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64);
        let mut head = loss_head(name, loss);
        let z = rows(&mut rng, n, -3.0, 3.0);
        let t = distributions(&mut rng, n);
        let losses = head.forward(&[&z, &t]).unwrap().swap_remove(0);
        for (k, &got) in losses.iter().enumerate() {
            let at = k * WIDTH..(k + 1) * WIDTH;
            let (zk, tk): (Vec<f64>, Vec<f64>) =
                (z[at.clone()].iter().map(|&v| f64::from(v)).collect(), t[at].iter().map(|&v| f64::from(v)).collect());
            let want = formula(&zk, &tk);
            assert!((f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()), "{name} example {k}: {got} vs {want}");
        }
        let grads = head.backward(1.0).unwrap();
        let total = |head: &mut Head<CpuBackend>, z: &[f32]| -> f64 {
            head.infer(&[z, &t]).unwrap()[0].iter().map(|&v| f64::from(v)).sum()
        };
        let eps = 1e-2f32;
        for (i, &analytic) in grads.pulls[0].iter().enumerate() {
            let (mut up, mut down) = (z.clone(), z.clone());
            up[i] += eps;
            down[i] -= eps;
            let numeric = (total(&mut head, &up) - total(&mut head, &down)) / f64::from(2.0 * eps);
            let analytic = f64::from(analytic);
            assert!(
                (analytic - numeric).abs() <= 2e-3 + 1e-2 * numeric.abs(),
                "{name} d/dz[{i}]: {analytic} vs {numeric}"
            );
        }
        assert!(grads.pulls[0].iter().any(|&g| g != 0.0), "{name}: all gradients zero");
    }
    // Binary cross-entropy stays finite far out on both sides.
    let mut head = loss_head("bce", binary_cross_entropy);
    let z = [60.0, -60.0, 0.0, 88.0, -88.0];
    let loss = head.forward(&[&z, &[1.0, 0.0, 0.5, 0.0, 1.0]]).unwrap()[0][0];
    assert!((loss - (0.0 + 0.0 + std::f32::consts::LN_2 + 88.0 + 88.0)).abs() < 1e-3, "{loss}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// A head with parameters over `n` examples at once gives each example what it gives that
    /// example alone, and so do its input gradients.
    #[test]
    fn a_batched_head_equals_one_example_at_a_time(n in 1usize..12, seed in 0u64..1000) {
        let f = Builder::new("dense-head", 0);
        let (x, t) = (f.pull("x", 6), f.pull("t", WIDTH));
        let w = f.param("W", [6, WIDTH], Init::Xavier);
        let b = f.param("b", [1, WIDTH], Init::Uniform(0.5));
        f.push("loss", softmax_cross_entropy((x.matmul(w) + b).tanh().scale(3.0), t));
        let f = f.build().unwrap();
        let mut rng = Rng::new(seed);
        let params = f.init_params(&mut rng);
        let mut head = Head::new(CpuBackend::new(), f, &params).unwrap();
        let x: Vec<f32> = (0..n * 6).map(|_| rng.uniform() * 2.0 - 1.0).collect();
        let t = distributions(&mut rng, n);
        let all = head.forward(&[&x, &t]).unwrap().swap_remove(0);
        let dx = head.backward(1.0).unwrap().pulls.swap_remove(0);
        for k in 0..n {
            let one = head.forward(&[&x[k * 6..(k + 1) * 6], &t[k * WIDTH..(k + 1) * WIDTH]]).unwrap()[0][0];
            let g = head.backward(1.0).unwrap().pulls.swap_remove(0);
            prop_assert!((one - all[k]).abs() <= 1e-6 * (1.0 + one.abs()), "example {}: {} vs {}", k, one, all[k]);
            for (a, b) in g.iter().zip(&dx[k * 6..(k + 1) * 6]) {
                prop_assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "example {}: {} vs {}", k, a, b);
            }
        }
    }
}

/// Tai et al.'s relatedness head over roots `hidden` wide: `[|h_a − h_b|, h_a ⊙ h_b]`, a sigmoid
/// layer, a log-softmax over five scores, the KL divergence to the target distribution.
fn relatedness_head(hidden: usize, units: usize) -> VertexFn {
    let f = Builder::new("relatedness", 0);
    let (ha, hb, p) = (f.pull("ha", hidden), f.pull("hb", hidden), f.pull("target", WIDTH));
    let w = f.param("W", [2 * hidden, units], Init::Xavier);
    let b = f.param("b", [1, units], Init::Uniform(0.5));
    let v = f.param("V", [units, WIDTH], Init::Xavier);
    let log_q = ((ha - hb).abs().concat(ha * hb).matmul(w) + b).sigmoid().matmul(v).log_softmax();
    f.push("loss", kl_divergence(log_q, p));
    f.build().unwrap()
}

/// A pair model, end to end: the mean KL loss over three sentence pairs, each two random trees
/// run by one Tree-LSTM engine, their roots read by the relatedness head. The gradients of
/// every cell parameter, every head parameter and the input rows, assembled from the head's
/// input gradients fed back at the roots, match central differences of the loss.
#[test]
fn a_pair_model_gradient_matches_finite_differences() {
    let (embed, hidden, pairs) = (3, 4, 3);
    let mut rng = Rng::new(21);
    let cell = nn::tree_lstm(embed, hidden).unwrap();
    let head_fn = relatedness_head(hidden, 6);
    let (cell_params, head_params) = (cell.init_params(&mut rng), head_fn.init_params(&mut rng));
    // Trees a and b of each pair, in the order a₀ b₀ a₁ b₁ …
    let trees: Vec<InputGraph> = (0..2 * pairs).map(|k| InputGraph::balanced_binary(2 + k % 3)).collect();
    let graphs: Vec<&InputGraph> = trees.iter().collect();
    let vertices: usize = trees.iter().map(InputGraph::len).sum();
    let x: Vec<f32> = (0..vertices * embed).map(|_| rng.uniform() - 0.5).collect();
    let mut roots = Vec::new();
    let mut offset = 0;
    for t in &trees {
        roots.push(offset + t.len() - 1);
        offset += t.len();
    }
    let target = distributions(&mut rng, pairs);
    let split = |h: &[f32]| -> (Vec<f32>, Vec<f32>) {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for (k, row) in h.chunks(hidden).enumerate() {
            if k % 2 == 0 {
                a.extend_from_slice(row)
            } else {
                b.extend_from_slice(row)
            }
        }
        (a, b)
    };
    let mut cells = Engine::new(CpuBackend::new(), cell.clone(), &cell_params).unwrap();
    let mut head = Head::new(CpuBackend::new(), head_fn.clone(), &head_params).unwrap();
    // The loss, with cell parameters `cp`, head parameters `hp` and inputs `x`.
    let mut loss = |cp: &[Vec<f32>], hp: &[Vec<f32>], x: &[f32]| -> f64 {
        cells.set_params(cp).unwrap();
        head.engine().set_params(hp).unwrap();
        let h = cells.run(Pass::train(&graphs, &[Pull::Rows(x)]).rows(&roots)).unwrap().swap_remove(0);
        let (ha, hb) = split(&h);
        let l = head.infer(&[&ha, &hb, &target]).unwrap().swap_remove(0);
        l.iter().map(|&v| f64::from(v)).sum::<f64>() / pairs as f64
    };

    let mut cells_g = Engine::new(CpuBackend::new(), cell, &cell_params).unwrap();
    let mut head_g = Head::new(CpuBackend::new(), head_fn, &head_params).unwrap();
    let h = cells_g.run(Pass::train(&graphs, &[Pull::Rows(&x)]).rows(&roots)).unwrap().swap_remove(0);
    let (ha, hb) = split(&h);
    head_g.forward(&[&ha, &hb, &target]).unwrap();
    let hg = head_g.backward(1.0 / pairs as f32).unwrap();
    let mut dh = Vec::new();
    for (ga, gb) in hg.pulls[0].chunks(hidden).zip(hg.pulls[1].chunks(hidden)) {
        dh.extend_from_slice(ga);
        dh.extend_from_slice(gb);
    }
    let cg = cells_g.backward(&[&dh]).unwrap();

    let eps = 1e-2f32;
    let check = |what: &str, analytic: &[f32], numeric: &mut dyn FnMut(usize) -> f64| {
        assert!(analytic.iter().any(|&g| g != 0.0), "{what}: all gradients zero");
        for (i, &a) in analytic.iter().enumerate() {
            let n = numeric(i);
            let a = f64::from(a);
            assert!((a - n).abs() <= 2e-3 + 1e-2 * n.abs(), "{what}[{i}]: analytic {a}, numeric {n}");
        }
    };
    let central = |loss: &mut dyn FnMut(f32) -> f64| (loss(eps) - loss(-eps)) / f64::from(2.0 * eps);
    for (p, g) in cg.params.iter().enumerate() {
        check(&format!("cell parameter {p}"), g, &mut |i| {
            central(&mut |d| {
                let mut cp = cell_params.clone();
                cp[p][i] += d;
                loss(&cp, &head_params, &x)
            })
        });
    }
    for (p, g) in hg.params.iter().enumerate() {
        check(&format!("head parameter {p}"), g, &mut |i| {
            central(&mut |d| {
                let mut hp = head_params.clone();
                hp[p][i] += d;
                loss(&cell_params, &hp, &x)
            })
        });
    }
    check("input rows", &cg.pulls[0], &mut |i| {
        central(&mut |d| {
            let mut x = x.clone();
            x[i] += d;
            loss(&cell_params, &head_params, &x)
        })
    });
}

/// A whole model, through [`Model`]: word vectors, a Tree-LSTM over each example's tree (with a
/// second Tree-LSTM stacked on it, dropout on its rows, for the sum, mean and per-vertex
/// readouts), a pooling readout (sum, mean, max), the root, or every vertex with a target of its
/// own (or none), and a head with a hidden layer and dropout, trained by one SGD step of rate 1 —
/// so each parameter moves by minus its gradient. Those gradients match central differences of
/// the mean loss (the dropout masks held fixed: same key, training mode).
#[test]
fn a_pooled_model_gradient_matches_finite_differences() {
    use arbor::layers::Embedding;
    use arbor::model::{Example, Feed, Model, Tree};
    use arbor::optim::{Config, Optimizer, Rule};
    use arbor::readout::Readout;

    let (vocab, embed, hidden) = (6, 3, 4);
    let head = || {
        let f = Builder::new("pooled-head", 0);
        let (h, t) = (f.pull("h", hidden), f.pull("t", WIDTH));
        let w = f.param("W", [hidden, 6], Init::Xavier);
        let v = f.param("V", [6, WIDTH], Init::Xavier);
        f.push("loss", softmax_cross_entropy(h.matmul(w).tanh().dropout(0.3).matmul(v), t));
        f.build().unwrap()
    };
    let mut rng = Rng::new(31);
    let trees: Vec<InputGraph> = (0..4).map(|k| InputGraph::balanced_binary(2 + k)).collect();
    let words: Vec<Vec<u32>> = trees.iter().map(|t| (0..t.len()).map(|_| rng.below(vocab) as u32).collect()).collect();
    let targets = distributions(&mut rng, trees.len());
    let batch: Vec<Example<'_>> = trees
        .iter()
        .zip(&words)
        .zip(targets.chunks(WIDTH))
        .map(|((graph, words), target)| Example {
            trees: vec![Tree::new(graph, words, graph.roots()[0])],
            target: target.to_vec(),
        })
        .collect();
    // Every vertex read with a target row of its own.
    // Vertex 0 of each tree has none: a row of zeros, which cross-entropy ignores.
    let mut per_vertex_targets: Vec<Vec<f32>> = trees.iter().map(|t| distributions(&mut rng, t.len())).collect();
    per_vertex_targets.iter_mut().for_each(|t| t[..WIDTH].fill(0.0));
    let per_vertex: Vec<Example<'_>> = batch
        .iter()
        .zip(&per_vertex_targets)
        .map(|(e, target)| Example { trees: e.trees.clone(), target: target.clone() })
        .collect();
    let readouts = [Readout::Sum, Readout::Mean, Readout::Max, Readout::Root, Readout::Vertices];
    for readout in readouts {
        let batch = if readout == Readout::Vertices { &per_vertex } else { &batch };
        let mut rng = Rng::new(32);
        let table = Embedding::new(vocab, embed, 0.5, &mut rng);
        let cell = nn::tree_lstm(embed, hidden).unwrap();
        let mut model = Model::init(&CpuBackend::new(), table, cell, vec![Feed::Words], head(), &mut rng)
            .unwrap()
            .with_readout(readout);
        if matches!(readout, Readout::Sum | Readout::Mean | Readout::Vertices) {
            // A second layer with dropout on what it pulls and pushes, stacked on the first.
            let above = nn::CellKind::TreeLstm.cell_with_dropout(hidden, hidden, nn::CellDropout::all(0.2)).unwrap();
            model = model.stack(above, &mut rng).unwrap();
        }
        // The gradients, against central differences of the mean loss (dropout masks fixed).
        let report = check_model_gradients(&mut model, batch, &GradCheck { max_entries: 24, ..GradCheck::default() })
            .unwrap_or_else(|e| panic!("{readout:?}: {e}"));
        assert!(report.norm > 1e-2 && report.params > 0 && report.pulls > 0, "{readout:?}: {report:?}");
        // One SGD step of rate 1 moves every tensor by minus those gradients.
        let grads = model.gradients(batch, batch.len(), None).unwrap();
        let before = model.tensors().unwrap();
        model.step(batch, &mut Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 1.0)), None).unwrap();
        let after = model.tensors().unwrap();
        let mut want: Vec<Vec<f32>> = vec![vec![0.0; before[0].2.len()]];
        for (&row, g) in grads.words.rows.iter().zip(grads.words.values.chunks(embed)) {
            want[0][row as usize * embed..][..embed].copy_from_slice(g);
        }
        want.extend(grads.cells.iter().flatten().chain(&grads.head).cloned());
        for ((name, _, b), ((_, _, a), g)) in before.iter().zip(after.iter().zip(&want)) {
            for (i, ((b, a), g)) in b.iter().zip(a).zip(g).enumerate() {
                assert!(
                    (b - a - g).abs() <= 1e-6 * (1.0 + g.abs()),
                    "{readout:?} `{name}`[{i}]: moved {}, gradient {g}",
                    b - a
                );
            }
        }
    }
}
