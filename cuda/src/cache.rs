//! Compiled kernels by [`cache_key`] (source hash and target: GPU
//! architecture and compiler version): kept in memory for the run, and on disk so that a second
//! run compiles nothing.
//!
//! The disk cache is a folder of `<key>.cubin` files, each a header line with the checksum of
//! the image that follows, written through a temporary file and a rename. It only ever saves
//! work: a folder that cannot be read or written is skipped, and a file whose checksum does not
//! match is compiled afresh and replaced.

use crate::codegen::{cache_key, fnv};
use arbor_core::error::Result;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The first bytes of every cache file, before the image's checksum.
const MAGIC: &str = "arbor-kernel ";

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

    /// The compiled form of `source` for `target`: from memory, from disk, or from `compile`
    /// (whose result is then kept in both).
    pub fn get_or_compile(
        &mut self,
        source: &str,
        target: &str,
        compile: impl FnOnce(&str, &str) -> Result<Vec<u8>>,
    ) -> Result<Arc<Vec<u8>>> {
        let key = cache_key(source, target);
        if let Some(hit) = self.memory.get(&key) {
            return Ok(Arc::clone(hit));
        }
        let file = self.file(&key);
        let bytes = match file.as_deref().and_then(read) {
            Some(bytes) => bytes,
            None => {
                let bytes = compile(source, target)?;
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

    /// Forgets the compiled form of `source` for `target`, in memory and on disk (one the
    /// driver refused), so the next [`get_or_compile`](Self::get_or_compile) compiles it.
    pub fn evict(&mut self, source: &str, target: &str) {
        let key = cache_key(source, target);
        self.memory.remove(&key);
        if let Some(f) = self.file(&key) {
            let _ = std::fs::remove_file(f);
        }
    }

    fn file(&self, key: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{key}.cubin")))
    }
}

/// The image in a cache file, if the file exists and its checksum matches.
fn read(file: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(file).ok()?;
    let newline = bytes.iter().position(|&b| b == b'\n')?;
    let (header, image) = (&bytes[..newline], &bytes[newline + 1..]);
    let sum = std::str::from_utf8(header).ok()?.strip_prefix(MAGIC)?;
    (sum == fnv(image)).then(|| image.to_vec())
}

/// Writes `bytes` to `file` through a temporary file and a rename; failures only lose the
/// saving.
fn store(file: &Path, bytes: &[u8]) {
    static WRITES: AtomicUsize = AtomicUsize::new(0);
    let Some(dir) = file.parent() else { return };
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = file.with_extension(format!("tmp-{}-{n}", std::process::id()));
    let mut contents = format!("{MAGIC}{}\n", fnv(bytes)).into_bytes();
    contents.extend_from_slice(bytes);
    let saved = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&tmp, &contents))
        .and_then(|_| std::fs::rename(&tmp, file));
    if saved.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("arbor-kernel-cache-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        dir
    }

    fn compile(src: &str, target: &str) -> Result<Vec<u8>> {
        Ok(format!("{target}:{src}").into_bytes())
    }

    fn must_not_compile(_: &str, _: &str) -> Result<Vec<u8>> {
        panic!("the disk cache should have it")
    }

    #[test]
    fn a_second_run_compiles_nothing() {
        let dir = folder("second-run");
        let mut first = KernelCache::new(Some(dir.clone()));
        let a = first.get_or_compile("kernel a", "sm_90", compile).unwrap();
        assert_eq!(a.as_slice(), b"sm_90:kernel a");
        first.get_or_compile("kernel a", "sm_90", compile).unwrap();
        first.get_or_compile("kernel a", "sm_80", compile).unwrap();
        assert_eq!(first.compiled(), 2, "one compile per source and target");

        let mut second = KernelCache::new(Some(dir.clone()));
        assert_eq!(second.get_or_compile("kernel a", "sm_90", must_not_compile).unwrap(), a);
        second.get_or_compile("kernel a", "sm_80", must_not_compile).unwrap();
        assert_eq!(second.compiled(), 0);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_damaged_file_is_compiled_afresh_and_replaced() {
        let dir = folder("damaged");
        KernelCache::new(Some(dir.clone())).get_or_compile("kernel b", "sm_90", compile).unwrap();
        let file = dir.join(format!("{}.cubin", cache_key("kernel b", "sm_90")));
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&file, &bytes).unwrap();

        let mut cache = KernelCache::new(Some(dir.clone()));
        assert_eq!(cache.get_or_compile("kernel b", "sm_90", compile).unwrap().as_slice(), b"sm_90:kernel b");
        assert_eq!(cache.compiled(), 1, "the damaged file was not used");
        let mut again = KernelCache::new(Some(dir.clone()));
        again.get_or_compile("kernel b", "sm_90", must_not_compile).unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn evicting_forgets_memory_and_disk() {
        let dir = folder("evict");
        let mut cache = KernelCache::new(Some(dir.clone()));
        cache.get_or_compile("kernel c", "sm_90", compile).unwrap();
        cache.evict("kernel c", "sm_90");
        cache.get_or_compile("kernel c", "sm_90", compile).unwrap();
        assert_eq!(cache.compiled(), 2);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "no temporary files are left");
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
