//! The optimizer on the device: the update of every rule (`arbor_core::optim::apply`, operation
//! for operation) over a dense tensor or over chosen rows of a table, under the step's gate
//! (`arbor_core::gate`), the sum of squares that gives a gradient norm and its finiteness test
//! in one pass, the gate decided from those sums, and the scaling a loss scale needs.
//!
//! Products and sums are written with `__fmul_rn`, `__fadd_rn`, `__fsub_rn`, `__fdiv_rn` and
//! `__fsqrt_rn`, which the compiler never fuses into multiply-adds, so a kernel gives the CPU's
//! bits; compiled as host C (the prelude maps them to plain operators) the same text is checked
//! against the CPU optimizer without a GPU.

/// The bodies of the optimizer kernels, one call per thread index `t` (after the prelude).
pub const OPTIM_BODIES: &str = r#"
#ifdef ARBOR_HOST
#define __fmul_rn(a, b) ((float)(a) * (float)(b))
#define __fadd_rn(a, b) ((float)(a) + (float)(b))
#define __fsub_rn(a, b) ((float)(a) - (float)(b))
#define __fdiv_rn(a, b) ((float)(a) / (float)(b))
#define __fsqrt_rn(a) sqrtf(a)
#endif
/* One value's update; `rule`: 0 SGD (momentum `mom`), 1 Adagrad, 2 Adam, 3 AdamW. */
ARBOR_DEVICE void arbor_update_one(float* p, float g, float* m, float* v, int rule, float lr, float wd, float mom,
                                   float b1, float b2, float eps, float bc1, float bc2) {
    float x = *p;
    if (rule == 0) {
        g = __fadd_rn(g, __fmul_rn(wd, x));
        float mm = __fadd_rn(__fmul_rn(mom, *m), g);
        *m = mm;
        *p = __fsub_rn(x, __fmul_rn(lr, mm));
    } else if (rule == 1) {
        g = __fadd_rn(g, __fmul_rn(wd, x));
        float mm = __fadd_rn(*m, __fmul_rn(g, g));
        *m = mm;
        *p = __fsub_rn(x, __fdiv_rn(__fmul_rn(lr, g), __fadd_rn(__fsqrt_rn(mm), eps)));
    } else {
        if (rule == 2) g = __fadd_rn(g, __fmul_rn(wd, x));
        float mm = __fadd_rn(__fmul_rn(b1, *m), __fmul_rn(__fsub_rn(1.0f, b1), g));
        float vv = __fadd_rn(__fmul_rn(b2, *v), __fmul_rn(__fmul_rn(__fsub_rn(1.0f, b2), g), g));
        *m = mm;
        *v = vv;
        float step = __fdiv_rn(__fdiv_rn(mm, bc1), __fadd_rn(__fsqrt_rn(__fdiv_rn(vv, bc2)), eps));
        if (rule == 3) x = __fsub_rn(x, __fmul_rn(__fmul_rn(lr, wd), x));
        *p = __fsub_rn(x, __fmul_rn(lr, step));
    }
}
/* Whether the step's gate (null: none) applies it; its factor times the gradient `g` into `*out`. */
ARBOR_DEVICE int arbor_gated(const float* gate, float g, float* out) {
    if (!gate) {
        *out = g;
        return 1;
    }
    *out = __fmul_rn(g, gate[0]);
    return gate[1] != 0.0f;
}
ARBOR_DEVICE void arbor_update_body(long long t, long long n, float* p, const float* g, float* m, float* v,
                                    const float* gate, int rule, float lr, float wd, float mom, float b1, float b2,
                                    float eps, float bc1, float bc2) {
    float gg;
    if (t < n && arbor_gated(gate, g[t], &gg))
        arbor_update_one(&p[t], gg, &m[t], &v[t], rule, lr, wd, mom, b1, b2, eps, bc1, bc2);
}
/* The rows `rows[0..n)` of a table of `vocab` rows of `dim` values, row k's gradient at `g[k * dim]`
   (each row named once: rows are updated in parallel). */
ARBOR_DEVICE void arbor_update_rows_body(long long t, long long n, long long dim, const unsigned* rows,
                                         long long vocab, float* p, const float* g, float* m, float* v,
                                         const float* gate, int rule, float lr, float wd, float mom, float b1,
                                         float b2, float eps, float bc1, float bc2) {
    float gg;
    if (t >= n * dim || !arbor_gated(gate, g[t], &gg)) return;
    long long at = (long long)arbor_row(rows[t / dim], vocab) * dim + t % dim;
    arbor_update_one(&p[at], gg, &m[at], &v[at], rule, lr, wd, mom, b1, b2, eps, bc1, bc2);
}
/* Thread `t` of `threads` adds the squares of x[t], x[t + threads], … (in f64) to `*sum`. */
ARBOR_DEVICE void arbor_sum_squares_body(long long t, long long threads, const float* x, long long n, double* sums,
                                         long long slots) {
    if (t >= threads) return;
    double s = 0.0;
    for (long long i = t; i < n; i += threads) s += (double)x[i] * (double)x[i];
    /* Spread over `slots` sums (the host adds them): one address would serialize every add. */
    if (s != 0.0) atomicAdd(&sums[t % slots], s);
}
/* The gate of `regions` regions' partial sums (`slots` each), as `arbor_core::gate::decide`:
   the slots added in order, then the regions; one thread. */
ARBOR_DEVICE void arbor_decide_body(long long t, const double* sums, long long regions, long long slots, float clip,
                                    float* gate) {
    if (t != 0) return;
    double total = 0.0;
    int finite = 1;
    for (long long r = 0; r < regions; ++r) {
        double s = 0.0;
        for (long long k = 0; k < slots; ++k) s += sums[r * slots + k];
        finite = finite && isfinite(s);
        total += s;
    }
    float norm = (float)sqrt(total);
    gate[0] = norm > clip && norm > 0.0f ? __fdiv_rn(clip, norm) : 1.0f;
    gate[1] = finite ? 1.0f : 0.0f;
}
ARBOR_DEVICE void arbor_scale_body(long long t, float* x, long long n, float s) {
    if (t < n) x[t] = __fmul_rn(x[t], s);
}
/* The weight average: avg += (1 - keep) * (x - avg), as the CPU computes it. */
ARBOR_DEVICE void arbor_average_body(long long t, float* avg, const float* x, long long n, float keep) {
    if (t < n) avg[t] = __fadd_rn(avg[t], __fmul_rn(__fsub_rn(1.0f, keep), __fsub_rn(x[t], avg[t])));
}
"#;

/// The optimizer kernels' parameters, as `(name, parameter list, argument list)`.
pub const OPTIM_KERNELS: [(&str, &str, &str); 6] = [
    (
        "arbor_update",
        "long long n, float* p, const float* g, float* m, float* v, const float* gate, int rule, float lr, \
         float wd, float mom, float b1, float b2, float eps, float bc1, float bc2",
        "n, p, g, m, v, gate, rule, lr, wd, mom, b1, b2, eps, bc1, bc2",
    ),
    (
        "arbor_update_rows",
        "long long n, long long dim, const unsigned* rows, long long vocab, float* p, const float* g, float* m, \
         float* v, const float* gate, int rule, float lr, float wd, float mom, float b1, float b2, float eps, \
         float bc1, float bc2",
        "n, dim, rows, vocab, p, g, m, v, gate, rule, lr, wd, mom, b1, b2, eps, bc1, bc2",
    ),
    (
        "arbor_decide",
        "const double* sums, long long regions, long long slots, float clip, float* gate",
        "sums, regions, slots, clip, gate",
    ),
    (
        "arbor_sum_squares",
        "long long threads, const float* x, long long n, double* sums, long long slots",
        "threads, x, n, sums, slots",
    ),
    ("arbor_scale", "float* x, long long n, float s", "x, n, s"),
    ("arbor_average", "float* avg, const float* x, long long n, float keep", "avg, x, n, keep"),
];

/// Threads of a sum of squares over `n` values: enough to fill a device, few enough that their
/// atomic adds cost nothing next to the reads.
pub fn sum_threads(n: usize) -> usize {
    n.clamp(1, 1 << 16)
}
