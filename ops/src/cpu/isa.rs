//! Which vector instructions arbor's own CPU kernels use: the best the CPU has, or fewer when the
//! environment variable `ARBOR_CPU_ISA` asks for them (`avx512`, `avx2` or `baseline`), so that any
//! machine can run, and the tests check, the paths a smaller CPU takes. The variable only lowers
//! the level: asking for more than the CPU has gives what it has. The `gemm` crate, which products
//! fall back to, picks its own kernels from the CPU alone.

use arbor_core::error::{Error, Result};
use std::sync::OnceLock;

/// The environment variable that caps the instruction set.
pub const VAR: &str = "ARBOR_CPU_ISA";

/// A level of vector instructions, from least to most.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain loops, compiled for the target's baseline (SSE2 on x86-64, NEON on AArch64).
    Baseline,
    /// x86-64 with AVX2 and FMA.
    Avx2,
    /// x86-64 with AVX-512F (and AVX2 and FMA).
    Avx512,
}

impl Isa {
    /// Every level, from least to most.
    pub const ALL: [Isa; 3] = [Isa::Baseline, Isa::Avx2, Isa::Avx512];

    /// The level's name, as `ARBOR_CPU_ISA` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The level named `name` (as [`Isa::name`] writes it, any case).
    pub fn parse(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name().eq_ignore_ascii_case(name.trim()))
    }

    /// The best level this CPU has.
    pub fn detected() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let fma = std::is_x86_feature_detected!("fma");
            if fma && std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx2") {
                return Isa::Avx512;
            }
            if fma && std::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The cap `ARBOR_CPU_ISA` asks for: `None` when it is unset or empty, an error naming the
/// accepted values when it holds something else.
pub fn requested() -> Result<Option<Isa>> {
    let Some(value) = std::env::var_os(VAR) else { return Ok(None) };
    let value = value.to_string_lossy();
    if value.trim().is_empty() {
        return Ok(None);
    }
    Isa::parse(&value).map(Some).ok_or_else(|| {
        Error::input(
            format!("environment variable {VAR}"),
            "one of avx512, avx2, baseline",
            format!("`{}`", value.escape_debug()),
        )
    })
}

/// The level the kernels use: [`Isa::detected`], capped by [`requested`]. Read once per process;
/// a value `requested` refuses is reported once on standard error and ignored (the command-line
/// tool refuses it before it starts).
pub fn active() -> Isa {
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let cap = requested().unwrap_or_else(|e| {
            eprintln!("arbor: {e}; using the CPU's own");
            None
        });
        cap.map_or(Isa::detected(), |cap| cap.min(Isa::detected()))
    })
}

/// Whether this CPU runs AVX-512 multiply-adds at full width, two 512-bit units a core (Intel's
/// AVX-512 server cores), rather than in two 256-bit halves (AMD's Zen 4): told by the CPU's
/// vendor, so Intel parts with one 512-bit unit (client cores, some Xeons) count as full width
/// too (measured on Xeons only). Which of the CPU backend's kernels runs a large product depends
/// on it.
pub fn full_width() -> bool {
    static WIDE: OnceLock<bool> = OnceLock::new();
    *WIDE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // Leaf 0, the vendor, exists on every x86-64 CPU.
            let id = std::arch::x86_64::__cpuid(0);
            let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
            vendor == b"GenuineIntel"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_levels_order() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
            assert_eq!(Isa::parse(&format!(" {} ", isa.name().to_uppercase())), Some(isa));
        }
        assert_eq!(Isa::parse("sse9"), None);
        assert!(Isa::Baseline < Isa::Avx2 && Isa::Avx2 < Isa::Avx512);
        assert!(active() <= Isa::detected());
    }
}
