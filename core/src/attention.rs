//! Attention over a vertex's children ([`Op::GatherSoftmax`](crate::ir::Op::GatherSoftmax)) for
//! one vertex: the arithmetic the interpreter and the CPU backend share (the CUDA kernel repeats
//! it operation for operation and is checked against it).
//!
//! For head `h` (row `h` of the query, keys and values), child `c` scores
//! `s_c = σ(q_h · k_{c,h})`, `σ(x) = x` for `x ≥ 0` and `slope·x` below; the weights are
//! `α_c = e^{s_c − max s} / Σ e^{s − max s}` and the output row is `Σ_c α_c v_{c,h}`. A vertex
//! without children reads zeros. The gradient, given the output's gradient `g_h`:
//! `dv_c = α_c g_h`, `ds_c = α_c (g_h·v_c − Σ_c' α_c' g_h·v_c')`, `dq_h = Σ_c σ'·ds_c k_c`,
//! `dk_c = σ'·ds_c q_h`.

/// The widths of one attention: `heads` rows, keys (and the query) `key` wide, values `value`
/// wide.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Widths {
    /// Heads: rows of the query, keys, values and output.
    pub heads: usize,
    /// Columns of the query and of each key.
    pub key: usize,
    /// Columns of each value and of the output.
    pub value: usize,
    /// The leaky ReLU's slope on negative scores (1: scores as they are).
    pub slope: f32,
}

impl Widths {
    /// The score of `q · k` for one head, and its derivative with respect to that product.
    fn score(&self, q: &[f32], k: &[f32]) -> (f32, f32) {
        let dot: f32 = q.iter().zip(k).map(|(a, b)| a * b).sum();
        if dot >= 0.0 {
            (dot, 1.0)
        } else {
            (self.slope * dot, self.slope)
        }
    }

    /// Head `h` of each child's scores into `scores` and its weights (the softmax) into
    /// `weights`.
    fn weights(&self, h: usize, q: &[f32], keys: &[&[f32]], scores: &mut Vec<(f32, f32)>, weights: &mut Vec<f32>) {
        let kw = self.key;
        let qh = &q[h * kw..(h + 1) * kw];
        scores.clear();
        scores.extend(keys.iter().map(|k| self.score(qh, &k[h * kw..(h + 1) * kw])));
        let most = scores.iter().map(|s| s.0).fold(f32::NEG_INFINITY, f32::max);
        weights.clear();
        weights.extend(scores.iter().map(|s| (s.0 - most).exp()));
        let total: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= total);
    }
}

/// Scratch a vertex's attention reuses (one per thread).
#[derive(Default)]
pub struct Scratch {
    scores: Vec<(f32, f32)>,
    weights: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// One vertex's output (`heads × value`) from its query and its children's keys and values.
pub fn forward(w: &Widths, q: &[f32], keys: &[&[f32]], values: &[&[f32]], out: &mut [f32], s: &mut Scratch) {
    out.fill(0.0);
    if keys.is_empty() {
        return;
    }
    let vw = w.value;
    for h in 0..w.heads {
        w.weights(h, q, keys, &mut s.scores, &mut s.weights);
        let o = &mut out[h * vw..(h + 1) * vw];
        for (a, v) in s.weights.iter().zip(values) {
            o.iter_mut().zip(&v[h * vw..(h + 1) * vw]).for_each(|(o, v)| *o += a * v);
        }
    }
}

/// One vertex's gradients given its output's gradient `g`: the query's into `dq` (overwritten),
/// and each child's key and value gradients handed to `add(child, dk, dv)`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    w: &Widths,
    q: &[f32],
    keys: &[&[f32]],
    values: &[&[f32]],
    g: &[f32],
    dq: &mut [f32],
    s: &mut Scratch,
    mut add: impl FnMut(usize, &[f32], &[f32]),
) {
    dq.fill(0.0);
    let (kw, vw) = (w.key, w.value);
    let Scratch { scores, weights, dk, dv } = s;
    dk.clear();
    dk.resize(keys.len() * w.heads * kw, 0.0);
    dv.clear();
    dv.resize(keys.len() * w.heads * vw, 0.0);
    for h in 0..w.heads {
        w.weights(h, q, keys, scores, weights);
        let (qh, gh) = (&q[h * kw..(h + 1) * kw], &g[h * vw..(h + 1) * vw]);
        let dot = |v: &[f32]| -> f32 { gh.iter().zip(&v[h * vw..(h + 1) * vw]).map(|(a, b)| a * b).sum() };
        let mean: f32 = weights.iter().zip(values.iter()).map(|(a, v)| a * dot(v)).sum();
        for (c, (&a, &(_, slope))) in weights.iter().zip(scores.iter()).enumerate() {
            let ds = a * (dot(values[c]) - mean) * slope;
            let kc = &keys[c][h * kw..(h + 1) * kw];
            dq[h * kw..(h + 1) * kw].iter_mut().zip(kc).for_each(|(d, k)| *d += ds * k);
            let at = (c * w.heads + h) * kw;
            dk[at..at + kw].iter_mut().zip(qh).for_each(|(d, q)| *d = ds * q);
            let at = (c * w.heads + h) * vw;
            dv[at..at + vw].iter_mut().zip(gh).for_each(|(d, g)| *d = a * g);
        }
    }
    let (kb, vb) = (w.heads * kw, w.heads * vw);
    for c in 0..keys.len() {
        add(c, &dk[c * kb..(c + 1) * kb], &dv[c * vb..(c + 1) * vb]);
    }
}
