//! arbor-ops: what each op computes on the CPU — GEMMs through the `gemm` crate, fused
//! element-wise kernels as tight loops, gathers and scatter-adds of rows — and the
//! [`CpuBackend`] that offers them through arbor-core's `Backend` trait.

pub mod cpu;

pub use cpu::CpuBackend;
