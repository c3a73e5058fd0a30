//! The lowering alone: a Tree-LSTM minibatch turned into its launch list, printed and counted,
//! with no backend; then the same list run by an engine.

use arbor::backend::{Combine, Rows};
use arbor::engine::{Counts, Launch, Lowering, PlanKind};
use arbor::rng::Rng;
use arbor::Pass;
use arbor::{nn, CpuBackend, Engine, InputGraph, Pull};

/// Two constituency trees: a 2-leaf one and a 3-leaf one. Three tasks: the 5 leaves, the 2
/// vertices of height 1, the root of height 2.
fn minibatch() -> Vec<InputGraph> {
    vec![
        InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)]]).unwrap(),
        InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)], vec![], vec![Some(2), Some(3)]])
            .unwrap(),
    ]
}

/// One 4-wide word per vertex: the same word at every leaf, zeros (no word) inside.
fn words() -> Vec<f32> {
    let leaf = [true, true, false, true, true, false, true, false];
    leaf.iter().flat_map(|&l| [if l { 0.5 } else { 0.0 }; 4]).collect()
}

fn print(launches: &[Launch]) -> String {
    let text: Vec<String> = launches.iter().map(Launch::to_string).collect();
    println!("{}\n{:?}\n", text.join("\n"), Counts::of(launches));
    text.join("\n")
}

/// The products of a list, one by one.
fn products(launches: &[Launch]) -> Vec<arbor::backend::Gemm> {
    launches
        .iter()
        .flat_map(|l| match l {
            Launch::Gemm(g) => vec![*g],
            Launch::Gemms(gs) | Launch::GemmSum(gs) => gs.clone(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn a_tree_lstm_minibatch_lowers_to_the_expected_launches() {
    let graphs = minibatch();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let x = words();
    let mut l = Lowering::new(nn::tree_lstm(4, 6).unwrap());
    l.set_skip_padding_grads(true);

    for (train, plan) in [(false, PlanKind::Inference), (true, PlanKind::Forward)] {
        let launches = l.forward(&refs, &[Pull::Rows(&x)], train).unwrap().to_vec();
        let text = print(&launches);
        // Leaves: the input product (one distinct word, so one row; its other columns are
        // zero-width), then the cell. Each of the two inner tasks: the copy of the children's
        // `h` (in training only: U's gradients read it), the two child products (the second
        // adding into the first), the cell. In inference the products read the children's rows
        // where they are: evenly spaced, two rows apart (leaves 0 and 2, then 1 and 3) in the
        // first inner task.
        let fused = if train { 5 } else { 3 };
        assert_eq!(Counts::of(&launches), Counts { products: 6, fused, ..Counts::default() }, "{text}");
        if !train {
            let (first, second) = (products(&launches)[2], products(&launches)[3]);
            assert_eq!((first.m, first.lda, first.a.offset + 6, first.a.buf), (2, 12, second.a.offset, 0), "{text}");
        }
        let input = products(&launches)[1];
        assert_eq!((input.m, input.n, input.k), (1, 18, 4), "the input product runs over the one distinct word");
        let summed = products(&launches).iter().filter(|g| g.accumulate).count();
        assert_eq!(summed, 2, "one child product per inner task adds into its sibling's output");
        // Each inner task's two child products go out as one chain (one backend call).
        let chains: Vec<usize> = launches
            .iter()
            .filter_map(|l| match l {
                Launch::GemmSum(gs) => Some(gs.len()),
                _ => None,
            })
            .collect();
        assert_eq!(chains, [2, 2], "{text}");
        let rows: Vec<usize> = launches
            .iter()
            .filter_map(|k| match k {
                Launch::Fused { step, n, .. } => {
                    assert_eq!(step.plan, plan);
                    Some(*n)
                }
                _ => None,
            })
            .collect();
        let want: &[usize] = if train { &[5, 2, 2, 1, 1] } else { &[5, 2, 1] };
        assert_eq!(rows, want, "kernels over the leaves, then (training) the copy and the cell per task");
        // The copy holds the children's `h` only: F′ reads their `c` where the children's are.
        let copied: Vec<usize> = launches
            .iter()
            .filter_map(|k| match k {
                Launch::Fused { n: 2 | 1, stores, kernel, .. } if kernel.nodes.len() == 2 => Some(stores.len()),
                _ => None,
            })
            .collect();
        assert_eq!(copied, if train { vec![2, 2] } else { vec![] }, "{text}");
    }

    let g = vec![0.1f32; 8 * 6];
    let launches = l.backward(None, &[&g]).unwrap().to_vec();
    let text = print(&launches);
    // Zeroed first: the two state gradients and the parameter gradients. Per inner task (root
    // first): the cell's backward, the two child products, the four scatters to the children
    // (h and c of two slots) in one call;
    // then the leaves' cell, the input gradient product, the bias's row sum, the two child
    // weights' gradients over all inner vertices, the input's output gradient summed per
    // distinct word (a copy reading each word's rows where they are: nothing zeroed or
    // scattered for it), and the input weight's gradient over the one word.
    let want = Counts { products: 8, fused: 3, fills: 3, scatters: 2, row_sums: 1, copies: 1, attention: 0 };
    assert_eq!(Counts::of(&launches), want, "{text}");
    let merged = launches.iter().filter(|k| matches!(k, Launch::ScatterAdds { parts, .. } if parts.len() == 4)).count();
    assert_eq!(merged, 2, "{text}");
    assert!(launches[..3].iter().all(|k| matches!(k, Launch::Fill { .. })), "{text}");
    // The parameters' gradients are not zeroed where their first write covers them whole (the
    // child weights' products, the bias's row sum): only the input weight is, whose first write
    // (the leaves' three gates) covers part of it.
    let grad_fills: Vec<(usize, usize)> = launches
        .iter()
        .filter_map(|k| match k {
            Launch::Fill { dst, len } if dst.buf == arbor::engine::GRADS => Some((dst.offset, *len)),
            _ => None,
        })
        .collect();
    assert_eq!(grad_fills, [(0, 4 * 30)], "{text}");
    let writes: Vec<bool> = launches
        .iter()
        .filter_map(|k| match k {
            Launch::Gemm(g) if g.c.buf == arbor::engine::GRADS => Some(!g.accumulate),
            Launch::SumRows { dst, accumulate, .. } if dst.buf == arbor::engine::GRADS => Some(!accumulate),
            _ => None,
        })
        .collect();
    assert_eq!(writes, [true, true, true, false], "bias, U₁, U₀ written; W added to: {text}");
    let input_grad = products(&launches).last().copied().unwrap();
    assert_eq!((input_grad.m, input_grad.n, input_grad.k), (4, 18, 1), "summed per distinct word: k = 1");
    let summed = launches.iter().find_map(|k| match k {
        Launch::Copy { from: Rows::IndexedSet { combine: Combine::Sum, .. }, to, rows, block } => {
            Some((*to, *rows, *block))
        }
        _ => None,
    });
    assert_eq!(summed, Some((input_grad.b, 1, 30)), "the one word's sum is the factor of its product: {text}");
}

/// The engine runs the lowering's list, counting its floating-point operations and backend calls.
#[test]
fn the_engine_runs_the_list_the_lowering_prints() {
    let graphs = minibatch();
    let refs: Vec<&InputGraph> = graphs.iter().collect();
    let x = words();
    let f = nn::tree_lstm(4, 6).unwrap();
    let mut l = Lowering::new(f.clone());
    let expected: Vec<String> =
        l.forward(&refs, &[Pull::Rows(&x)], true).unwrap().iter().map(Launch::to_string).collect();
    let flops: u64 = l.launches().iter().map(Launch::flops).sum();
    let params = f.init_params(&mut Rng::new(3));
    let mut e = Engine::new(CpuBackend::new(), f, &params).unwrap();
    e.run(Pass::train(&refs, &[Pull::Rows(&x)])).unwrap();
    let ran: Vec<String> = e.lowering().launches().iter().map(Launch::to_string).collect();
    assert_eq!(ran, expected);
    assert_eq!(e.flops(), flops);
    assert!(flops > 0);
    // One backend call per product, chain of summed products, fused kernel, fill, copy,
    // scatter-add and row sum: the forward pass's 6 products (two chains of two) and 5 kernels,
    // then the backward pass's (no chains there), counted as the lowering printed them.
    assert_eq!(e.calls(), 9);
    let g = vec![0.1f32; 8 * 6];
    e.backward(&[&g]).unwrap();
    assert_eq!(e.calls(), 9 + Counts::of(e.lowering().launches()).total() as u64);
    assert!(e.calls() > 9);
}
