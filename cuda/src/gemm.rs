//! The CUDA backend's own matrix-product kernel, for products too small for a library call to
//! pay: on an H200 a cuBLAS call cost the host ~15 µs and the device ~10 µs at batch 1, several
//! times such a product's work. One launch does up to [`TERMS`] products of one shape, summed
//! into one output (a chain: `h₀·U₀ + h₁·U₁`) or each into its own (a wave). Its bodies are C
//! that also compile for the host, where a test runs a block's threads one phase at a time.

/// Threads per block of the product kernel (and of [`GEMM_SHARED`]'s layout).
pub const GEMM_BLOCK: usize = 256;

/// Floats of shared memory per block: each thread's 4 × 4 sums.
pub const GEMM_SHARED: usize = GEMM_BLOCK * 16;

/// Products one launch takes.
pub const TERMS: usize = 4;

/// The product kernel's name.
pub const GEMM_KERNEL: &str = "arbor_gemm";

/// The product kernel's bodies: `arbor_gemm_tile_body` forms one thread's sums, and, after the
/// block's threads have all done so, `arbor_gemm_store_body` adds a tile's and stores them.
pub const GEMM_BODIES: &str = r#"
/* Row-major products C = op(A)·op(B) of `batch` matrices each (`sa`, `sb`, `sc` apart), all of
   one shape: `count` (up to 4) products, summed into the first one's C (`chain`: stored as its
   `acc` says, adding to C or not) or each into its own C. op(A)(i, p) is a[p·lda + i] under
   `ta`, else a[i·lda + p]; op(B)(p, j) likewise. A block's 256 threads do 256 / `ks` tiles of
   4 × 4 of C, each over `ks` slices of the inner dimension, `chunk` long, one thread a slice:
   thread `lt` of block `blk` is slice lt / (256 / ks) of tile blk · (256 / ks) + lt % (256 / ks).
   Its sums go to `shared` (16 a thread); the first slice's thread then adds the tile's slices in
   order and stores them. Tiles count over (product unless chained, matrix, row block, column
   block), the column block fastest. */
/* Pointer `i` of four, chosen without an array in local memory. */
ARBOR_DEVICE const float* arbor_pick(int i, const float* p0, const float* p1, const float* p2, const float* p3) {
    return i == 0 ? p0 : i == 1 ? p1 : i == 2 ? p2 : p3;
}
ARBOR_DEVICE long long arbor_gemm_tile(long long blk, int lt, long long ks, long long* slice) {
    long long groups = 256 / ks;
    *slice = lt / groups;
    return blk * groups + lt % groups;
}
ARBOR_DEVICE void arbor_gemm_tile_body(long long blk, int lt, long long m, long long n, long long k, long long batch,
                                       long long ks, long long chunk, int count, int chain, long long lda,
                                       long long sa, int ta, long long ldb, long long sb, int tb, const float* a0,
                                       const float* b0, const float* a1, const float* b1, const float* a2,
                                       const float* b2, const float* a3, const float* b3, float* shared) {
    long long slice, rb = (m + 3) / 4, cb = (n + 3) / 4, per = rb * cb;
    long long tile = arbor_gemm_tile(blk, lt, ks, &slice);
    float* out = shared + (long long)lt * 16;
    if (per == 0 || tile >= (chain ? 1 : count) * batch * per) return;
    long long prod = chain ? 0 : tile / (batch * per), q = tile / per % batch, u = tile % per;
    long long i0 = u / cb * 4, j0 = u % cb * 4, p0 = slice * chunk, p1 = p0 + chunk < k ? p0 + chunk : k;
    /* Element (i, p) of op(A) is at i·ai + p·ap, element (p, j) of op(B) at p·bp + j·bj. */
    long long ai = ta ? 1 : lda, ap = ta ? lda : 1, bp = tb ? 1 : ldb, bj = tb ? ldb : 1;
    float s[4][4];
    for (int r = 0; r < 4; ++r)
        for (int e = 0; e < 4; ++e) s[r][e] = 0.0f;
    for (int term = chain ? 0 : (int)prod; term < (chain ? count : (int)prod + 1); ++term) {
        const float* ar[4];
        const float* bc[4];
        for (int r = 0; r < 4; ++r) {
            ar[r] = arbor_pick(term, a0, a1, a2, a3) + q * sa + (i0 + r < m ? i0 + r : m - 1) * ai;
            bc[r] = arbor_pick(term, b0, b1, b2, b3) + q * sb + (j0 + r < n ? j0 + r : n - 1) * bj;
        }
        long long p = p0;
        /* Four steps of the inner dimension loaded before they are used, their loads in flight
           together. */
        for (; p + 4 <= p1; p += 4) {
            float x[4][4], y[4][4];
            for (int d = 0; d < 4; ++d)
                for (int r = 0; r < 4; ++r) {
                    x[d][r] = ar[r][(p + d) * ap];
                    y[d][r] = bc[r][(p + d) * bp];
                }
            for (int d = 0; d < 4; ++d)
                for (int r = 0; r < 4; ++r)
                    for (int e = 0; e < 4; ++e) s[r][e] += x[d][r] * y[d][e];
        }
        for (; p < p1; ++p)
            for (int r = 0; r < 4; ++r)
                for (int e = 0; e < 4; ++e) s[r][e] += ar[r][p * ap] * bc[e][p * bp];
    }
    for (int r = 0; r < 4; ++r)
        for (int e = 0; e < 4; ++e) out[r * 4 + e] = s[r][e];
}
ARBOR_DEVICE void arbor_gemm_store_body(long long blk, int lt, long long m, long long n, long long batch, long long ks,
                                        int count, int chain, long long ldc, long long sc, float* c0, float* c1,
                                        float* c2, float* c3, int acc0, int acc1, int acc2, int acc3,
                                        const float* shared) {
    long long slice, rb = (m + 3) / 4, cb = (n + 3) / 4, per = rb * cb, groups = 256 / ks;
    long long tile = arbor_gemm_tile(blk, lt, ks, &slice);
    if (slice != 0 || per == 0 || tile >= (chain ? 1 : count) * batch * per) return;
    long long prod = chain ? 0 : tile / (batch * per), q = tile / per % batch, u = tile % per;
    long long i0 = u / cb * 4, j0 = u % cb * 4;
    float* c = (float*)arbor_pick((int)prod, c0, c1, c2, c3) + q * sc;
    int acc = prod == 0 ? acc0 : prod == 1 ? acc1 : prod == 2 ? acc2 : acc3;
    for (int r = 0; r < 4 && i0 + r < m; ++r)
        for (int e = 0; e < 4 && j0 + e < n; ++e) {
            float v = 0.0f;
            for (long long l = 0; l < ks; ++l) v += shared[(l * groups + lt) * 16 + r * 4 + e];
            float* o = &c[(i0 + r) * ldc + j0 + e];
            *o = acc ? *o + v : v;
        }
}
"#;

/// The product kernel's parameters, in order.
const GEMM_PARAMS: &str = "long long m, long long n, long long k, long long batch, long long ks, long long chunk, \
    int count, int chain, long long lda, long long sa, int ta, long long ldb, long long sb, int tb, \
    const float* a0, const float* b0, const float* a1, const float* b1, const float* a2, const float* b2, \
    const float* a3, const float* b3, long long ldc, long long sc, float* c0, float* c1, float* c2, float* c3, \
    int acc0, int acc1, int acc2, int acc3";

/// The `__global__` product kernel, `arbor_gemm`: a block's sums in shared memory between its
/// two phases.
pub fn gemm_kernel() -> String {
    format!(
        "extern \"C\" __global__ void {GEMM_KERNEL}({GEMM_PARAMS}) {{\n\
         __shared__ float shared[{GEMM_SHARED}];\n\
         arbor_gemm_tile_body(blockIdx.x, threadIdx.x, m, n, k, batch, ks, chunk, count, chain, lda, sa, ta, ldb, sb, \
             tb, a0, b0, a1, b1, a2, b2, a3, b3, shared);\n\
         __syncthreads();\n\
         arbor_gemm_store_body(blockIdx.x, threadIdx.x, m, n, batch, ks, count, chain, ldc, sc, c0, c1, c2, c3, acc0, \
             acc1, acc2, acc3, shared);\n\
         }}\n"
    )
}

/// How a launch of `arbor_gemm` splits `count` products of `m × n` over `k` (`batch` matrices
/// each; `chain`: summed into one output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmGrid {
    /// Slices of the inner dimension per tile (a power of two up to 16).
    pub ks: usize,
    /// Length of a slice.
    pub chunk: usize,
    /// Blocks of [`GEMM_BLOCK`] threads.
    pub blocks: usize,
}

impl GemmGrid {
    /// The split of `count` products (`chain`: into one output) of `m × n` over `k`, `batch`
    /// matrices each: slices of the inner dimension at least 8 long, up to 16 a tile.
    pub fn of(m: usize, n: usize, k: usize, batch: usize, count: usize, chain: bool) -> GemmGrid {
        let ks = (k / 8).clamp(1, 16);
        let ks = 1 << ks.ilog2();
        let tiles = if chain { 1 } else { count } * batch * m.div_ceil(4) * n.div_ceil(4);
        GemmGrid { ks, chunk: k.div_ceil(ks), blocks: tiles.div_ceil(GEMM_BLOCK / ks) }
    }
}
