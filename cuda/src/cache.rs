//! Compiled kernels by [`cache_key`](crate::codegen::cache_key) (source hash and GPU
//! architecture): kept in memory for the run, and on disk so that a second run compiles nothing.
//!
//! The disk cache is a folder of `<key>.ptx` files, each written through a temporary file and a
//! rename. It only ever saves work: a folder that cannot be read or written is skipped.

use crate::codegen::cache_key;
use arbor_core::error::Result;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Compiled kernels, in memory and (optionally) on disk.
#[derive(Debug, Default)]
pub struct KernelCache {
    dir: Option<PathBuf>,
    memory: HashMap<String, Arc<Vec<u8>>>,
    compiled: usize,
}

impl KernelCache {
    /// A cache keeping its files in `dir` (none: memory only).
    pub fn new(dir: Option<PathBuf>) -> KernelCache {
        KernelCache { dir, ..KernelCache::default() }
    }

    /// The default folder: `$ARBOR_KERNEL_CACHE`, else `$XDG_CACHE_HOME/arbor/kernels`, else
    /// `~/.cache/arbor/kernels`.
    pub fn default_dir() -> Option<PathBuf> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        var("ARBOR_KERNEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("arbor").join("kernels")))
            .or_else(|| var("HOME").map(|d| d.join(".cache").join("arbor").join("kernels")))
    }

    /// Kernels this cache has compiled (rather than found).
    pub fn compiled(&self) -> usize {
        self.compiled
    }

    /// The compiled form of `source` for `arch`: from memory, from disk, or from `compile`
    /// (whose result is then kept in both).
    pub fn get_or_compile(
        &mut self,
        source: &str,
        arch: &str,
        compile: impl FnOnce(&str, &str) -> Result<Vec<u8>>,
    ) -> Result<Arc<Vec<u8>>> {
        let key = cache_key(source, arch);
        if let Some(hit) = self.memory.get(&key) {
            return Ok(Arc::clone(hit));
        }
        let file = self.dir.as_ref().map(|d| d.join(format!("{key}.ptx")));
        let bytes = match file.as_deref().and_then(|f| std::fs::read(f).ok()) {
            Some(bytes) => bytes,
            None => {
                let bytes = compile(source, arch)?;
                self.compiled += 1;
                if let Some(f) = &file {
                    store(f, &bytes);
                }
                bytes
            }
        };
        let bytes = Arc::new(bytes);
        self.memory.insert(key, Arc::clone(&bytes));
        Ok(bytes)
    }
}

/// Writes `bytes` to `file` through a temporary file and a rename; failures only lose the
/// saving.
fn store(file: &Path, bytes: &[u8]) {
    let Some(dir) = file.parent() else { return };
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    let saved = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&tmp, bytes))
        .and_then(|_| std::fs::rename(&tmp, file));
    if saved.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_run_compiles_nothing() {
        let dir = std::env::temp_dir().join(format!("arbor-kernel-cache-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        let compile = |src: &str, arch: &str| Ok(format!("{arch}:{src}").into_bytes());
        let mut first = KernelCache::new(Some(dir.clone()));
        let a = first.get_or_compile("kernel a", "sm_90", compile).unwrap();
        assert_eq!(a.as_slice(), b"sm_90:kernel a");
        first.get_or_compile("kernel a", "sm_90", compile).unwrap();
        first.get_or_compile("kernel a", "sm_80", compile).unwrap();
        assert_eq!(first.compiled(), 2, "one compile per source and architecture");

        let mut second = KernelCache::new(Some(dir.clone()));
        let fail = |_: &str, _: &str| -> Result<Vec<u8>> { panic!("the disk cache should have it") };
        assert_eq!(second.get_or_compile("kernel a", "sm_90", fail).unwrap(), a);
        second.get_or_compile("kernel a", "sm_80", fail).unwrap();
        assert_eq!(second.compiled(), 0);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn an_unusable_folder_only_loses_the_saving() {
        let mut cache = KernelCache::new(Some(PathBuf::from("/proc/arbor-cannot-write-here")));
        let compile = |src: &str, _: &str| Ok(src.as_bytes().to_vec());
        assert_eq!(cache.get_or_compile("k", "sm_90", compile).unwrap().as_slice(), b"k");
        assert_eq!(cache.get_or_compile("k", "sm_90", compile).unwrap().as_slice(), b"k");
        assert_eq!(cache.compiled(), 1);
    }
}
