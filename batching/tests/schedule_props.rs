//! Properties of schedules and memory plans on random forests and DAGs, for every policy.

use arbor_batching::{Agenda, ByDepth, ByHeight, Lifetime, MemoryLayout, MemoryPlan, Policy, Schedule, Scheduler};
use arbor_core::backend::NO_ROW;
use arbor_core::graph::InputGraph;
use arbor_core::ir::{Builder, Init};
use arbor_core::rng::Rng;
use proptest::prelude::*;

fn policies() -> Vec<Box<dyn Policy>> {
    vec![Box::new(ByHeight), Box::new(ByDepth), Box::new(Agenda::default()), Box::new(Agenda { max_batch: 3 })]
}

/// Every vertex is in exactly one task, rows are a permutation, every child is in an earlier task.
fn check_schedule(graphs: &[&InputGraph], s: &Schedule) {
    let n: usize = graphs.iter().map(|g| g.len()).sum();
    assert_eq!(s.len(), n);
    let mut seen = vec![false; n];
    for &v in &s.vertex_of_row {
        assert!(!seen[v as usize], "vertex {v} scheduled twice");
        seen[v as usize] = true;
    }
    assert!(seen.iter().all(|&x| x), "a vertex was never scheduled");
    assert_eq!(s.tasks.iter().map(|t| t.len()).sum::<usize>(), n);
    let mut task_of_row = vec![usize::MAX; n];
    for (t, range) in s.tasks.iter().enumerate() {
        assert!(!range.is_empty(), "empty task {t}");
        for r in range.clone() {
            task_of_row[r] = t;
        }
    }
    for r in 0..n {
        for k in 0..s.child_rows.len() {
            let c = s.child_rows[k][r];
            if c != NO_ROW {
                assert!(task_of_row[c as usize] < task_of_row[r], "row {r}'s child {c} is not in an earlier task");
            }
        }
        for &c in &s.child_list[s.child_offsets[r] as usize..s.child_offsets[r + 1] as usize] {
            assert!(task_of_row[c as usize] < task_of_row[r]);
        }
    }
    // Child rows name the right vertices.
    for (gi, g) in graphs.iter().enumerate() {
        for v in 0..g.len() {
            let r = s.row_of_vertex[s.graph_starts[gi] + v] as usize;
            for (k, &c) in g.children(v).iter().enumerate().take(s.child_rows.len()) {
                let want = if c == u32::MAX { NO_ROW } else { s.row_of_vertex[s.graph_starts[gi] + c as usize] };
                assert_eq!(s.child_rows[k][r], want);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_policy_gives_a_valid_schedule(seed in any::<u64>(), graphs in 1usize..=32, max_v in 1usize..=200, arity in 1usize..=4, dag in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let gs: Vec<InputGraph> = (0..graphs).map(|_| { let n = 1 + rng.below(max_v); InputGraph::random(&mut rng, n, arity, dag) }).collect();
        let refs: Vec<&InputGraph> = gs.iter().collect();
        let mut schedule = Schedule::default();
        let mut heights = 0;
        for p in policies() {
            let name = p.name();
            let mut s = Scheduler::new(p);
            s.schedule(&refs, arity, &mut schedule);
            check_schedule(&refs, &schedule);
            // Scheduling twice into the same schedule gives the same result.
            let first = schedule.clone();
            s.schedule(&refs, arity, &mut schedule);
            prop_assert_eq!(&first, &schedule);
            // Fewer fixed slots lay out fewer child rows, and the same child sets.
            s.schedule(&refs, 1, &mut schedule);
            check_schedule(&refs, &schedule);
            prop_assert!(schedule.child_rows.len() <= 1);
            prop_assert_eq!((&first.child_offsets, &first.child_list), (&schedule.child_offsets, &schedule.child_list));
            prop_assert_eq!(&first.child_rows[..schedule.child_rows.len()], &schedule.child_rows[..]);
            s.schedule(&refs, arity, &mut schedule);
            if name == "height" {
                heights = schedule.tasks.len();
            } else {
                // Height batching is optimal in task count.
                prop_assert!(schedule.tasks.len() >= heights);
            }
        }
    }

    #[test]
    fn memory_plans_never_share_live_bytes(seed in any::<u64>(), hidden in 1usize..=8, vertices in 1usize..=500, max_task in 1usize..=64, train in any::<bool>()) {
        let mut rng = Rng::new(seed);
        let f = Builder::new("cell", 2);
        let x = f.pull("x", 1 + rng.below(6));
        let (h0, h1) = (f.gather(0, "h", hidden), f.gather(1, "h", hidden));
        let w = f.param("W", [x.shape().cols(), hidden], Init::Xavier);
        let u = f.param("U", [hidden, hidden], Init::Xavier);
        let h = (x.matmul(w) + (h0 * h1).matmul(u)).tanh();
        f.scatter("h", h);
        f.push("y", h.sum_cols());
        let f = f.build().unwrap();
        let plan = MemoryPlan::new(&f, vertices, max_task.min(vertices), train);
        prop_assert!(plan.overlap().is_none(), "{:?}", plan.overlap());
        prop_assert!(plan.lifetimes.iter().all(|l| l.elems.end <= plan.len));
        prop_assert_eq!(plan.bytes(), plan.len * 4);
        // One layout kept across minibatches of other sizes: no live bytes shared, and every
        // buffer as low as it can go (at 0, or right after a buffer live at the same time).
        let layout = MemoryLayout::new(&f, train);
        for (n, m) in [(vertices * 3, max_task * 2), (1, 1), (vertices, max_task)] {
            let plan = layout.plan(n, m.min(n));
            prop_assert!(plan.overlap().is_none(), "{:?}", plan.overlap());
            let live = |a: &Lifetime, b: &Lifetime| a.steps.start < b.steps.end && b.steps.start < a.steps.end;
            for l in &plan.lifetimes {
                let tight = l.elems.start == 0 || plan.lifetimes.iter().any(|o| live(o, l) && o.elems.end == l.elems.start);
                prop_assert!(tight, "{l:?} could go lower in {:?}", plan.lifetimes);
            }
        }
    }
}

#[test]
fn stats_describe_the_schedule() {
    let g = InputGraph::from_children(vec![vec![], vec![], vec![Some(0), Some(1)], vec![], vec![Some(2), Some(3)]])
        .unwrap();
    let mut s = Schedule::default();
    Scheduler::default().schedule(&[&g, &InputGraph::chain(2)], 2, &mut s);
    let st = s.stats();
    assert_eq!((st.tasks, st.vertices, st.max_task), (3, 7, 4));
    assert!((st.mean_task - 7.0 / 3.0).abs() < 1e-9);
    assert_eq!(st.to_string(), "7 vertices in 3 tasks (mean 2.3, max 4)");
    let mut agenda = Scheduler::new(Box::new(Agenda { max_batch: 2 }));
    agenda.schedule(&[&g], 2, &mut s);
    assert_eq!(s.tasks.iter().map(|t| t.len()).collect::<Vec<_>>(), vec![2, 2, 1]);
    Scheduler::new(Box::new(ByDepth)).schedule(&[&g], 2, &mut s);
    // By depth, leaf 3 (depth 1) runs with vertex 2, not with the deeper leaves 0 and 1.
    assert_eq!(s.tasks.len(), 3);
    assert_eq!(s.tasks[1].len(), 2);
}

#[test]
fn inference_plans_are_smaller_and_per_task_temporaries_are_small() {
    let f = Builder::new("cell", 2);
    let x = f.pull("x", 8);
    let (h0, h1) = (f.gather(0, "h", 16), f.gather(1, "h", 16));
    let w = f.param("W", [8, 16], Init::Xavier);
    let u0 = f.param("U0", [16, 16], Init::Xavier);
    let u1 = f.param("U1", [16, 16], Init::Xavier);
    let h = (x.matmul(w) + h0.matmul(u0) + h1.matmul(u1)).tanh();
    f.scatter("h", h);
    f.push("h", h);
    let f = f.build().unwrap();
    let train = MemoryPlan::new(&f, 10_000, 100, true);
    let infer = MemoryPlan::new(&f, 10_000, 100, false);
    assert!(infer.bytes() < train.bytes(), "{} vs {}", infer.bytes(), train.bytes());
    // h0·U0 and h1·U1 live within one task: 100 rows, not 10,000.
    assert!(train.forward.iter().flatten().any(|r| r.per_task));
}
