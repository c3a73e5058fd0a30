//! `Builder::build` rejects ill-formed vertex functions with an error that names the function,
//! the offending op, state, slot or value, and the shapes involved.

use arbor_core::ir::{Builder, Init, VertexFn};
use arbor_core::{Error, Shape};

#[track_caller]
fn build_err(f: Builder) -> (Error, String) {
    match f.build() {
        Ok(f) => panic!("expected an error, built:\n{f}"),
        Err(e) => {
            let msg = e.to_string();
            (e, msg)
        }
    }
}

/// Asserts that the error's place `at` is line `line` of this file, and that `msg` starts with it.
#[track_caller]
fn assert_at(at: &Option<String>, line: u32, msg: &str) {
    let here = format!("{}:{line}:", file!());
    assert!(at.as_deref().is_some_and(|a| a.starts_with(&here)), "{at:?}, not {here}");
    assert!(msg.starts_with(&here), "{msg}");
}

#[track_caller]
fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} does not mention {p:?}");
    }
}

#[test]
fn matmul_inner_dimension_mismatch() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let w = f.param("W", [4, 5], Init::Xavier);
    let (y, line) = (x.matmul(w).tanh(), line!());
    f.push("y", y);
    let (e, msg) = build_err(f);
    match &e {
        Error::Shape { at, function, op, inputs, .. } => {
            // The error names the user's line that made the op, and the message starts with it.
            let here = format!("{}:{line}:", file!());
            assert!(at.as_deref().is_some_and(|a| a.starts_with(&here)), "{at:?}, not {here}");
            assert!(msg.starts_with(&here), "{msg}");
            assert_eq!(function, "cell");
            assert_eq!(op, "matmul");
            assert_eq!(inputs.len(), 2);
            assert_eq!(inputs[0].shape, Shape::mat(1, 3));
            assert_eq!(inputs[1].shape, Shape::mat(4, 5));
            assert_eq!(inputs[1].op, "param W");
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
    assert_mentions(&msg, &["`cell`", "matmul", "[1×3]", "[4×5]", "param W", "3 vs 4"]);
}

#[test]
fn per_vertex_matmul_mismatch() {
    let f = Builder::new("cell", 1);
    let a = f.pull("a", [2, 3]);
    let m = f.gather(0, "m", [2, 4]);
    f.push("y", a.matmul(m));
    f.scatter("m", m);
    let (e, msg) = build_err(f);
    assert!(matches!(e, Error::Shape { ref op, .. } if op == "matmul"), "{e:?}");
    // Inputs and states are named by their names, not by index.
    assert_mentions(&msg, &["matmul", "[2×3]", "[2×4]", "pull `a`", "gather(slot 0) of `m`"]);
}

#[test]
fn add_of_different_shapes() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let h = f.gather(0, "h", 4);
    let (y, line) = (x + h, line!());
    f.scatter("h", h);
    f.push("y", y);
    let (e, msg) = build_err(f);
    match &e {
        Error::Shape { at, op, inputs, .. } => {
            // An operator names the user's line too.
            assert!(at.as_deref().is_some_and(|a| a.starts_with(&format!("{}:{line}:", file!()))), "{at:?}");
            assert_eq!(op, "add");
            let shapes: Vec<_> = inputs.iter().map(|i| i.shape.clone()).collect();
            assert_eq!(shapes, [Shape::mat(1, 3), Shape::mat(1, 4)]);
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
    assert_mentions(&msg, &["add", "[1×3]", "[1×4]", "equal shapes"]);
}

#[test]
fn bias_of_wrong_width() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", [2, 3]);
    let b = f.param("b", [1, 2], Init::Zeros);
    f.push("y", x + b);
    let (e, msg) = build_err(f);
    assert!(matches!(e, Error::Shape { ref op, .. } if op == "add"), "{e:?}");
    assert_mentions(&msg, &["add", "[2×3]", "param b [1×2]"]);
}

#[test]
fn gather_slot_beyond_arity() {
    let f = Builder::new("cell", 2);
    let x = f.pull("x", 3);
    let (h, line) = (f.gather(2, "h", 3), line!());
    f.scatter("h", x + h);
    let (e, msg) = build_err(f);
    let Error::GatherSlot { at, function, slot, state, arity } = &e else { panic!("{e:?}") };
    assert_at(at, line, &msg);
    assert_eq!((function.as_str(), *slot, state.as_str(), *arity), ("cell", 2, "h", 2));
    assert_mentions(&msg, &["`cell`", "slot 2", "`h`", "arity 2"]);
}

#[test]
fn scattered_shape_differs_from_gathered() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 4);
    let h = f.gather(0, "h", 3);
    let w = f.param("W", [3, 4], Init::Xavier);
    let line = line!() + 1;
    f.scatter("h", x + h.matmul(w));
    let (e, msg) = build_err(f);
    let Error::StateShape { at, .. } = &e else { panic!("{e:?}") };
    assert_at(at, line, &msg);
    assert_eq!(
        e,
        Error::StateShape {
            at: at.clone(),
            function: "cell".into(),
            state: "h".into(),
            gathered: Shape::mat(1, 3),
            scattered: Shape::mat(1, 4),
        }
    );
    assert_mentions(&msg, &["`h`", "gathered as [1×3]", "scattered as [1×4]"]);
}

#[test]
fn gathered_shape_differs_from_scattered_declared_first() {
    // Scatter before gather: the error still says which shape is which.
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 4);
    f.scatter("h", x);
    let (h, line) = (f.gather(0, "h", 3), line!());
    f.push("y", h);
    let (e, msg) = build_err(f);
    let Error::StateShape { at, .. } = &e else { panic!("{e:?}") };
    assert_at(at, line, &msg);
    assert_eq!(
        e,
        Error::StateShape {
            at: at.clone(),
            function: "cell".into(),
            state: "h".into(),
            gathered: Shape::mat(1, 3),
            scattered: Shape::mat(1, 4),
        }
    );
    assert_mentions(&msg, &["gathered as [1×3]", "scattered as [1×4]"]);
}

#[test]
fn gathered_state_never_scattered() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let h = f.gather(0, "h", 3);
    let c = f.gather(0, "c", 3);
    f.scatter("h", x + h * c);
    let (e, msg) = build_err(f);
    assert_eq!(e, Error::NotScattered { function: "cell".into(), state: "c".into() });
    assert_mentions(&msg, &["`cell`", "`c`", "never scattered"]);
}

#[test]
fn unused_value() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let h = f.gather(0, "h", 3);
    let (_forgotten, line) = (x.tanh(), line!());
    f.scatter("h", x + h);
    let (e, msg) = build_err(f);
    match &e {
        Error::Unused { at, function, value } => {
            assert_at(at, line, &msg);
            assert_eq!(function, "cell");
            assert_eq!(value.op, "tanh");
            assert_eq!(value.shape, Shape::mat(1, 3));
        }
        other => panic!("expected Error::Unused, got {other:?}"),
    }
    assert_mentions(&msg, &["tanh", "[1×3]", "never used"]);
}

#[test]
fn unused_param_and_pull() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let (_w, line) = (f.param("W", [3, 3], Init::Xavier), line!());
    f.push("y", x.tanh());
    let (e, msg) = build_err(f);
    assert!(matches!(e, Error::Unused { ref value, .. } if value.op == "param W"), "{e:?}");
    let Error::Unused { at, .. } = &e else { unreachable!() };
    assert_at(at, line, &msg);
    assert_mentions(&msg, &["param W", "[3×3]"]);

    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let _z = f.pull("z", 2);
    f.push("y", x.tanh());
    let (e, msg) = build_err(f);
    assert!(matches!(e, Error::Unused { ref value, .. } if value.shape == Shape::mat(1, 2)), "{e:?}");
    assert_mentions(&msg, &["pull", "[1×2]", "never used"]);
}

#[test]
fn dead_value() {
    // `t` is used (by `s`), but `s` goes nowhere: `t` reaches neither a scatter nor a push.
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let h = f.gather(0, "h", 3);
    let (t, line) = (x.tanh(), line!());
    let _s = t.sigmoid();
    f.scatter("h", x + h);
    let (e, msg) = build_err(f);
    match &e {
        Error::Dead { at, function, value } => {
            assert_at(at, line, &msg);
            assert_eq!(function, "cell");
            assert_eq!(value.op, "tanh");
        }
        other => panic!("expected Error::Dead naming the tanh, got {other:?}: {other}"),
    }
    assert_mentions(&msg, &["tanh", "reaches neither a scatter nor a push"]);
}

#[test]
fn no_output() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let _y = x.tanh();
    let (e, msg) = build_err(f);
    assert_eq!(e, Error::NoOutput { function: "cell".into() });
    assert_mentions(&msg, &["`cell`", "scatters and pushes nothing"]);

    let (e, _) = build_err(Builder::new("empty", 0));
    assert!(matches!(e, Error::NoOutput { .. }), "{e:?}");
}

#[test]
fn duplicate_names() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let w = f.param("W", [3, 3], Init::Xavier);
    let w2 = f.param("W", [3, 3], Init::Xavier);
    f.push("y", x.matmul(w).matmul(w2));
    let (e, msg) = build_err(f);
    assert_eq!(e, Error::Duplicate { function: "cell".into(), kind: "param", name: "W".into() });
    assert_mentions(&msg, &["param `W`", "declared twice"]);

    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let y = f.pull("x", 3);
    f.push("y", x + y);
    let (e, _) = build_err(f);
    assert!(matches!(e, Error::Duplicate { kind: "input", ref name, .. } if name == "x"), "{e:?}");

    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    f.push("y", x.tanh());
    f.push("y", x.sigmoid());
    let (e, _) = build_err(f);
    assert!(matches!(e, Error::Duplicate { kind: "output", ref name, .. } if name == "y"), "{e:?}");

    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let h = f.gather(0, "h", 3);
    f.scatter("h", x.tanh() + h);
    f.scatter("h", x.sigmoid());
    let (e, _) = build_err(f);
    assert!(matches!(e, Error::Duplicate { ref name, .. } if name == "h"), "{e:?}");
}

#[test]
fn element_wise_on_parameters_only() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let p = f.param("P", [1, 3], Init::Zeros);
    let q = f.param("Q", [1, 3], Init::Zeros);
    f.push("y", x + (p + q));
    let (e, msg) = build_err(f);
    match &e {
        Error::Shape { op, inputs, .. } => {
            assert_eq!(op, "add");
            assert_eq!(inputs[0].op, "param P");
            assert_eq!(inputs[1].op, "param Q");
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
    assert_mentions(&msg, &["add", "param P [1×3]", "param Q [1×3]", "parameters alone"]);

    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let p = f.param("P", [1, 3], Init::Zeros);
    f.push("y", x * p.tanh());
    let (e, msg) = build_err(f);
    assert!(matches!(e, Error::Shape { ref op, .. } if op == "tanh"), "{e:?}");
    assert_mentions(&msg, &["tanh", "param P [1×3]"]);
}

#[test]
fn matmul_with_parameter_on_the_left() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", [3, 2]);
    let w = f.param("W", [4, 3], Init::Xavier);
    f.push("y", w.matmul(x));
    let (e, msg) = build_err(f);
    assert!(matches!(e, Error::Shape { ref op, .. } if op == "matmul"), "{e:?}");
    assert_mentions(&msg, &["matmul", "param W [4×3]", "[3×2]", "right operand"]);
}

#[test]
fn slice_out_of_range() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    f.push("y", x.slice(2, 2));
    let (e, msg) = build_err(f);
    assert!(matches!(e, Error::Shape { ref op, .. } if op.starts_with("slice")), "{e:?}");
    assert_mentions(&msg, &["slice(2..4)", "[1×3]", "2..4 outside 0..3"]);

    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    f.push("y", x.slice(1, 0));
    let (e, _) = build_err(f);
    assert!(matches!(e, Error::Shape { .. }), "empty slice: {e:?}");
}

#[test]
fn concat_of_different_row_counts() {
    let f = Builder::new("cell", 1);
    let x = f.pull("x", [2, 3]);
    let y = f.pull("y", [1, 3]);
    f.push("z", f.concat(&[x, y]));
    let (e, msg) = build_err(f);
    assert!(matches!(e, Error::Shape { ref op, .. } if op == "concat"), "{e:?}");
    assert_mentions(&msg, &["concat", "[2×3]", "[1×3]"]);
}

#[test]
fn first_error_wins() {
    // Later mistakes do not overwrite the first one.
    let f = Builder::new("cell", 1);
    let x = f.pull("x", 3);
    let w = f.param("W", [4, 5], Init::Xavier);
    let y = x.matmul(w);
    let z = y.slice(7, 2);
    f.push("y", z);
    let (e, _) = build_err(f);
    assert!(matches!(e, Error::Shape { ref op, .. } if op == "matmul"), "{e:?}");
}

#[test]
fn a_well_formed_function_builds() {
    // The control: the same shapes, used correctly, build.
    let f = Builder::new("cell", 2);
    let x = f.pull("x", 3);
    let h0 = f.gather(0, "h", 5);
    let h1 = f.gather(1, "h", 5);
    let w = f.param("W", [3, 5], Init::Xavier);
    let h = (x.matmul(w) + h0 + h1).tanh();
    f.scatter("h", h);
    f.push("y", h.sum_cols());
    let f: VertexFn = f.build().unwrap();
    assert_eq!(f.states().len(), 1);
    assert!(f.states()[0].gathered);
    assert_eq!(f.max_children(), Some(2));
}
