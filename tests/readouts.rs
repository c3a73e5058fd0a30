//! Readouts over chosen vertices (`arbor::readout::Pool`: a range, the roots, a mask) and
//! attention pooling, through whole models: gradients against central differences, a graph
//! pooled several times run once and equal to as many copies, and bad pools refused by name.

use arbor::head::softmax_cross_entropy;
use arbor::layers::Embedding;
use arbor::model::{Example, Feed, Model, Tree};
use arbor::readout::{Pool, Readout};
use arbor::rng::Rng;
use arbor::testing::{check_model_gradients, GradCheck};
use arbor::{Builder, CpuBackend, Init, InputGraph, VertexFn};

const CLASSES: usize = 3;

/// A child-sum cell `h = tanh(x·V + Σ children's h·U + b)` pushing `h` and, with `heads` above
/// 0, a score per head `h·G` (for an attention readout).
fn cell(embed: usize, hidden: usize, heads: usize) -> VertexFn {
    let f = Builder::new("sum-cell", 0);
    let x = f.pull("x", embed);
    let children = f.gather_sum("h", hidden);
    let h = (x.matmul(f.param("V", [embed, hidden], Init::Xavier))
        + children.matmul(f.param("U", [hidden, hidden], Init::Xavier))
        + f.param("b", [1, hidden], Init::Zeros))
    .tanh();
    f.scatter("h", h);
    f.push("h", h);
    if heads > 0 {
        f.push("score", h.matmul(f.param("G", [hidden, heads], Init::Xavier)));
    }
    f.build().expect("a valid cell")
}

/// A head reading `k` pooled rows (concatenated) into a softmax classifier.
fn head(hidden: usize, k: usize) -> VertexFn {
    let f = Builder::new("classes", 0);
    let rows: Vec<_> = (0..k).map(|i| f.pull(&format!("h{i}"), hidden)).collect();
    let t = f.pull("t", CLASSES);
    let h = rows.into_iter().reduce(|a, b| a.concat(b)).expect("k > 0");
    let logits = h.matmul(f.param("W", [hidden * k, CLASSES], Init::Xavier)) + f.param("c", [1, CLASSES], Init::Zeros);
    f.push("loss", softmax_cross_entropy(logits, t));
    f.push("logits", logits);
    f.build().expect("a valid head")
}

fn model(embed: usize, hidden: usize, heads: usize, k: usize, readout: Readout) -> Model<CpuBackend> {
    let mut rng = Rng::new(7);
    let table = Embedding::new(6, embed, 0.5, &mut rng);
    Model::init(&CpuBackend::new(), table, cell(embed, hidden, heads), vec![Feed::Words], head(hidden, k), &mut rng)
        .expect("the model fits together")
        .with_readout(readout)
}

/// Forests: two trees side by side (two roots), a chain, one vertex.
fn graphs() -> Vec<InputGraph> {
    let forest =
        InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)], vec![], vec![Some(3)], vec![Some(2)]]);
    let chain = InputGraph::from_children(vec![vec![], vec![Some(0)], vec![Some(1)], vec![Some(2)]]);
    let one = InputGraph::from_children(vec![vec![]]);
    [forest, chain, one].into_iter().map(|g| g.expect("valid graphs")).collect()
}

fn words(graphs: &[InputGraph]) -> Vec<Vec<u32>> {
    graphs.iter().enumerate().map(|(k, g)| (0..g.len()).map(|v| ((v * 5 + k) % 6) as u32).collect()).collect()
}

fn target(k: usize) -> Vec<f32> {
    (0..CLASSES).map(|c| f32::from(c == k % CLASSES)).collect()
}

/// Attention pooling (one head and two) over every pool kind: the model's gradients (the
/// scores' parameters `G` among them) match central differences.
#[test]
fn attention_readout_gradients_match_finite_differences() {
    let gs = graphs();
    let ws = words(&gs);
    let masks: Vec<Vec<bool>> = gs.iter().map(|g| (0..g.len()).map(|v| v % 2 == 0).collect()).collect();
    for heads in [1, 2] {
        let pools = |k: usize| -> Vec<Pool<'_>> {
            vec![Pool::All, Pool::Roots, Pool::Mask(&masks[k]), Pool::Range(0..gs[k].len().min(3))]
        };
        for p in 0..4 {
            let batch: Vec<Example<'_>> = (0..gs.len())
                .map(|k| Example {
                    trees: vec![Tree::new(&gs[k], &ws[k], 0).pooled(pools(k)[p].clone())],
                    target: target(k),
                })
                .collect();
            let mut m = model(3, 4, heads, 1, Readout::Attention);
            let report = check_model_gradients(&mut m, &batch, &GradCheck { max_entries: 24, ..GradCheck::default() })
                .unwrap_or_else(|e| panic!("{heads} heads, pool {p}: {e}"));
            assert!(report.norm > 1e-3 && report.params > 0, "{heads} heads, pool {p}: {report:?}");
            let grads = m.gradients(&batch, batch.len(), None).expect("a step");
            let g = &grads.cells[0][m.cells()[0].function().params().iter().position(|q| q.name == "G").expect("G")];
            assert!(g.iter().any(|v| v.abs() > 1e-6), "the scores learn: {g:?}");
        }
    }
}

/// Sum, mean and max pooling over the roots and over a mask: gradients match central
/// differences, and the rows pooled are those of the chosen vertices only.
#[test]
fn pooling_over_roots_and_masks_matches_finite_differences() {
    let gs = graphs();
    let ws = words(&gs);
    let masks: Vec<Vec<bool>> = gs.iter().map(|g| (0..g.len()).map(|v| v + 1 == g.len() || v == 1).collect()).collect();
    for readout in [Readout::Sum, Readout::Mean, Readout::Max] {
        for roots in [true, false] {
            let pool = |k: usize| if roots { Pool::Roots } else { Pool::Mask(&masks[k]) };
            let batch: Vec<Example<'_>> = (0..gs.len())
                .map(|k| Example { trees: vec![Tree::new(&gs[k], &ws[k], 0).pooled(pool(k))], target: target(k) })
                .collect();
            let mut m = model(3, 4, 0, 1, readout);
            check_model_gradients(&mut m, &batch, &GradCheck { max_entries: 24, ..GradCheck::default() })
                .unwrap_or_else(|e| panic!("{readout:?}, roots {roots}: {e}"));
        }
    }
    // Pooling the forest's roots (4 over 3, 5 over 2 over 0 and 1) sums exactly their rows: its
    // logits (a linear map, zero bias at the start) are those of each root alone, summed.
    let mut m = model(3, 4, 0, 1, Readout::Sum);
    let ex = |pool: Pool<'static>, gs: &'static InputGraph, ws: &'static [u32]| Example {
        trees: vec![Tree::new(gs, ws, 0).pooled(pool)],
        target: target(0),
    };
    let (g, w): (&'static InputGraph, &'static [u32]) = (Box::leak(Box::new(gs[0].clone())), ws[0].clone().leak());
    let pooled = m.infer(&[ex(Pool::Roots, g, w), ex(Pool::Mask(&[false, false, false, false, true, true]), g, w)]);
    let each = m.infer(&[ex(Pool::Range(4..5), g, w), ex(Pool::Range(5..6), g, w)]);
    let (pooled, each) = (&pooled.expect("inference")[1], &each.expect("inference")[1]);
    for c in 0..CLASSES {
        let want = each[c] + each[CLASSES + c];
        assert!((pooled[c] - want).abs() < 1e-5, "roots, class {c}: {} vs {want}", pooled[c]);
        assert!((pooled[CLASSES + c] - want).abs() < 1e-5, "mask, class {c}: {} vs {want}", pooled[CLASSES + c]);
    }
}

/// A per-step readout (jumping knowledge): one example names the same unrolled graph once per
/// step, each pooled over that step. The graph runs once (the cells' work is that of one copy)
/// and the outputs and gradients equal those of the example with a copy of the graph per step.
#[test]
fn a_graph_pooled_per_step_runs_once() {
    let gs = graphs();
    let ws = words(&gs);
    let copies: Vec<Vec<InputGraph>> = gs.iter().map(|g| vec![g.clone(); 3]).collect();
    let thirds = |g: &InputGraph| {
        let n = g.len();
        [0..n / 3, n / 3..2 * n / 3, 2 * n / 3..n]
    };
    let shared: Vec<Example<'_>> = (0..gs.len())
        .map(|k| Example {
            trees: thirds(&gs[k]).into_iter().map(|r| Tree::new(&gs[k], &ws[k], 0).pooled(Pool::Range(r))).collect(),
            target: target(k),
        })
        .collect();
    let copied: Vec<Example<'_>> = (0..gs.len())
        .map(|k| Example {
            trees: thirds(&gs[k])
                .into_iter()
                .zip(&copies[k])
                .map(|(r, g)| Tree::new(g, &ws[k], 0).pooled(Pool::Range(r)))
                .collect(),
            target: target(k),
        })
        .collect();
    for readout in [Readout::Sum, Readout::Attention] {
        let heads = usize::from(readout == Readout::Attention);
        let (mut a, mut b) = (model(3, 4, heads, 3, readout), model(3, 4, heads, 3, readout));
        let ga = a.gradients(&shared, shared.len(), None).expect("a step");
        let gb = b.gradients(&copied, copied.len(), None).expect("a step");
        // The cells did about a third of the work (the same words looked up).
        let (fa, fb) = (a.cells_mut()[0].flops(), b.cells_mut()[0].flops());
        assert!(fa * 2 < fb, "{readout:?}: the cells' flops over one graph {fa}, over three copies {fb}");
        for (x, y) in ga.outputs.iter().flatten().zip(gb.outputs.iter().flatten()) {
            assert!((x - y).abs() < 1e-5, "{readout:?}: outputs {x} vs {y}");
        }
        for (x, y) in ga.cells.iter().flatten().flatten().zip(gb.cells.iter().flatten().flatten()) {
            assert!((x - y).abs() < 1e-5 * (1.0 + y.abs()), "{readout:?}: gradients {x} vs {y}");
        }
        check_model_gradients(&mut a, &shared, &GradCheck { max_entries: 16, ..GradCheck::default() })
            .unwrap_or_else(|e| panic!("{readout:?}: {e}"));
    }
}

/// A pool that does not fit its graph, and an attention readout over a cell without scores,
/// are refused with the place named.
#[test]
fn bad_pools_are_refused_by_name() {
    let gs = graphs();
    let ws = words(&gs);
    let bad = |pool: Pool<'static>| {
        let mut m = model(3, 4, 0, 1, Readout::Mean);
        let batch = [
            Example { trees: vec![Tree::new(&gs[1], &ws[1], 0)], target: target(0) },
            Example { trees: vec![Tree::new(&gs[0], &ws[0], 0).pooled(pool)], target: target(1) },
        ];
        m.infer(&batch).expect_err("refused").to_string()
    };
    let e = bad(Pool::Mask(&[true, false]));
    assert!(e.contains("graph 0 of example 1") && e.contains("6 entries"), "{e}");
    let e = bad(Pool::Range(2..9));
    assert!(e.contains("graph 0 of example 1") && e.contains("2..9"), "{e}");
    let mut m = model(3, 4, 0, 1, Readout::Attention);
    let e = m.infer(&[Example { trees: vec![Tree::new(&gs[0], &ws[0], 0)], target: target(0) }]).expect_err("refused");
    assert!(e.to_string().contains("second output"), "{e}");
}

/// Which trees share a run: the same graph and words (references) with another root or pool;
/// an exact repeat runs again, so that no vertex is read twice as a root.
#[test]
fn trees_share_a_run_only_when_read_differently() {
    let gs = graphs();
    let ws = words(&gs);
    let copy = gs[0].clone();
    let trees = vec![
        Tree::new(&gs[0], &ws[0], 5),
        Tree::new(&gs[0], &ws[0], 5),
        Tree::new(&gs[0], &ws[0], 4),
        Tree::new(&copy, &ws[0], 4),
        Tree::new(&gs[0], &ws[0], 5).pooled(Pool::Roots),
    ];
    let e = Example { trees, target: target(0) };
    assert_eq!(e.placed(), [0, 1, 0, 3, 0]);
    assert_eq!(e.graphs().count(), 3);
    // Read at two roots of one forest, the graph runs once and the model's gradients equal
    // those over two copies.
    let shared = Example { trees: vec![Tree::new(&gs[0], &ws[0], 4), Tree::new(&gs[0], &ws[0], 5)], target: target(1) };
    let copied = Example { trees: vec![Tree::new(&gs[0], &ws[0], 4), Tree::new(&copy, &ws[0], 5)], target: target(1) };
    let (mut m, mut n) = (model(3, 4, 0, 2, Readout::Root), model(3, 4, 0, 2, Readout::Root));
    let ga = m.gradients(&[shared], 1, None).expect("a step");
    let gb = n.gradients(&[copied], 1, None).expect("a step");
    for (x, y) in ga.cells.iter().flatten().flatten().zip(gb.cells.iter().flatten().flatten()) {
        assert!((x - y).abs() < 1e-5 * (1.0 + y.abs()), "gradients {x} vs {y}");
    }
    assert!(m.cells_mut()[0].flops() < n.cells_mut()[0].flops());
}
