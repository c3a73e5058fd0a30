//! Optimizers: each rule minimises a quadratic; sparse updates touch only their rows; Adam's
//! first step and clipping have their closed forms.

mod common;

use arbor::layers::SparseGrad;
use arbor::optim::{clip_grad_norm, Config, Optimizer, Rule};
use arbor::{Backend, CpuBackend};

/// Minimises Σ (p − target)² from zero and returns the final distance.
fn minimise(rule: Rule, lr: f32, steps: usize) -> f32 {
    let target = [1.0f32, -2.0, 0.5];
    let mut p = [0.0f32; 3];
    let mut opt = Optimizer::new(Config::new(rule, lr));
    for _ in 0..steps {
        let g: Vec<f32> = p.iter().zip(&target).map(|(p, t)| 2.0 * (p - t)).collect();
        opt.begin_step();
        opt.dense("w", &mut p, &g);
    }
    p.iter().zip(&target).map(|(p, t)| (p - t).abs()).fold(0.0, f32::max)
}

#[test]
fn every_rule_minimises_a_quadratic() {
    assert!(minimise(Rule::Sgd { momentum: 0.0 }, 0.1, 200) < 1e-4);
    assert!(minimise(Rule::Sgd { momentum: 0.9 }, 0.02, 400) < 1e-3);
    assert!(minimise(Rule::Adagrad, 0.5, 500) < 1e-3);
    assert!(minimise(Rule::Adam, 0.05, 800) < 1e-2);
    assert!(minimise(Rule::AdamW, 0.05, 800) < 1e-2);
}

#[test]
fn adam_first_step_is_lr_times_sign() {
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.1));
    let mut p = [1.0f32, 1.0];
    opt.begin_step();
    opt.dense("w", &mut p, &[0.5, -3.0]);
    assert!((p[0] - 0.9).abs() < 1e-5 && (p[1] - 1.1).abs() < 1e-5, "{p:?}");
}

#[test]
fn weight_decay_is_decoupled_in_adamw() {
    let mut c = Config::new(Rule::AdamW, 0.1);
    c.weight_decay = 0.5;
    let mut opt = Optimizer::new(c);
    let mut p = [2.0f32];
    opt.begin_step();
    opt.dense("w", &mut p, &[0.0]);
    // Zero gradient: only the decay acts, p ← p − lr·wd·p.
    assert!((p[0] - 1.9).abs() < 1e-6, "{p:?}");
}

#[test]
fn sparse_updates_touch_only_their_rows_and_keep_row_state() {
    let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 1.0));
    let mut table = vec![0.0f32; 3 * 2];
    let g = SparseGrad { rows: vec![1], values: vec![1.0, -1.0] };
    opt.begin_step();
    opt.sparse("table", &mut table, 2, &g);
    assert_eq!(table[0..2], [0.0, 0.0]);
    assert_eq!(table[4..6], [0.0, 0.0]);
    assert!((table[2] + 1.0).abs() < 1e-6 && (table[3] - 1.0).abs() < 1e-6, "{table:?}");
    // The second update of row 1 is damped by its own history: 1/√2.
    opt.begin_step();
    opt.sparse("table", &mut table, 2, &g);
    assert!((table[2] + 1.0 + 1.0 / 2f32.sqrt()).abs() < 1e-5, "{table:?}");
}

#[test]
fn clipping_scales_to_the_bound() {
    let (mut a, mut b) = (vec![3.0f32], vec![4.0f32]);
    let norm = clip_grad_norm(&mut [&mut a, &mut b], 1.0);
    assert!((norm - 5.0).abs() < 1e-6);
    assert!((a[0] - 0.6).abs() < 1e-6 && (b[0] - 0.8).abs() < 1e-6);
    let norm = clip_grad_norm(&mut [&mut a, &mut b], 10.0);
    assert!((norm - 1.0).abs() < 1e-6 && (a[0] - 0.6).abs() < 1e-6);
}

/// One rule's update of one element, written out: the reference for the split updates.
fn reference(c: &Config, t: i32, p: &mut f32, g: f32, m: &mut f32, v: &mut f32) {
    match c.rule {
        Rule::Sgd { momentum } => {
            *m = momentum * *m + g;
            *p -= c.lr * *m;
        }
        Rule::Adagrad => {
            *m += g * g;
            *p -= c.lr * g / (m.sqrt() + c.eps);
        }
        Rule::Adam | Rule::AdamW => {
            *m = c.beta1 * *m + (1.0 - c.beta1) * g;
            *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
            let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
            *p -= c.lr * (*m / bc1) / ((*v / bc2).sqrt() + c.eps);
        }
    }
}

#[test]
fn large_and_sparse_updates_match_the_element_by_element_rule() {
    // Long enough to be split into pieces over both threads; rows 300 wide, like SST's vectors.
    let (n, dim, vocab) = (100_003usize, 300usize, 500usize);
    let value = |i: usize, s: usize| ((i * 7919 + s * 104_729) % 1000) as f32 / 500.0 - 1.0;
    for rule in [Rule::Sgd { momentum: 0.9 }, Rule::Adagrad, Rule::Adam, Rule::AdamW] {
        let c = Config::new(rule, 0.01);
        let mut opt = Optimizer::new(c);
        let (mut p, mut table) = (vec![0.5f32; n], vec![0.25f32; vocab * dim]);
        let (mut rp, mut rtable) = (p.clone(), table.clone());
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let (mut tm, mut tv) = (vec![0.0f32; vocab * dim], vec![0.0f32; vocab * dim]);
        for step in 1..=3 {
            let g: Vec<f32> = (0..n).map(|i| value(i, step)).collect();
            let rows: Vec<u32> = (0..vocab as u32).filter(|r| !(r + step as u32).is_multiple_of(3)).collect();
            let values: Vec<f32> = (0..rows.len() * dim).map(|i| value(i, step + 10)).collect();
            let sparse = SparseGrad { rows: rows.clone(), values: values.clone() };
            opt.begin_step();
            opt.dense("w", &mut p, &g);
            opt.sparse("table", &mut table, dim, &sparse);
            for i in 0..n {
                reference(&c, step as i32, &mut rp[i], g[i], &mut m[i], &mut v[i]);
            }
            for (k, &r) in rows.iter().enumerate() {
                for j in 0..dim {
                    let (e, gk) = (r as usize * dim + j, values[k * dim + j]);
                    reference(&c, step as i32, &mut rtable[e], gk, &mut tm[e], &mut tv[e]);
                }
            }
        }
        let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst(&p, &rp) < 1e-5, "{rule:?} dense: {}", worst(&p, &rp));
        assert!(worst(&table, &rtable) < 1e-5, "{rule:?} sparse: {}", worst(&table, &rtable));
    }
}

#[test]
fn sparse_rows_out_of_order_or_repeated_update_in_turn() {
    // Not the engine's form (ascending, each once): each entry still updates its row in turn.
    let mut opt = Optimizer::new(Config::new(Rule::Sgd { momentum: 0.0 }, 1.0));
    let mut table = vec![0.0f32; 3 * 2];
    let g = SparseGrad { rows: vec![2, 0, 2], values: vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0] };
    opt.begin_step();
    opt.sparse("table", &mut table, 2, &g);
    assert_eq!(table, [-2.0, -2.0, 0.0, 0.0, -4.0, -4.0]);
}

#[test]
fn state_follows_the_tensor_name_not_the_call_order() {
    let cfg = Config::new(Rule::Adam, 0.1);
    let (mut a, mut b) = (Optimizer::new(cfg), Optimizer::new(cfg));
    let (mut pa, mut qa) = (vec![1.0f32, 2.0], vec![3.0f32]);
    let (mut pb, mut qb) = (pa.clone(), qa.clone());
    for step in 0..4 {
        let (gp, gq) = ([0.5, -1.0 - step as f32], [2.0 * step as f32]);
        a.begin_step();
        a.dense("p", &mut pa, &gp);
        a.dense("q", &mut qa, &gq);
        b.begin_step();
        b.dense("q", &mut qb, &gq);
        b.dense("p", &mut pb, &gp);
    }
    assert_eq!((pa, qa), (pb, qb));
    let names: Vec<String> = a.tensors().into_iter().map(|(n, _, _)| n).collect();
    assert_eq!(names, ["opt.p.m", "opt.p.v", "opt.q.m", "opt.q.v"]);
    let ck = arbor::checkpoint::Checkpoint { tensors: a.tensors(), meta: serde_json::Value::Null };
    let mut c = Optimizer::new(cfg);
    c.restore(&ck, a.steps).unwrap();
    assert_eq!(c, a);
}

#[test]
fn a_tensor_named_in_with_lr_moves_at_its_own_rate() {
    // Adagrad's first step is lr·sign(g): the dense tensor at 0.5, the table's row at 0.01,
    // another dense tensor at the default.
    let mut opt = Optimizer::new(Config::new(Rule::Adagrad, 0.5)).with_lr("embedding", 0.01);
    let (mut w, mut other, mut table) = ([1.0f32], [1.0f32], vec![0.0f32; 2 * 2]);
    opt.begin_step();
    opt.dense("w", &mut w, &[2.0]);
    opt.dense("v", &mut other, &[-2.0]);
    opt.sparse("embedding", &mut table, 2, &SparseGrad { rows: vec![1], values: vec![3.0, -3.0] });
    assert!((w[0] - 0.5).abs() < 1e-6 && (other[0] - 1.5).abs() < 1e-6, "{w:?} {other:?}");
    assert_eq!(table[0..2], [0.0, 0.0]);
    assert!((table[2] + 0.01).abs() < 1e-7 && (table[3] - 0.01).abs() < 1e-7, "{table:?}");
}

/// `all_finite` finds an infinity or a NaN at any place of slices of any length (blocks and
/// their tails), and takes the largest floats and subnormals for finite.
#[test]
fn all_finite_finds_every_bad_value_anywhere() {
    use arbor::optim::all_finite;
    let mut rng = arbor::rng::Rng::new(3);
    assert!(all_finite(&[]));
    assert!(all_finite(&[f32::MAX, f32::MIN, f32::MIN_POSITIVE / 2.0, -0.0]));
    for len in [1, 7, 8, 9, 4095, 4096, 4097, 9000] {
        let values: Vec<f32> = (0..len).map(|_| rng.range(-1.0, 1.0) * 3e38).collect();
        assert!(all_finite(&values), "length {len}");
        for at in [0, len / 2, len - 1] {
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN] {
                let mut v = values.clone();
                v[at] = bad;
                assert!(!all_finite(&v), "{bad} at {at} of {len}");
            }
        }
    }
}

/// A frozen tensor is left as it is, dense or sparse, and keeps no state; others still move.
#[test]
fn a_frozen_tensor_is_left_as_it_is() {
    let mut opt = Optimizer::new(Config::new(Rule::Adam, 0.1)).freeze("w").freeze("table");
    opt.begin_step();
    let (mut w, mut u) = (vec![1.0f32; 5], vec![1.0f32; 5]);
    opt.dense("w", &mut w, &[0.5; 5]);
    opt.dense("u", &mut u, &[0.5; 5]);
    let mut table = vec![1.0f32; 6];
    opt.sparse("table", &mut table, 2, &SparseGrad { rows: vec![1], values: vec![0.5, 0.5] });
    assert_eq!((w, table), (vec![1.0; 5], vec![1.0; 6]));
    assert!(u.iter().all(|&x| x < 1.0), "{u:?}");
    assert_eq!(opt.slots.keys().collect::<Vec<_>>(), ["u"]);
}

/// The CPU backend's optimizer calls (the ones a device keeps its parameters with) give the
/// host optimizer's bits for every rule, with and without weight decay: four steps of a dense
/// update and of table rows under gates that clip, leave and skip; its scaling clips as
/// `clip_to` does, its sum of squares is the host's and the gate it decides `gate::decide`'s.
#[test]
fn backend_updates_equal_the_host_optimizer() {
    use common::optim::{configs, host_reference, run};
    for (k, config) in configs().into_iter().enumerate() {
        let (want, want_sum, want_gate) = host_reference(config, k as u64);
        let (got, sum, gate) = run(&CpuBackend::new(), config, k as u64);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(g), bits(w), "{config:?}: tensor {i}");
        }
        assert_eq!(sum, want_sum);
        assert_eq!(gate, want_gate);
        assert!(gate[0] < 0.5 && gate[1] == 1.0, "the values' norm is clipped to 1: {gate:?}");
    }
}

/// The backend's calls refuse what would alias or race: a state tensor overlapping the values,
/// rows out of order or past the table.
#[test]
fn backend_updates_refuse_overlaps_and_bad_rows() {
    use arbor::backend::{IndexLoc, Loc, Mem, OptimAt};
    use arbor::optim::Update;
    let cpu = CpuBackend::new();
    let u = Update::new(Config::new(Rule::Adam, 0.1), 1);
    let mut bufs = [cpu.alloc(64).unwrap()];
    let mut index = cpu.alloc_index(2).unwrap();
    cpu.write_index(&mut index, 0, &[3, 1]).unwrap();
    let indexes = [index];
    let mut mem = Mem { data: &mut bufs, index: &indexes };
    let at = |k: usize| Loc { buf: 0, offset: k };
    let overlapping = OptimAt { p: at(0), g: at(16), m: at(4), v: at(32), gate: None };
    let e = cpu.update(&mut mem, &u, &overlapping, 8).unwrap_err().to_string();
    assert!(e.contains("update") && e.contains("overlaps"), "{e}");
    let rows = OptimAt { p: at(0), g: at(48), m: at(16), v: at(32), gate: None };
    let e = cpu.update_rows(&mut mem, &u, &rows, (4, 4), IndexLoc { buf: 0, offset: 0 }, 2).unwrap_err().to_string();
    assert!(e.contains("not ascending"), "{e}");
    let e = cpu.update(&mut mem, &u, &OptimAt { p: at(60), g: at(0), m: at(8), v: at(16), gate: None }, 8).unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
}

/// An engine updates its parameters where it holds them as the host optimizer updates copies:
/// the same bits for every tensor over three steps, a frozen tensor and its state left alone, a
/// tensor at its own rate (a run of equal updates split around them); its state reads back as
/// the host's slots and, written into another engine, continues the same way.
#[test]
fn engine_updates_equal_the_host_optimizer_per_tensor() {
    use arbor::rng::Rng;
    use arbor::{nn, Engine};
    let f = nn::tree_lstm(3, 4).unwrap();
    let mut rng = Rng::new(7);
    let params = f.init_params(&mut rng);
    let names: Vec<String> = f.params().iter().map(|p| p.name.clone()).collect();
    let opt = Optimizer::new(Config { weight_decay: 0.01, ..Config::new(Rule::Adam, 0.05) })
        .freeze(&names[1])
        .with_lr(&names[3], 0.01);
    let (mut host, mut host_opt) = (params.clone(), opt.clone());
    let mut engine = Engine::new(CpuBackend::new(), f.clone(), &params).unwrap();
    let mut other = None;
    for step in 0..3 {
        let grads: Vec<Vec<f32>> = params.iter().map(|p| p.iter().map(|_| rng.range(-1.0, 1.0)).collect()).collect();
        host_opt.begin_step();
        for ((p, g), n) in host.iter_mut().zip(&grads).zip(&names) {
            host_opt.dense(n, p, g);
        }
        let mut engine_opt = opt.clone();
        engine_opt.steps = step;
        engine_opt.begin_step();
        let updates: Vec<_> = names.iter().map(|n| engine_opt.update_of(n)).collect();
        assert!(updates[1].is_none() && updates[3] != updates[0]);
        engine.set_grads(&grads).unwrap();
        let sum: f64 = grads.iter().map(|g| arbor::optim::sum_squares(&[g.clone().as_mut_slice()])).sum();
        assert!((engine.grad_sum_squares().unwrap().0 - sum).abs() <= 1e-9 * sum);
        engine.optimize(&updates).unwrap();
        let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&engine.params().unwrap()), bits(&host), "step {step}");
        let state = engine.optimizer_state().unwrap();
        for (s, n) in state.iter().zip(&names) {
            match (s, host_opt.slots.get(n)) {
                (Some([m, v]), Some(slot)) => assert_eq!((m, v), (&slot.m, &slot.v), "{n}"),
                (None, None) => {}
                (s, slot) => panic!("{n}: engine {}, host {}", s.is_some(), slot.is_some()),
            }
        }
        // From the second step on, a copy of the engine continues as the engine does.
        if let Some(copy) = other.as_mut() {
            let copy: &mut Engine<CpuBackend> = copy;
            copy.set_grads(&grads).unwrap();
            copy.optimize(&updates).unwrap();
            assert_eq!(bits(&copy.params().unwrap()), bits(&host), "the copy at step {step}");
        } else {
            let mut copy = Engine::new(CpuBackend::new(), f.clone(), &engine.params().unwrap()).unwrap();
            copy.set_optimizer_state(&state).unwrap();
            other = Some(copy);
        }
    }
    assert!(engine.optimize(&[None]).unwrap_err().to_string().contains("one per parameter"));
}
