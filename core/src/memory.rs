//! The one memory check: what a model or a minibatch will need, against what the machine has,
//! before anything is allocated, so a run that cannot fit ends with an error naming the cause
//! instead of being killed by the system.

use crate::error::{Error, Result};
use crate::ir::VertexFn;

/// Bytes of memory the system says are available (Linux's `MemAvailable`); `None` where it is
/// not known, and then nothing is refused.
pub fn available() -> Option<u128> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<u128>().ok().map(|kb| kb * 1024)
}

/// `bytes` in GiB, for messages.
pub fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// Refuses `bytes` of memory when the system has less available: `what` names the flags or the
/// input that ask for it, `purpose` what the memory is for.
pub fn check(what: &str, bytes: u128, purpose: &str) -> Result<()> {
    match available() {
        Some(have) if bytes > have => Err(Error::input(
            what,
            format!("what fits in the {} of memory available", gib(have)),
            format!("{purpose} that need {}", gib(bytes)),
        )),
        _ => Ok(()),
    }
}

/// Memory one vertex-function layer's engine holds besides its parameters (plans, launch lists,
/// scratch), an upper bound of what `arbor train --layers` measures (about 1 MiB a layer).
pub const ENGINE_BYTES: u128 = 2 << 20;

/// Memory one pipeline stage on a thread holds besides its layers (its backend's thread team and
/// buffers), an upper bound of what `arbor train --stages` measures (about 4 MiB a stage).
pub const STAGE_BYTES: u128 = 8 << 20;

/// Refuses a model of `floats` learned values (all replicas together), each with its gradient
/// and two optimizer slots, run by `engines` vertex-function engines (each layer and head of
/// each replica), that does not fit; `what` names the flags that set its size.
pub fn check_model(what: &str, floats: u128, engines: u128) -> Result<()> {
    check(
        what,
        floats.saturating_mul(4 * 4).saturating_add(engines.saturating_mul(ENGINE_BYTES)),
        "parameters, gradients, optimizer state and engines",
    )
}

/// Floats one vertex of `f` can hold at once in a training step: every per-vertex value of its
/// forward pass, and as many again for their gradients (an upper bound; the engine reuses
/// temporaries).
pub fn vertex_floats(f: &VertexFn) -> u128 {
    2 * f.forward().nodes.iter().filter(|n| !n.is_param).map(|n| n.shape.numel() as u128).sum::<u128>()
}

/// Learned values of `f`'s parameters.
pub fn param_floats(f: &VertexFn) -> u128 {
    f.params().iter().map(|p| p.shape.numel() as u128).sum()
}
