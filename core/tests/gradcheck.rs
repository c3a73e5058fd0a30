//! Finite-difference gradient checks of the symbolic backward function F', one op at a time and
//! for whole Tree-LSTM cells, through the reference interpreter (`interp::forward`/`backward`).
//!
//! Objective and tolerances: see `common/mod.rs` (`L = Σ⟨push_grad, pushed⟩ +
//! Σ⟨state_grad, scattered⟩`, central differences with ε = 1e-2,
//! `|analytic − numeric| ≤ 2e-3 + 1e-2·|numeric|` plus a rounding term that grows with the size
//! of `L`'s terms). Every check also fails when all gradients are zero.

mod common;

use arbor_core::ir::{Builder, Init, VertexFn};
use arbor_core::testing::VertexCase;
use common::{assert_close, binary_tree_lstm, check, check_plans, child_sum_tree_lstm, output, state};

/// `A·B` for row-major `A [r×k]`, `B [k×c]`.
fn matmul(a: &[f32], b: &[f32], r: usize, k: usize, c: usize) -> Vec<f32> {
    (0..r * c).map(|e| (0..k).map(|l| a[e / c * k + l] * b[l * c + e % c]).sum()).collect()
}

#[test]
fn matmul_by_param() {
    let f = Builder::new("matmul-param", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", 4);
    let w = f.param("W", [3, 4], Init::Xavier);
    let u = f.param("U", [4, 4], Init::Xavier);
    f.push("y", x.matmul(w));
    f.scatter("h", h.matmul(u));
    let f = f.build().unwrap();

    let case = VertexCase::random(&f, 1, &[true]);
    let vals = case.forward(&f);
    assert_close(output(&f, &vals, "y"), &matmul(&case.pulls[0], &case.params[0], 2, 3, 4));
    check(&f, &[true]);
    check(&f, &[false]);
}

#[test]
fn matmul_of_two_vertex_values() {
    let f = Builder::new("matmul-vertex", 1);
    let a = f.pull("a", [2, 3]);
    let m = f.gather(0, "m", [3, 4]);
    let z = f.pull("z", [3, 4]);
    f.push("y", a.matmul(m));
    f.scatter("m", z);
    let f = f.build().unwrap();

    let case = VertexCase::random(&f, 2, &[true]);
    let vals = case.forward(&f);
    let m = &case.children[0].as_ref().unwrap()[0];
    assert_close(output(&f, &vals, "y"), &matmul(&case.pulls[0], m, 2, 3, 4));
    check(&f, &[true]);
}

#[test]
fn matmul_of_a_value_with_itself() {
    // Both operands are the same value: its gradient is g·xᵀ + xᵀ·g.
    let f = Builder::new("square", 1);
    let x = f.gather(0, "x", [3, 3]);
    let p = f.pull("p", [3, 3]);
    f.push("y", x.matmul(x));
    f.scatter("x", p.matmul(p));
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn add_broadcast_bias() {
    let f = Builder::new("bias", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", 3);
    let b = f.param("b", [1, 3], Init::Uniform(0.5));
    let c = f.param("c", [1, 3], Init::Uniform(0.5));
    let y = x + b;
    f.push("y", y);
    // The parameter as the left operand.
    f.scatter("h", c + h);
    let f = f.build().unwrap();

    let case = VertexCase::random(&f, 3, &[true]);
    let vals = case.forward(&f);
    let want: Vec<f32> = (0..6).map(|e| case.pulls[0][e] + case.params[0][e % 3]).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
}

#[test]
fn add_same_shape_param() {
    let f = Builder::new("add-param", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    let p = f.param("P", [2, 3], Init::Uniform(0.5));
    f.push("y", x + p);
    f.scatter("h", p + h);
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn add_of_vertex_values() {
    let f = Builder::new("add", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    let y = x + h;
    f.push("y", y);
    f.scatter("h", y + x);
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn sub() {
    let f = Builder::new("sub", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    let p = f.param("P", [1, 3], Init::Uniform(0.5));
    f.push("y", x - h);
    f.push("z", p - x);
    f.scatter("h", h - p);
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn mul_vertex_by_vertex() {
    let f = Builder::new("mul", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    let y = x * h;
    f.push("y", y);
    f.scatter("h", h * h);
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn mul_vertex_by_param() {
    let f = Builder::new("mul-param", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", 3);
    let p = f.param("P", [2, 3], Init::Uniform(1.0));
    let q = f.param("q", [1, 3], Init::Uniform(1.0));
    f.push("y", x * p);
    f.push("z", q * x);
    f.scatter("h", h * q);
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn div() {
    let f = Builder::new("div", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    let one = f.param("one", [1, 3], Init::Const(1.0));
    let d = f.param("d", [1, 3], Init::Const(1.5));
    // Denominators: e^h + 1 ≥ 1 and a parameter near 1.5.
    f.push("y", x / (h.exp() + one));
    f.push("z", h / d);
    // The parameter as numerator, a vertex value as denominator (e^x ≥ e^-1).
    f.scatter("h", d / x.exp());
    let f = f.build().unwrap();

    let case = VertexCase::random(&f, 4, &[true]);
    let vals = case.forward(&f);
    let h = &case.children[0].as_ref().unwrap()[0];
    let want: Vec<f32> = (0..6).map(|e| case.pulls[0][e] / (h[e].exp() + case.params[0][e % 3])).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
}

#[test]
fn scale() {
    let f = Builder::new("scale", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    f.push("y", x.scale(-2.5));
    f.scatter("h", h.scale(0.75));
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn neg() {
    let f = Builder::new("neg", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    f.push("y", -x);
    f.scatter("h", -h);
    let f = f.build().unwrap();
    check(&f, &[true]);
}

/// `U(x)` pushed, `U(h)` scattered, for a unary op `U`.
fn unary_fn(name: &str, op: for<'b> fn(arbor_core::ir::Var<'b>) -> arbor_core::ir::Var<'b>) -> VertexFn {
    let f = Builder::new(name, 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    f.push("y", op(x));
    f.scatter("h", op(h));
    f.build().unwrap()
}

#[test]
fn sigmoid() {
    let f = unary_fn("sigmoid", |x| x.sigmoid());
    let case = VertexCase::random(&f, 5, &[true]);
    let vals = case.forward(&f);
    let want: Vec<f32> = case.pulls[0].iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
}

#[test]
fn tanh() {
    let f = unary_fn("tanh", |x| x.tanh());
    check(&f, &[true]);
}

#[test]
fn relu() {
    // Inputs have magnitude ≥ 0.1 > ε, so no difference straddles the kink; about half are
    // negative (zero gradient) and half positive.
    let f = unary_fn("relu", |x| x.relu());
    let case = VertexCase::random(&f, 6, &[true]);
    let vals = case.forward(&f);
    let want: Vec<f32> = case.pulls[0].iter().map(|x| x.max(0.0)).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
}

#[test]
fn exp() {
    let f = unary_fn("exp", |x| x.exp());
    check(&f, &[true]);
}

#[test]
fn gelu() {
    let f = unary_fn("gelu", |x| x.gelu());
    let case = VertexCase::random(&f, 7, &[true]);
    let vals = case.forward(&f);
    let gelu = |x: f32| 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh());
    let want: Vec<f32> = case.pulls[0].iter().map(|&x| gelu(x)).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
}

#[test]
fn log() {
    let f = Builder::new("log", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    let one = f.param("one", [1, 3], Init::Const(1.0));
    // softplus: log(e^x + 1) > 0 has arguments ≥ 1.
    f.push("y", (x.exp() + one).log());
    // log σ(h): arguments in (0.26, 0.74).
    f.scatter("h", h.sigmoid().log());
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn slice() {
    let f = Builder::new("slice", 1);
    let x = f.pull("x", [2, 5]);
    let h = f.gather(0, "h", 4);
    // Overlapping and disjoint slices of the same value; the middle column 2 is read twice.
    f.push("a", x.slice(1, 3));
    f.push("b", x.slice(0, 2));
    f.push("c", x.slice(2, 3));
    // Swap the halves of h.
    f.scatter("h", f.concat(&[h.slice(2, 2), h.slice(0, 2)]));
    let f = f.build().unwrap();

    let case = VertexCase::random(&f, 7, &[true]);
    let vals = case.forward(&f);
    let x = &case.pulls[0];
    assert_close(output(&f, &vals, "a"), &[x[1], x[2], x[3], x[6], x[7], x[8]]);
    let h = &case.children[0].as_ref().unwrap()[0];
    assert_close(state(&f, &vals, "h"), &[h[2], h[3], h[0], h[1]]);
    check(&f, &[true]);
}

#[test]
fn slice_of_one_column_only() {
    // Only column 3 of x is read; the others get zero gradient.
    let f = Builder::new("slice-one", 1);
    let x = f.pull("x", [2, 5]);
    let h = f.gather(0, "h", [2, 1]);
    f.scatter("h", x.slice(3, 1) * h);
    let f = f.build().unwrap();
    check(&f, &[true]);
}

#[test]
fn concat() {
    let f = Builder::new("concat", 1);
    let x = f.pull("x", [2, 3]);
    let g = f.gather(0, "g", [2, 2]);
    let y = f.concat(&[x, g, x]);
    f.push("y", y);
    // Last column of x and first column of g.
    f.scatter("g", y.slice(2, 2));
    let f = f.build().unwrap();

    let case = VertexCase::random(&f, 8, &[true]);
    let vals = case.forward(&f);
    let (x, g) = (&case.pulls[0], &case.children[0].as_ref().unwrap()[0]);
    let want = [
        x[0], x[1], x[2], g[0], g[1], x[0], x[1], x[2], //
        x[3], x[4], x[5], g[2], g[3], x[3], x[4], x[5],
    ];
    assert_close(output(&f, &vals, "y"), &want);
    assert_close(state(&f, &vals, "g"), &[x[2], g[0], x[5], g[2]]);
    check(&f, &[true]);
}

#[test]
fn sum_cols() {
    let f = Builder::new("sum-cols", 1);
    let x = f.pull("x", [2, 3]);
    let s = f.gather(0, "s", [2, 3]);
    f.push("y", x.sum_cols());
    f.push("z", s.sum_cols());
    f.scatter("s", x * s);
    let f = f.build().unwrap();

    let case = VertexCase::random(&f, 9, &[true]);
    let vals = case.forward(&f);
    let x = &case.pulls[0];
    assert_close(output(&f, &vals, "y"), &[x[0] + x[1] + x[2], x[3] + x[4] + x[5]]);
    check(&f, &[true]);
}

#[test]
fn abs() {
    // Inputs have magnitude ≥ 0.1 > ε (as for relu), so no difference straddles the kink.
    let f = unary_fn("abs", |x| x.abs());
    let case = VertexCase::random(&f, 10, &[true]);
    let vals = case.forward(&f);
    let want: Vec<f32> = case.pulls[0].iter().map(|x| x.abs()).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
}

/// A stop-gradient passes its value and no gradient: in `y = x ⊙ detach(h) + detach(x·W) ⊙ h`
/// (scattering `x`), `x` gets `dy ⊙ h` (and the scattered state's weight), the child's `h` gets
/// `dy ⊙ (x·W)`, and `W` nothing; a function whose every path is detached gets no gradient.
#[test]
fn detach() {
    let f = Builder::new("detach", 1);
    let x = f.pull("x", [1, 4]);
    let h = f.gather(0, "h", [1, 4]);
    let w = f.param("W", [4, 4], Init::Xavier);
    f.push("y", x * h.detach() + x.matmul(w).detach() * h);
    f.scatter("h", x);
    let f = f.build().unwrap();
    let case = VertexCase::random(&f, 21, &[true]);
    let (x, h, w, dy, dh) = (
        &case.pulls[0],
        &case.children[0].as_ref().unwrap()[0],
        &case.params[0],
        &case.push_grads[0],
        &case.state_grads[0],
    );
    let xw = matmul(x, w, 1, 4, 4);
    let vals = case.forward(&f);
    let want: Vec<f32> = (0..4).map(|i| x[i] * h[i] + xw[i] * h[i]).collect();
    assert_close(output(&f, &vals, "y"), &want);
    let (grads, params) = case.gradients(&f);
    assert_close(&grads.pulls[0], &(0..4).map(|i| dy[i] * h[i] + dh[i]).collect::<Vec<_>>());
    assert_close(&grads.children[0].as_ref().unwrap()[0], &(0..4).map(|i| dy[i] * xw[i]).collect::<Vec<_>>());
    assert!(params[0].iter().all(|&g| g == 0.0), "W is reached through detached values only");
    if let Err(e) = check_plans(&f) {
        panic!("{e}")
    }
    let g = Builder::new("all-detached", 0);
    let x = g.pull("x", [1, 3]);
    g.push("y", x.detach().tanh());
    let g = g.build().unwrap();
    let (grads, _) = VertexCase::random(&g, 22, &[]).gradients(&g);
    assert!(grads.pulls[0].iter().all(|&v| v == 0.0), "no gradient through a detached input");
}

/// Dropout on a pull, a gathered state and a parameter: each is its value times its mask (`0` or
/// `1 / (1 − p)`), and gradients flow through the kept elements only.
#[test]
fn dropout() {
    let f = Builder::new("dropout", 1);
    let x = f.pull("x", [2, 4]).dropout(0.5);
    let h = f.gather(0, "h", [2, 4]).dropout(0.25);
    let w = f.param("W", [4, 4], Init::Xavier);
    let b = f.param("b", [2, 4], Init::Uniform(0.5)).dropout(0.5);
    f.push("y", x.tanh() * h + b);
    f.scatter("h", (x.matmul(w) + h).dropout(0.75));
    let f = f.build().unwrap();
    assert_eq!((f.inputs().len(), f.all_inputs().len()), (1, 5));
    assert_eq!(f.dropout_rates(), [0.5, 0.25, 0.5, 0.75]);

    let case = VertexCase::random(&f, 13, &[true]);
    let vals = case.forward(&f);
    let (x, mx, mh) = (&case.pulls[0], &case.pulls[1], &case.pulls[2]);
    for (mask, keep) in [(mx, 2.0), (mh, 1.0 / 0.75)] {
        assert!(mask.iter().all(|&m| m == 0.0 || m == keep), "mask {mask:?}");
        assert!(mask.contains(&0.0) && mask.contains(&keep), "mask {mask:?} drops all or nothing");
    }
    let (h, b, mb) = (&case.children[0].as_ref().unwrap()[0], &case.params[1], &case.pulls[3]);
    let want: Vec<f32> = (0..8).map(|i| (x[i] * mx[i]).tanh() * (h[i] * mh[i]) + b[i] * mb[i]).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
    check(&f, &[false]);
}

/// Constants: `x + c`, `c − x`, `c · x` and `x − c` (no parameter, no gradient of its own).
#[test]
fn constants() {
    let f = unary_fn("constants", |x| (1.0 - x) * (x + 2.0) - 0.5 * x.tanh() - 3.0);
    let case = VertexCase::random(&f, 11, &[true]);
    let vals = case.forward(&f);
    let want: Vec<f32> = case.pulls[0].iter().map(|&x| (1.0 - x) * (x + 2.0) - 0.5 * x.tanh() - 3.0).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
}

/// A one-column gate broadcast over a row, and a row sum broadcast back.
#[test]
fn broadcast_cols() {
    let f = Builder::new("broadcast-cols", 1);
    let x = f.pull("x", [2, 3]);
    let h = f.gather(0, "h", [2, 3]);
    let gate = x.slice(0, 1).sigmoid();
    f.push("y", gate.broadcast_cols(3) * h);
    f.scatter("h", x - x.sum_cols().broadcast_cols(3).scale(1.0 / 3.0));
    let f = f.build().unwrap();

    let case = VertexCase::random(&f, 12, &[true]);
    let vals = case.forward(&f);
    let (x, h) = (&case.pulls[0], &case.children[0].as_ref().unwrap()[0]);
    let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
    let want: Vec<f32> = (0..6).map(|i| sig(x[i / 3 * 3]) * h[i]).collect();
    assert_close(output(&f, &vals, "y"), &want);
    check(&f, &[true]);
}

/// Softmax and log-softmax of each row against the formula (one row with values large enough
/// to overflow `e^x` unshifted), and their gradients (the shift by the row's maximum has none,
/// and needs none).
#[test]
fn softmax_and_log_softmax() {
    let f = Builder::new("softmax", 1);
    let x = f.pull("x", [2, 4]);
    let h = f.gather(0, "h", [2, 4]);
    f.push("log_p", x.log_softmax());
    f.push("p", x.softmax());
    f.scatter("h", (h + x.sum_cols().broadcast_cols(4)).softmax().scale(2.0));
    let f = f.build().unwrap();

    let mut case = VertexCase::random(&f, 13, &[true]);
    case.pulls[0][4..].copy_from_slice(&[100.0, 101.0, 99.5, 100.25]);
    let vals = case.forward(&f);
    let x: Vec<f64> = case.pulls[0].iter().map(|&v| f64::from(v)).collect();
    let mut want_log = Vec::new();
    for row in x.chunks(4) {
        let m = row.iter().copied().fold(f64::MIN, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        want_log.extend(row.iter().map(|v| (v - lse) as f32));
    }
    assert_close(output(&f, &vals, "log_p"), &want_log);
    let want_p: Vec<f32> = want_log.iter().map(|l| l.exp()).collect();
    assert_close(output(&f, &vals, "p"), &want_p);
    check(&f, &[true]);
}

/// A 3-ary function reading `h` from every slot and `c` from slot 1 only.
fn three_ary() -> VertexFn {
    let f = Builder::new("gather3", 3);
    let x = f.pull("x", 3);
    let h0 = f.gather(0, "h", 3);
    let h1 = f.gather(1, "h", 3);
    let h2 = f.gather(2, "h", 3);
    let c1 = f.gather(1, "c", 2);
    let u0 = f.param("U0", [3, 3], Init::Xavier);
    let u1 = f.param("U1", [3, 3], Init::Xavier);
    let u2 = f.param("U2", [3, 3], Init::Xavier);
    let v = f.param("V", [3, 2], Init::Xavier);
    let h = (x + h0.matmul(u0) + h1.matmul(u1) + h2.matmul(u2)).tanh();
    f.scatter("h", h);
    f.scatter("c", h.matmul(v) * c1);
    f.push("h", h);
    f.build().unwrap()
}

#[test]
fn gather_with_a_missing_child() {
    let f = three_ary();
    assert_eq!(f.max_children(), Some(3));
    // A missing child reads zeros: with slot 1 empty, h = tanh(x + h0·U0 + h2·U2), c = 0.
    let case = VertexCase::random(&f, 10, &[true, false, true]);
    let vals = case.forward(&f);
    assert!(state(&f, &vals, "c").iter().all(|&c| c == 0.0));
    let (h0, h2) = (&case.children[0].as_ref().unwrap()[0], &case.children[2].as_ref().unwrap()[0]);
    let a = matmul(h0, &case.params[0], 1, 3, 3);
    let b = matmul(h2, &case.params[2], 1, 3, 3);
    let want: Vec<f32> = (0..3).map(|e| (case.pulls[0][e] + a[e] + b[e]).tanh()).collect();
    assert_close(state(&f, &vals, "h"), &want);

    let (grads, _) = case.gradients(&f);
    assert!(grads.children[1].is_none());
    check(&f, &[true, false, true]);
    check(&f, &[false, true, false]);
    check(&f, &[true, true, true]);
}

fn child_sum_fn() -> VertexFn {
    let f = Builder::new("gather-sum", 0);
    let x = f.pull("x", 3);
    let hs = f.gather_sum("h", 3);
    let cs = f.gather_sum("c", [2, 2]);
    let u = f.param("U", [3, 3], Init::Xavier);
    let h = (x + hs.matmul(u)).tanh();
    f.scatter("h", h);
    f.scatter("c", cs.sigmoid() * cs);
    f.push("y", f.concat(&[h, hs]));
    f.build().unwrap()
}

#[test]
fn gather_sum() {
    let f = child_sum_fn();
    assert_eq!(f.max_children(), None);
    let case = VertexCase::random(&f, 11, &[true, true, true]);
    let vals = case.forward(&f);
    let hs: Vec<f32> = (0..3).map(|e| case.children.iter().map(|c| c.as_ref().unwrap()[0][e]).sum()).collect();
    assert_close(&output(&f, &vals, "y")[3..], &hs);
    // Every child receives the same gradient of the summed state.
    let (grads, _) = case.gradients(&f);
    let g: Vec<_> = grads.children.iter().map(|c| c.clone().unwrap()).collect();
    assert_eq!(g[0], g[1]);
    assert_eq!(g[0], g[2]);

    // A leaf sums nothing: zeros.
    let leaf = VertexCase::random(&f, 12, &[]);
    let vals = leaf.forward(&f);
    assert!(output(&f, &vals, "y")[3..].iter().all(|&v| v == 0.0));

    for present in [&[][..], &[true], &[true, true, true], &[true, false, true]] {
        check(&f, present);
    }
}

#[test]
fn binary_tree_lstm_gradients() {
    let f = binary_tree_lstm(3, 2);
    for present in [[true, true], [true, false], [false, true], [false, false]] {
        check(&f, &present);
    }
}

#[test]
fn binary_tree_lstm_forward_matches_hand_computation() {
    let (d, h) = (3, 2);
    let f = binary_tree_lstm(d, h);
    let case = VertexCase::random(&f, 13, &[true, true]);
    let vals = case.forward(&f);
    let (x, p) = (&case.pulls[0], &case.params);
    let ch = |k: usize, s: usize| &case.children[k].as_ref().unwrap()[s];
    let xw = matmul(x, &p[0], 1, d, 5 * h);
    let a0 = matmul(ch(0, 0), &p[1], 1, h, 5 * h);
    let a1 = matmul(ch(1, 0), &p[2], 1, h, 5 * h);
    let gate: Vec<f32> = (0..5 * h).map(|j| xw[j] + a0[j] + a1[j] + p[3][j]).collect();
    let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
    let mut c = vec![0.0; h];
    let mut hn = vec![0.0; h];
    for j in 0..h {
        let (i, f0, f1, o, u) =
            (sig(gate[j]), sig(gate[h + j]), sig(gate[2 * h + j]), sig(gate[3 * h + j]), gate[4 * h + j].tanh());
        c[j] = i * u + f0 * ch(0, 1)[j] + f1 * ch(1, 1)[j];
        hn[j] = o * c[j].tanh();
    }
    assert_close(state(&f, &vals, "c"), &c);
    assert_close(state(&f, &vals, "h"), &hn);
    assert_close(output(&f, &vals, "h"), &hn);
}

#[test]
fn child_sum_tree_lstm_gradients() {
    let f = child_sum_tree_lstm(3, 2);
    for present in [&[][..], &[true], &[true, true], &[true, true, true]] {
        check(&f, present);
    }
}

#[test]
fn gather_and_gather_sum_of_the_same_state() {
    // Child 0's `h` is read twice: on its own and inside the sum over all children.
    let f = Builder::new("mixed-gather", 2);
    let x = f.pull("x", 3);
    let hs = f.gather_sum("h", 3);
    let h0 = f.gather(0, "h", 3);
    f.scatter("h", (x + hs * h0).tanh());
    let f = f.build().unwrap();
    assert_eq!(f.max_children(), None);
    for present in [&[true, true][..], &[false, true], &[true, true, true]] {
        check(&f, present);
    }
}

#[test]
fn pushed_or_scattered_parameter_gets_its_gradient_or_is_rejected() {
    // A parameter pushed or scattered as is. Either `build` rejects it (a parameter is not a
    // per-vertex value, like an element-wise op on parameters alone), naming it, or F' must
    // send it the gradient of that output.
    for scattered in [false, true] {
        let f = Builder::new("param-out", 1);
        let x = f.pull("x", 3);
        let b = f.param("b", [1, 3], Init::Uniform(0.5));
        if scattered {
            let h = f.gather(0, "h", 3);
            f.scatter("h", b);
            f.push("y", (x + h).tanh());
        } else {
            f.push("y", x.tanh());
            f.push("b", b);
        }
        match f.build() {
            Err(e) => assert!(e.to_string().contains("param b"), "{e}"),
            Ok(f) => check(&f, &[true]),
        }
    }
}
