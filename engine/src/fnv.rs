//! A fast hasher (FNV-1a) for the engine's small keys: steps, load patterns and row hashes,
//! looked up on every task of every minibatch, where the standard library's SipHash costs more
//! than the work it guards. None of these keys comes from outside the process's own analysis,
//! so a hasher without keys is safe.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const PRIME: u64 = 0x1000_0000_01b3;

/// FNV-1a over bytes; a `u64` is taken in one step (row hashes are hashes already).
pub(super) struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(PRIME);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(PRIME);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// A hash map with [`Fnv`] hashing.
pub(super) type FnvMap<K, V> = HashMap<K, V, BuildHasherDefault<Fnv>>;
