//! Matrix products on the device: small ones as the backend's own kernel ([`crate::gemm`]),
//! several of one shape in one launch (a wave's independent products, or a chain summed into
//! one output); the rest through cuBLAS.

use super::{fail, len_of, Arg, ColMajor, CudaBackend, Precision};
use crate::gemm::{GemmGrid, GEMM_BLOCK, GEMM_KERNEL, TERMS};
use arbor_core::backend::{Backend, Gemm, Mem};
use arbor_core::error::Result;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use std::ffi::c_void;

/// Products of at most this many multiply-adds run as the backend's own kernel in f32.
const SMALL_GEMM: usize = 1 << 23;

/// Whether `a` and `b` have one shape: one launch of the own kernel may do both.
fn same_shape(a: &Gemm, b: &Gemm) -> bool {
    (a.m, a.n, a.k, a.ta, a.tb, a.lda, a.ldb, a.ldc) == (b.m, b.n, b.k, b.ta, b.tb, b.lda, b.ldb, b.ldc)
        && (a.batch, a.stride_a, a.stride_b, a.stride_c) == (b.batch, b.stride_a, b.stride_b, b.stride_c)
}

impl CudaBackend {
    /// Whether `g` runs as the backend's own kernel: f32 products of at most [`SMALL_GEMM`]
    /// multiply-adds.
    pub(super) fn own_product(&self, g: &Gemm) -> bool {
        self.precision.get() == Precision::F32
            && g.m.saturating_mul(g.n).saturating_mul(g.k).saturating_mul(g.batch) <= SMALL_GEMM
    }

    /// The device addresses and lengths of `g`'s A, B and C, each checked against its buffer.
    pub(super) fn operands(&self, mem: &Mem<'_, Self>, g: &Gemm) -> Result<[(u64, usize); 3]> {
        let (ar, ac) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
        let (br, bc) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
        let a_len = len_of(ar, ac, g.lda, g.batch, g.stride_a);
        let b_len = len_of(br, bc, g.ldb, g.batch, g.stride_b);
        let c_len = len_of(g.m, g.n, g.ldc, g.batch, g.stride_c);
        Ok([
            (self.data(mem, "gemm A", g.a, a_len)?, a_len),
            (self.data(mem, "gemm B", g.b, b_len)?, b_len),
            (self.data(mem, "gemm C", g.c, c_len)?, c_len),
        ])
    }

    /// One launch of the own kernel over `gs` (one shape, at most [`TERMS`]): summed into the
    /// first one's C (`chain`, the first as its `accumulate` says) or each into its own.
    pub(super) fn own_gemm(&self, mem: &Mem<'_, Self>, gs: &[Gemm], chain: bool) -> Result<()> {
        let Some(g) = gs.first() else { return Ok(()) };
        if g.m == 0 || g.n == 0 || g.batch == 0 {
            return Ok(());
        }
        let grid = GemmGrid::of(g.m, g.n, g.k, g.batch, gs.len(), chain);
        let mut ab = Vec::with_capacity(2 * TERMS);
        let (mut cs, mut accs) = (Vec::with_capacity(TERMS), Vec::with_capacity(TERMS));
        for k in 0..TERMS {
            let [(a, _), (b, _), (c, _)] = match gs.get(k) {
                Some(g) => self.operands(mem, g)?,
                None => [(0, 0); 3],
            };
            ab.extend([Arg::Ptr(a), Arg::Ptr(b)]);
            cs.push(Arg::Ptr(c));
            accs.push(Arg::I32(i32::from(gs.get(k).is_some_and(|g| g.accumulate))));
        }
        let mut args = vec![
            Arg::I64(g.m as i64),
            Arg::I64(g.n as i64),
            Arg::I64(g.k as i64),
            Arg::I64(g.batch as i64),
            Arg::I64(grid.ks as i64),
            Arg::I64(grid.chunk as i64),
            Arg::I32(gs.len() as i32),
            Arg::I32(i32::from(chain)),
            Arg::I64(g.lda as i64),
            Arg::I64(g.stride_a as i64),
            Arg::I32(i32::from(g.ta)),
            Arg::I64(g.ldb as i64),
            Arg::I64(g.stride_b as i64),
            Arg::I32(i32::from(g.tb)),
        ];
        args.extend(ab);
        args.extend([Arg::I64(g.ldc as i64), Arg::I64(g.stride_c as i64)]);
        args.extend(cs);
        args.extend(accs);
        self.launch("gemm", &self.helpers[GEMM_KERNEL], grid.blocks * GEMM_BLOCK, &args)
    }

    /// [`Backend::gemm_batch`]: own-kernel products of one shape four to a launch, the rest one
    /// by one.
    pub(super) fn gemm_wave(&self, mem: &mut Mem<'_, Self>, gs: &[Gemm]) -> Result<()> {
        let (mut own, other): (Vec<Gemm>, Vec<Gemm>) = gs.iter().partition(|g| self.own_product(g));
        while let Some(first) = own.first().copied() {
            let (shaped, rest): (Vec<Gemm>, Vec<Gemm>) = own.into_iter().partition(|g| same_shape(&first, g));
            for group in shaped.chunks(TERMS) {
                self.own_gemm(mem, group, false)?;
            }
            own = rest;
        }
        other.iter().try_for_each(|g| self.gemm(mem, g))
    }

    /// [`Backend::gemm_sum`]: a chain of at most [`TERMS`] own-kernel products of one shape into
    /// one output as one launch; any other chain product by product.
    pub(super) fn gemm_chain(&self, mem: &mut Mem<'_, Self>, gs: &[Gemm]) -> Result<()> {
        let one = gs.len() <= TERMS
            && gs.iter().all(|g| self.own_product(g))
            && gs.windows(2).all(|w| same_shape(&w[0], &w[1]) && w[1].c == w[0].c && w[1].accumulate);
        if one {
            return self.own_gemm(mem, gs, true);
        }
        gs.iter().try_for_each(|g| self.gemm(mem, g))
    }

    /// `g` through cuBLAS (`gemm_strided_batched_ex`), its inputs first rounded to 16 bits in
    /// the scratch buffer where the precision asks.
    pub(super) fn cublas_gemm(&self, mem: &Mem<'_, Self>, g: &Gemm) -> Result<()> {
        let [a, b, (c, _)] = self.operands(mem, g)?;
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let int = |x: usize| i32::try_from(x).map_err(|_| fail("gemm", format!("{x} exceeds cuBLAS's int")));
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
        let cm = ColMajor::of(g);
        let ((first, first_len), (second, second_len)) = if cm.swapped { (b, a) } else { (a, b) };
        let precision = self.precision.get();
        let (first, second, input) = match precision {
            Precision::F32 | Precision::Tf32 => (first, second, cudaDataType::CUDA_R_32F),
            Precision::Bf16 | Precision::F16 => {
                let (kernel, input) = if precision == Precision::Bf16 {
                    ("arbor_to_bf16", cudaDataType::CUDA_R_16BF)
                } else {
                    ("arbor_to_f16", cudaDataType::CUDA_R_16F)
                };
                let scratch = self.scratch(first_len + second_len)?;
                let converted = scratch + 2 * first_len as u64;
                for (src, len, dst) in [(first, first_len, scratch), (second, second_len, converted)] {
                    let args = [Arg::Ptr(src), Arg::I64(len as i64), Arg::Ptr(dst)];
                    self.launch("gemm inputs", &self.helpers[kernel], len, &args)?;
                }
                (scratch, converted, input)
            }
        };
        let compute = if precision == Precision::Tf32 {
            cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        self.issue()?;
        self.ctx.bind_to_thread().map_err(|e| fail("gemm", e))?;
        self.launches.set(self.launches.get() + 1);
        // SAFETY: the three regions were checked against their buffers above, and converted
        // inputs lie in the scratch buffer, which holds both.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op(cm.trans.0),
                op(cm.trans.1),
                int(cm.m)?,
                int(cm.n)?,
                int(cm.k)?,
                (&alpha as *const f32).cast(),
                first as *const c_void,
                input,
                int(cm.ld.0)?,
                cm.stride.0 as i64,
                second as *const c_void,
                input,
                int(cm.ld.1)?,
                cm.stride.1 as i64,
                (&beta as *const f32).cast(),
                c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                int(g.ldc)?,
                g.stride_c as i64,
                int(g.batch)?,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| fail("gemm", e))
    }
}
