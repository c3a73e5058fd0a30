//! Property: for random well-typed vertex functions, `Builder::build` succeeds, its kernel plans
//! are valid schedules, and the symbolic backward function agrees with finite differences
//! (objective and tolerances: `common/mod.rs`).
//!
//! A random function is a 2-ary function over one pull `x` and one or two states, each gathered
//! from both child slots, followed by a random sequence of ops on earlier values. Every value
//! that nothing else reads is concatenated at the end; the concatenation is pushed and, projected
//! by a parameter to each state's width, scattered. Values stay bounded (adds are halved, products
//! by parameters pass through tanh, `exp` and `log` only see bounded or positive arguments, divisors
//! are `e^tanh(·) ≥ 1/e`), so the finite differences stay well-conditioned.

mod common;

use arbor_core::ir::{Builder, Init, Var, VertexFn};
use arbor_core::testing::{check_vertex, VertexCase};
use arbor_core::Shape;
use common::check_plans;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

#[derive(Clone, Debug)]
struct Spec {
    /// Rows of every per-vertex value.
    rows: usize,
    /// Width of the pull.
    pull: usize,
    /// Width of each state (one or two states).
    states: Vec<usize>,
    /// Ops: a kind and three choices (operands, widths, constants), taken modulo what fits.
    ops: Vec<(u8, usize, usize, usize)>,
    /// Which of the two child slots hold a child.
    present: [bool; 2],
    /// Seed of parameters, inputs and objective weights.
    seed: u64,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        1usize..=2,
        1usize..6,
        prop::collection::vec(1usize..6, 1..=2),
        prop::collection::vec((0u8..16, 0usize..64, 0usize..64, 0usize..64), 1..9),
        any::<[bool; 2]>(),
        any::<u64>(),
    )
        .prop_map(|(rows, pull, states, ops, present, seed)| Spec { rows, pull, states, ops, present, seed })
}

/// Builds the random function of `spec`; also returns a readable list of its ops.
struct Gen<'b> {
    b: &'b Builder,
    pool: Vec<Var<'b>>,
    used: Vec<bool>,
    params: usize,
    log: Vec<String>,
}

impl<'b> Gen<'b> {
    fn param(&mut self, shape: Shape, init: Init) -> Var<'b> {
        self.params += 1;
        self.b.param(&format!("p{}", self.params), shape, init)
    }

    fn take(&mut self, i: usize) -> Var<'b> {
        let i = i % self.pool.len();
        self.used[i] = true;
        self.pool[i]
    }

    fn add(&mut self, v: Var<'b>, what: String) {
        self.log.push(format!("%{} = {what} {}", v.id().0, v.shape()));
        self.pool.push(v);
        self.used.push(false);
    }

    /// `v` itself if it has `shape`, else `tanh(v·P)` with `P [cols(v) × cols(shape)]`.
    fn fit(&mut self, v: Var<'b>, shape: &Shape) -> Var<'b> {
        if v.shape() == *shape {
            v
        } else {
            let p = self.param(Shape::mat(v.shape().cols(), shape.cols()), Init::Xavier);
            v.matmul(p).tanh()
        }
    }

    fn op(&mut self, (kind, i, j, k): (u8, usize, usize, usize)) {
        let a = self.take(i);
        let sa = a.shape();
        let (r, c) = (sa.rows(), sa.cols());
        let (v, what) = match kind {
            0 => (a.tanh(), "tanh"),
            1 => (a.sigmoid(), "sigmoid"),
            2 => (-a, "neg"),
            3 => {
                let s = [-1.0, -0.75, -0.5, 0.5, 0.75, 1.0][k % 6];
                (a.scale(s), "scale")
            }
            4 => (a.tanh().exp(), "exp∘tanh"),
            5..=7 => {
                let bv = self.take(j);
                let bv = self.fit(bv, &sa);
                match kind {
                    5 => ((a + bv).scale(0.5), "add"),
                    6 => ((a - bv).scale(0.5), "sub"),
                    _ => (a * bv, "mul"),
                }
            }
            8 => {
                let w = 1 + k % 5;
                let p = self.param(Shape::mat(c, w), Init::Xavier);
                (a.matmul(p).tanh(), "matmul param")
            }
            9 => {
                let start = k % c;
                let len = 1 + j % (c - start);
                (a.slice(start, len), "slice")
            }
            10 => {
                if c + self.pool[j % self.pool.len()].shape().cols() <= 8 {
                    let bv = self.take(j);
                    (self.b.concat(&[a, bv]), "concat")
                } else {
                    (self.b.concat(&[a]), "concat1")
                }
            }
            11 => (a.sum_cols().scale(1.0 / c as f32), "sum_cols"),
            12 => {
                let p = self.param(Shape::mat(1, c), Init::Uniform(0.5));
                if k % 2 == 0 {
                    ((a + p).scale(0.5), "add bias")
                } else {
                    ((p + a).scale(0.5), "bias add")
                }
            }
            13 => {
                let shape = if k % 2 == 0 { Shape::mat(r, c) } else { Shape::mat(1, c) };
                let p = self.param(shape, Init::Uniform(1.0));
                if j % 2 == 0 {
                    (a * p, "mul param")
                } else {
                    (p * a, "param mul")
                }
            }
            14 => {
                let bv = self.take(j);
                let bv = self.fit(bv, &sa);
                (a / bv.tanh().exp(), "div")
            }
            _ => (a.tanh().sigmoid().log(), "log∘sigmoid∘tanh"),
        };
        self.add(v, what.into());
    }
}

fn build(spec: &Spec) -> (Result<VertexFn, arbor_core::Error>, String) {
    let b = Builder::new("random", 2);
    let mut g = Gen { b: &b, pool: Vec::new(), used: Vec::new(), params: 0, log: Vec::new() };
    let x = b.pull("x", [spec.rows, spec.pull]);
    g.add(x, "pull x".into());
    for (s, &w) in spec.states.iter().enumerate() {
        for slot in 0..2 {
            let v = b.gather(slot, &format!("s{s}"), [spec.rows, w]);
            g.add(v, format!("gather({slot}, s{s})"));
        }
    }
    for &op in &spec.ops {
        g.op(op);
    }
    let leftovers: Vec<Var<'_>> = g.pool.iter().zip(&g.used).filter(|(_, &u)| !u).map(|(&v, _)| v).collect();
    let out = b.concat(&leftovers);
    b.push("out", out);
    for (s, &w) in spec.states.iter().enumerate() {
        let p = g.param(Shape::mat(out.shape().cols(), w), Init::Xavier);
        let v = if s == 0 { out.matmul(p).tanh() } else { out.matmul(p).sigmoid() };
        b.scatter(&format!("s{s}"), v);
    }
    let log = g.log.join("\n");
    drop(g);
    (b.build(), log)
}

proptest! {
    #![proptest_config(ProptestConfig {
        // Failing cases are kept next to this file (random_fn.proptest-regressions).
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::with_cases(256)
    })]

    #[test]
    fn random_vertex_functions_have_correct_gradients(spec in spec()) {
        let (f, log) = build(&spec);
        let f = match f {
            Ok(f) => f,
            Err(e) => return Err(TestCaseError::fail(format!("build failed: {e}\n{log}"))),
        };
        prop_assert_eq!(f.states().len(), spec.states.len());
        if let Err(e) = check_plans(&f) {
            return Err(TestCaseError::fail(format!("{e}\n{log}")));
        }
        let case = VertexCase::random(&f, spec.seed, &spec.present);
        if let Err(e) = check_vertex(&f, &case) {
            return Err(TestCaseError::fail(format!("{e}\nfunction:\n{log}\n{f}")));
        }
    }
}
