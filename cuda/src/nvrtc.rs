//! NVRTC, the CUDA C compiler the backend builds its kernels with. It is loaded dynamically and
//! needs neither a driver nor a device, so generated kernels compile (and are checked) on any
//! machine that has the library: `libnvrtc.so.13` on the library path, e.g. from the
//! `nvidia-cuda-nvrtc` wheel on PyPI, as `.ci/run` installs it.

use arbor_core::error::{Error, Result};
use cudarc::nvrtc::{result, sys};
use std::ffi::CString;
use std::sync::OnceLock;

fn fail(e: impl std::fmt::Display) -> Error {
    Error::Backend { backend: "cuda", op: "NVRTC".into(), msg: e.to_string() }
}

/// Whether the NVRTC library can be loaded (looked for once per process).
pub fn is_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: the probe only tries to load the shared library.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// An error unless NVRTC can be loaded (cudarc panics on a call into a library it cannot load).
fn loaded() -> Result<()> {
    if is_available() {
        Ok(())
    } else {
        Err(fail("the NVRTC library (libnvrtc.so.13) was not found on the library path"))
    }
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    loaded()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two plain out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(fail)?;
    Ok((major, minor))
}

/// What a module compiled for `arch` depends on besides its source, as the kernel cache keys it:
/// the architecture and NVRTC's version (`sm_90 nvrtc 13.5`).
pub fn target(arch: &str) -> Result<String> {
    let (major, minor) = version()?;
    Ok(format!("{arch} nvrtc {major}.{minor}"))
}

/// The architectures NVRTC can compile for, oldest first, as it names them (`sm_90`).
pub fn architectures() -> Result<Vec<String>> {
    loaded()?;
    let mut count = 0;
    // SAFETY: a plain out-parameter.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) }.result().map_err(fail)?;
    let mut archs = vec![0; count.max(0) as usize];
    // SAFETY: an array of the size NVRTC gave.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }.result().map_err(fail)?;
    archs.sort_unstable();
    Ok(archs.into_iter().map(|a| format!("sm_{a}")).collect())
}

/// What ptxas reports of one compiled kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    /// The kernel's name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of stack frame per thread.
    pub stack: u32,
    /// Bytes per thread stored to local memory because registers ran out.
    pub spill_stores: u32,
    /// Bytes per thread loaded back from local memory.
    pub spill_loads: u32,
}

impl Usage {
    /// Whether the kernel spills registers to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// A compiled module: the CUBIN and what ptxas reported of each kernel in it.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The CUBIN, for the driver to load as it is.
    pub image: Vec<u8>,
    /// Per kernel (`__global__` function), its registers and spills.
    pub usage: Vec<Usage>,
}

/// The options every module is compiled with for `arch` (`sm_90`): C++17, and ptxas's resource
/// report (which leaves the CUBIN unchanged).
pub fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-Xptxas".into(), "-v".into()]
}

/// Compiles CUDA C to a CUBIN for `arch` (`sm_90`), so the driver has nothing to translate. A
/// compile error carries NVRTC's log.
pub fn compile(source: &str, arch: &str) -> Result<Compiled> {
    loaded()?;
    /// Destroys the program however compilation ends.
    struct Program(sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: created below and destroyed only here.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let src = CString::new(source).map_err(|_| fail("the kernel source holds a NUL byte"))?;
    let program = Program(result::create_program(&src, None).map_err(fail)?);
    // SAFETY: `program` is a live program created above (for this call and those below).
    let compiled = unsafe { result::compile_program(program.0, &options(arch)) };
    // `c_char` is `i8` on x86-64 and `u8` on AArch64.
    #[allow(clippy::unnecessary_cast)]
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(program.0) }
        .map(|log| log.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect::<String>())
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(fail(format!("{e:?} compiling for {arch}:\n{}", log.trim_end())));
    }
    let mut size = 0usize;
    // SAFETY: as above.
    unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }.result().map_err(fail)?;
    let mut image = vec![0u8; size];
    // SAFETY: as above; `image` holds the size NVRTC gave.
    unsafe { sys::nvrtcGetCUBIN(program.0, image.as_mut_ptr().cast()) }.result().map_err(fail)?;
    Ok(Compiled { image, usage: usage(&log) })
}

/// The kernels' resource lines of a ptxas report (`-Xptxas -v`):
///
/// ```text
/// ptxas info    : Compiling entry function 'k' for 'sm_90'
/// ptxas info    : Function properties for k
/// ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
/// ptxas info    : Used 32 registers, used 0 barriers, 8 bytes cumulative stack size
/// ```
pub fn usage(log: &str) -> Vec<Usage> {
    /// The number just before `what` in `line`.
    fn before(line: &str, what: &str) -> Option<u32> {
        let at = line.find(what)?;
        line[..at].split_whitespace().last()?.parse().ok()
    }
    let mut kernels: Vec<Usage> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or_default().to_string();
            kernels.push(Usage { kernel, registers: 0, stack: 0, spill_stores: 0, spill_loads: 0 });
        } else if let Some(k) = kernels.last_mut() {
            if let Some(stack) = before(line, "bytes stack frame") {
                k.stack = stack;
                k.spill_stores = before(line, "bytes spill stores").unwrap_or(0);
                k.spill_loads = before(line, "bytes spill loads").unwrap_or(0);
            } else if let Some(registers) = line.split("Used ").nth(1).and_then(|r| before(r, "registers")) {
                k.registers = registers;
            }
        }
    }
    kernels
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_are_read_per_kernel() {
        let log = "ptxas info    : 0 bytes gmem\n\
                   ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
                   ptxas info    : Function properties for a\n\
                   ptxas         .     256 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n\
                   ptxas info    : Used 255 registers, used 0 barriers, 256 bytes cumulative stack size\n\
                   ptxas info    : Compile time = 145.125 ms\n\
                   ptxas info    : Compiling entry function 'b' for 'sm_80'\n\
                   ptxas info    : Function properties for b\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 18 registers, 380 bytes cmem[0]\n";
        let got = usage(log);
        assert_eq!(
            got,
            [
                Usage { kernel: "a".into(), registers: 255, stack: 256, spill_stores: 12, spill_loads: 8 },
                Usage { kernel: "b".into(), registers: 18, stack: 0, spill_stores: 0, spill_loads: 0 },
            ]
        );
        assert!(got[0].spills() && !got[1].spills());
    }

    #[test]
    fn a_missing_library_is_an_error() {
        if !is_available() {
            assert!(compile("", "sm_90").unwrap_err().to_string().contains("libnvrtc"));
            assert!(version().is_err() && architectures().is_err());
        }
    }
}
