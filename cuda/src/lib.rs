//! arbor-cuda: the CUDA backend on `cudarc`, loaded dynamically so that arbor builds and runs on
//! machines without CUDA.
//!
//! [`CudaBackend`] implements the engine's `Backend` on one device: cuBLAS GEMMs, fused kernels
//! generated as CUDA C ([`codegen`]) and compiled with NVRTC for the device's architecture
//! ([`nvrtc`], which needs no device; [`cache`]: in memory and on disk), its own small kernels
//! ([`helpers`]) and the optimizer's ([`optim`]), all in the buffers the engine plans.

pub mod backend;
pub mod cache;
pub mod codegen;
pub mod gemm;
pub mod helpers;
pub mod nvrtc;
pub mod optim;

pub use backend::{CudaBackend, GraphCounts, Precision};

use arbor_core::error::{Error, Result};

/// The number of CUDA devices, or an error saying why there is none usable. Never panics:
/// the driver, cuBLAS and NVRTC libraries are probed before the driver is called.
pub fn device_count() -> Result<usize> {
    let missing = |lib: &str| Error::Backend {
        backend: "cuda",
        op: "detect".into(),
        msg: format!("the {lib} library was not found (is CUDA installed and on the library path?)"),
    };
    // SAFETY: these probes only try to load the shared libraries.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Err(missing("CUDA driver (libcuda)"));
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Err(missing("cuBLAS"));
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(missing("NVRTC"));
        }
    }
    let n = cudarc::driver::CudaContext::device_count().map_err(|e| Error::Backend {
        backend: "cuda",
        op: "detect".into(),
        msg: e.to_string(),
    })?;
    Ok(n.max(0) as usize)
}

/// Whether at least one CUDA device can be used.
pub fn is_available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn detection_never_panics() {
        // On a machine without CUDA this is an error; with CUDA, a count. Either way, no panic,
        // and the two answers agree.
        let count = super::device_count();
        assert_eq!(super::is_available(), count.as_ref().is_ok_and(|&n| n > 0));
        if let Err(e) = count {
            assert!(e.to_string().contains("cuda"), "{e}");
        }
    }
}
