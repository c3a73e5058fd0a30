//! The CUDA backend's own kernels besides the generated ones: fills, scatter-adds, row sums,
//! f32 to 16-bit conversion, small matrix products ([`crate::gemm`]) and the optimizer's
//! ([`crate::optim`]), as C bodies that also compile for the host (the tests run them there
//! against the CPU backend).

use crate::codegen::PRELUDE;
use crate::gemm::{gemm_kernel, GEMM_BODIES};
use crate::optim::{OPTIM_BODIES, OPTIM_KERNELS};

/// The bodies of the backend's own kernels (fill, scatter-adds, row sums, rows gathered for a
/// read, f32 to bf16 and f16 conversion), one call per thread index `t`; [`helpers`] wraps them as kernels.
pub const HELPER_BODIES: &str = r#"
ARBOR_DEVICE void arbor_fill_body(long long t, float* p, long long n, float value) {
    if (t < n) p[t] = value;
}
/* Up to four regions zeroed in one kernel: thread `t` does element `t` of the regions laid end
   to end (`n0` of `p0`, then `n1` of `p1`, …). */
ARBOR_DEVICE void arbor_zero4_body(long long t, float* p0, long long n0, float* p1, long long n1, float* p2,
                                   long long n2, float* p3, long long n3) {
    if (t < n0) { p0[t] = 0.0f; return; }
    t -= n0;
    if (t < n1) { p1[t] = 0.0f; return; }
    t -= n1;
    if (t < n2) { p2[t] = 0.0f; return; }
    t -= n2;
    if (t < n3) p3[t] = 0.0f;
}
/* Scatter-adds check every row number against the `rows` their data holds, and every index
   set against the `len` entries of its index (`arbor_row`: past them the kernel stops). */
ARBOR_DEVICE void arbor_scatter_indexed_body(long long t, const float* src, long long block, long long n,
                                             float* data, long long rows, const unsigned* index) {
    if (t >= n * block) return;
    unsigned i = index[t / block];
    if (i != ARBOR_NO_ROW) atomicAdd(&data[(long long)arbor_row(i, rows) * block + t % block], src[t]);
}
/* Up to four scatter-adds of `n` blocks of `block` into indexed rows, as one kernel: thread `t`
   does element `t % (n * block)` of scatter `t / (n * block)`, of `count`. */
ARBOR_DEVICE void arbor_scatter_indexed4_body(long long t, long long block, long long n, int count,
                                              const float* s0, float* d0, long long r0, const unsigned* i0,
                                              const float* s1, float* d1, long long r1, const unsigned* i1,
                                              const float* s2, float* d2, long long r2, const unsigned* i2,
                                              const float* s3, float* d3, long long r3, const unsigned* i3) {
    long long per = n * block;
    if (per == 0 || t >= count * per) return;
    long long k = t / per, u = t % per;
    if (k == 0) arbor_scatter_indexed_body(u, s0, block, n, d0, r0, i0);
    else if (k == 1) arbor_scatter_indexed_body(u, s1, block, n, d1, r1, i1);
    else if (k == 2) arbor_scatter_indexed_body(u, s2, block, n, d2, r2, i2);
    else arbor_scatter_indexed_body(u, s3, block, n, d3, r3, i3);
}
/* Into every row of vertex `t / block`'s set: `mode` 0 adds the value to each (a sum's
   gradient), 1 the value divided by their number (a mean's), 2 only to the first row whose
   element in `by` is largest (a max's; a later row must be larger to replace an earlier one),
   3 the value times the member's weight, `by[q]` for position `q` of the list (a weighted sum's). */
ARBOR_DEVICE void arbor_scatter_set_body(long long t, const float* src, long long block, long long n, float* data,
                                         long long rows, const unsigned* offsets, const unsigned* index,
                                         long long len, int mode, const float* by) {
    if (t >= n * block) return;
    long long v = t / block, j = t % block;
    unsigned first = offsets[v], end = offsets[v + 1];
    if (mode == 2) {
        long long best = -1;
        float most = 0.0f;
        for (unsigned q = first; q < end; ++q) {
            unsigned i = index[arbor_row(q, len)];
            if (i == ARBOR_NO_ROW) continue;
            long long r = arbor_row(i, rows);
            float y = by[r * block + j];
            if (best < 0 || y > most) { best = r; most = y; }
        }
        if (best >= 0) atomicAdd(&data[best * block + j], src[t]);
        return;
    }
    float x = mode == 1 && end > first ? src[t] / (float)(end - first) : src[t];
    for (unsigned q = first; q < end; ++q) {
        unsigned i = index[arbor_row(q, len)];
        if (i != ARBOR_NO_ROW) atomicAdd(&data[(long long)arbor_row(i, rows) * block + j], mode == 3 ? x * by[q] : x);
    }
}
/* Attention over the children (arbor_core::attention, operation for operation): thread `t` does
   head `t % heads` of vertex `t / heads`. A child's row is `index[j]` for `j` in
   `offsets[v]..offsets[v + 1]`; its key block is `heads * kw` wide, its value block `heads * vw`. */
ARBOR_DEVICE float arbor_attend_score(const float* q, const float* k, long long kw, float slope, float* deriv) {
    float dot = 0.0f;
    for (long long j = 0; j < kw; ++j) dot += q[j] * k[j];
    *deriv = dot >= 0.0f ? 1.0f : slope;
    return dot >= 0.0f ? dot : slope * dot;
}
/* The largest score of head `h` over vertex `v`'s children and the sum of their exponentials. */
ARBOR_DEVICE void arbor_attend_norm(const float* q, const float* keys, long long h, long long heads, long long kw,
                                    float slope, long long rows, const unsigned* set, unsigned count,
                                    float* most, float* total) {
    float d;
    *most = 0.0f;
    for (unsigned c = 0; c < count; ++c) {
        float s = arbor_attend_score(q, keys + ((long long)arbor_row(set[c], rows) * heads + h) * kw, kw, slope, &d);
        if (c == 0 || s > *most) *most = s;
    }
    *total = 0.0f;
    for (unsigned c = 0; c < count; ++c)
        *total += expf(arbor_attend_score(q, keys + ((long long)arbor_row(set[c], rows) * heads + h) * kw, kw, slope, &d) - *most);
}
/* Vertex `v`'s children's row numbers (checked against the index's `len` entries) and, in
   `count`, how many. */
ARBOR_DEVICE const unsigned* arbor_attend_set(const unsigned* offsets, const unsigned* index, long long len,
                                              long long v, unsigned* count) {
    unsigned first = offsets[v];
    *count = offsets[v + 1] - first;
    if (*count == 0) return index;
    arbor_row(first + *count - 1, len);
    return index + arbor_row(first, len);
}
/* A child's weight (its key at `k`) and, in `deriv`, its score's derivative. */
ARBOR_DEVICE float arbor_attend_weight(const float* q, const float* k, long long kw, float slope, float most,
                                       float total, float* deriv) {
    return expf(arbor_attend_score(q, k, kw, slope, deriv) - most) / total;
}
ARBOR_DEVICE void arbor_attend_body(long long t, long long n, long long heads, long long kw, long long vw, float slope,
                                    const float* query, const float* keys, const float* values, long long rows,
                                    const unsigned* offsets, const unsigned* index, long long len, float* out) {
    if (t >= n * heads) return;
    long long v = t / heads, h = t % heads;
    const float* q = query + (v * heads + h) * kw;
    float* o = out + (v * heads + h) * vw;
    for (long long j = 0; j < vw; ++j) o[j] = 0.0f;
    unsigned count;
    const unsigned* set = arbor_attend_set(offsets, index, len, v, &count);
    if (count == 0) return;
    float most, total, d;
    arbor_attend_norm(q, keys, h, heads, kw, slope, rows, set, count, &most, &total);
    for (unsigned c = 0; c < count; ++c) {
        long long r = arbor_row(set[c], rows);
        float a = arbor_attend_weight(q, keys + (r * heads + h) * kw, kw, slope, most, total, &d);
        for (long long j = 0; j < vw; ++j) o[j] += a * values[(r * heads + h) * vw + j];
    }
}
ARBOR_DEVICE void arbor_attend_grad_body(long long t, long long n, long long heads, long long kw, long long vw,
                                         float slope, const float* query, const float* keys, const float* values,
                                         long long rows, const unsigned* offsets, const unsigned* index, long long len,
                                         const float* grad, float* dq, float* dkeys, float* dvalues) {
    if (t >= n * heads) return;
    long long v = t / heads, h = t % heads;
    const float* q = query + (v * heads + h) * kw;
    const float* g = grad + (v * heads + h) * vw;
    float* dqh = dq + (v * heads + h) * kw;
    for (long long j = 0; j < kw; ++j) dqh[j] = 0.0f;
    unsigned count;
    const unsigned* set = arbor_attend_set(offsets, index, len, v, &count);
    if (count == 0) return;
    float most, total, d, mean = 0.0f;
    arbor_attend_norm(q, keys, h, heads, kw, slope, rows, set, count, &most, &total);
    for (unsigned c = 0; c < count; ++c) {
        long long r = arbor_row(set[c], rows);
        float a = arbor_attend_weight(q, keys + (r * heads + h) * kw, kw, slope, most, total, &d), gv = 0.0f;
        for (long long j = 0; j < vw; ++j) gv += g[j] * values[(r * heads + h) * vw + j];
        mean += a * gv;
    }
    for (unsigned c = 0; c < count; ++c) {
        long long r = arbor_row(set[c], rows);
        const float* k = keys + (r * heads + h) * kw;
        float a = arbor_attend_weight(q, k, kw, slope, most, total, &d), gv = 0.0f;
        for (long long j = 0; j < vw; ++j) gv += g[j] * values[(r * heads + h) * vw + j];
        float ds = a * (gv - mean) * d;
        for (long long j = 0; j < kw; ++j) {
            dqh[j] += ds * k[j];
            atomicAdd(&dkeys[(r * heads + h) * kw + j], ds * q[j]);
        }
        for (long long j = 0; j < vw; ++j) atomicAdd(&dvalues[(r * heads + h) * vw + j], a * g[j]);
    }
}
/* f32 to bfloat16 bits, rounded to nearest even (NaN stays NaN). */
ARBOR_DEVICE unsigned short arbor_bf16(float x) {
    unsigned u = arbor_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* f32 to IEEE half bits, rounded to nearest even: overflow to infinity, small values to
   subnormals. */
ARBOR_DEVICE unsigned short arbor_f16(float x) {
    unsigned u = arbor_bits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);
    if (a < 0x38800000u) {
        if (a < 0x33000000u) return (unsigned short)sign;
        unsigned shift = 126u - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
        unsigned r = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rest > half || (rest == half && (r & 1u))) ++r;
        return (unsigned short)(sign | r);
    }
    a -= 0x38000000u;
    return (unsigned short)(sign | ((a + 0xfffu + ((a >> 13) & 1u)) >> 13));
}
ARBOR_DEVICE void arbor_to_bf16_body(long long t, const float* src, long long n, unsigned short* dst) {
    if (t < n) dst[t] = arbor_bf16(src[t]);
}
ARBOR_DEVICE void arbor_to_f16_body(long long t, const float* src, long long n, unsigned short* dst) {
    if (t < n) dst[t] = arbor_f16(src[t]);
}
/* Row `index[t / block]` of `src` (`rows` rows of `block` values) to `dst[t]`: rows gathered
   before a read. */
ARBOR_DEVICE void arbor_gather_rows_body(long long t, const float* src, long long block, long long n,
                                         long long rows, const unsigned* index, float* dst) {
    if (t < n * block) dst[t] = src[(long long)arbor_row(index[t / block], rows) * block + t % block];
}
ARBOR_DEVICE void arbor_sum_rows_body(long long j, const float* src, long long rows, long long cols, float* dst,
                                      int accumulate) {
    if (j >= cols) return;
    double s = 0.0;
    long long r = 0;
    /* Eight loads in flight, added in order. */
    for (; r + 8 <= rows; r += 8) {
        float w[8];
        for (int d = 0; d < 8; ++d) w[d] = src[(r + d) * cols + j];
        for (int d = 0; d < 8; ++d) s += w[d];
    }
    for (; r < rows; ++r) s += src[r * cols + j];
    dst[j] = accumulate ? dst[j] + (float)s : (float)s;
}
"#;

/// The helper kernels' parameters, as `(name, parameter list, argument list)`.
pub(crate) const HELPERS: [(&str, &str, &str); 11] = [
    (
        "arbor_zero4",
        "float* p0, long long n0, float* p1, long long n1, float* p2, long long n2, float* p3, long long n3",
        "p0, n0, p1, n1, p2, n2, p3, n3",
    ),
    (
        "arbor_attend",
        "long long n, long long heads, long long kw, long long vw, float slope, const float* query, \
         const float* keys, const float* values, long long rows, const unsigned* offsets, const unsigned* index, \
         long long len, float* out",
        "n, heads, kw, vw, slope, query, keys, values, rows, offsets, index, len, out",
    ),
    (
        "arbor_attend_grad",
        "long long n, long long heads, long long kw, long long vw, float slope, const float* query, \
         const float* keys, const float* values, long long rows, const unsigned* offsets, const unsigned* index, \
         long long len, const float* grad, float* dq, float* dkeys, float* dvalues",
        "n, heads, kw, vw, slope, query, keys, values, rows, offsets, index, len, grad, dq, dkeys, dvalues",
    ),
    (
        "arbor_gather_rows",
        "const float* src, long long block, long long n, long long rows, const unsigned* index, float* dst",
        "src, block, n, rows, index, dst",
    ),
    ("arbor_fill", "float* p, long long n, float value", "p, n, value"),
    (
        "arbor_scatter_indexed",
        "const float* src, long long block, long long n, float* data, long long rows, const unsigned* index",
        "src, block, n, data, rows, index",
    ),
    (
        "arbor_scatter_indexed4",
        "long long block, long long n, int count, const float* s0, float* d0, long long r0, const unsigned* i0, \
         const float* s1, float* d1, long long r1, const unsigned* i1, const float* s2, float* d2, long long r2, \
         const unsigned* i2, const float* s3, float* d3, long long r3, const unsigned* i3",
        "block, n, count, s0, d0, r0, i0, s1, d1, r1, i1, s2, d2, r2, i2, s3, d3, r3, i3",
    ),
    (
        "arbor_scatter_set",
        "const float* src, long long block, long long n, float* data, long long rows, const unsigned* offsets, \
         const unsigned* index, long long len, int mode, const float* by",
        "src, block, n, data, rows, offsets, index, len, mode, by",
    ),
    ("arbor_to_bf16", "const float* src, long long n, unsigned short* dst", "src, n, dst"),
    ("arbor_to_f16", "const float* src, long long n, unsigned short* dst", "src, n, dst"),
    (
        "arbor_sum_rows",
        "const float* src, long long rows, long long cols, float* dst, int accumulate",
        "src, rows, cols, dst, accumulate",
    ),
];

/// The CUDA source of the helper kernels, the product kernel ([`crate::gemm`]) and the
/// optimizer's ([`crate::optim`]): the prelude, their bodies, and a `__global__` wrapper for each.
pub fn helpers() -> String {
    let mut src = format!("{PRELUDE}{HELPER_BODIES}{GEMM_BODIES}{OPTIM_BODIES}{}", gemm_kernel());
    for (name, params, args) in HELPERS.into_iter().chain(OPTIM_KERNELS) {
        src.push_str(&format!(
            "extern \"C\" __global__ void {name}({params}) {{ {name}_body(ARBOR_THREAD, {args}); }}\n"
        ));
    }
    src
}
