//! A run's checkpoint folder, held by one writer at a time.
//!
//! A training run writes `best/` and `last/` into one folder. [`RunFolder::claim`] makes that
//! folder the run's own for as long as the claim lives: it takes an exclusive lock on
//! `.arbor.lock` inside it (a second writer is refused at start, naming the holder; the lock
//! goes with the process, so a killed run leaves nothing to clean up), and it refuses a folder
//! that already holds another run's checkpoints unless the caller resumes that run or says to
//! overwrite it. The trainer's `Run::fit` claims a folder nobody in the process
//! has claimed itself, as a resumed run where it goes on from a step, else refusing another
//! run's checkpoints. Readers need no lock: every checkpoint is committed by renaming its metadata
//! into place (see [`crate::checkpoint`]).

use arbor_core::error::{Error, Result};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The folders this process holds claims on (resolved), so that a run asked to
/// write into one, or into a folder inside one, knows its caller has claimed it
/// ([`held_here`]).
static HELD: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Whether this process holds a claim on `dir` or on a folder that holds it (a fold's
/// checkpoints inside a cross-validation's folder).
pub fn held_here(dir: &Path) -> bool {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    HELD.lock().is_ok_and(|held| held.iter().any(|h| dir.starts_with(h)))
}

/// The lock file inside a run folder.
const LOCK: &str = ".arbor.lock";

/// What a new run does with a folder that already holds checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    /// Refuse it: the checkpoints belong to another run.
    Refuse,
    /// Keep them: this run resumes the run that wrote them.
    Resume,
    /// Remove them (`best/` and `last/`) once the folder is locked.
    Overwrite,
}

/// A checkpoint folder claimed by this process; the claim ends when the value is dropped.
#[derive(Debug)]
pub struct RunFolder {
    dir: PathBuf,
    /// `dir` resolved, as [`HELD`] lists it.
    resolved: PathBuf,
    _lock: File,
}

impl Drop for RunFolder {
    fn drop(&mut self) {
        if let Ok(mut held) = HELD.lock() {
            if let Some(k) = held.iter().position(|h| *h == self.resolved) {
                held.swap_remove(k);
            }
        }
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io { path: path.display().to_string(), msg: e.to_string() }
}

/// Whether `dir` holds checkpoints, whole or partly written: `best/`, `last/` or what a first
/// save builds beside them.
pub fn holds_checkpoints(dir: &Path) -> bool {
    ["best", "last", ".best.partial", ".last.partial"].iter().any(|name| dir.join(name).symlink_metadata().is_ok())
}

impl RunFolder {
    /// Claims `dir` (created if needed) for one run's checkpoints: locks it, refusing it when
    /// another process holds it, and deals with checkpoints already there as `existing` says.
    pub fn claim(dir: &Path, existing: Existing) -> Result<RunFolder> {
        if let Some(m) = dir.symlink_metadata().ok().filter(|_| !dir.is_dir()) {
            return Err(Error::input(
                format!("checkpoint folder {} (--checkpoint)", dir.display()),
                "a folder (or a path where one can be made)",
                if m.file_type().is_symlink() { "a link that leads to no folder" } else { "a file" },
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let path = dir.join(LOCK);
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                lock.read_to_string(&mut holder).ok();
                let holder = holder.trim();
                return Err(Error::input(
                    format!("checkpoint folder {} (--checkpoint)", dir.display()),
                    "a folder no other run is writing to (wait for it to end, or choose another folder)",
                    format!("one in use by {}", if holder.is_empty() { "another arbor process" } else { holder }),
                ));
            }
            Err(TryLockError::Error(e)) => return Err(io(&path, e)),
        }
        let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let holder = format!("arbor pid {} on {} (started at unix time {started})", std::process::id(), host());
        lock.set_len(0)
            .and_then(|()| lock.rewind())
            .and_then(|()| lock.write_all(holder.as_bytes()))
            .map_err(|e| io(&path, e))?;
        match existing {
            Existing::Resume => {}
            Existing::Refuse if holds_checkpoints(dir) => {
                return Err(Error::input(
                    format!("checkpoint folder {} (--checkpoint)", dir.display()),
                    "an empty folder, the run in it resumed (--resume; `Run::resume`, `Existing::Resume`), or its \
                     checkpoints replaced (--overwrite; `RunFolder::claim(dir, Existing::Overwrite)`)",
                    "a folder holding another run's checkpoints",
                ));
            }
            Existing::Refuse => {}
            Existing::Overwrite => {
                for name in ["best", "last", ".best.partial", ".last.partial"] {
                    let old = dir.join(name);
                    match old.symlink_metadata() {
                        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?,
                        Ok(_) => std::fs::remove_file(&old).map_err(|e| io(&old, e))?,
                        Err(_) => {}
                    }
                }
            }
        }
        let resolved = dir.canonicalize().map_err(|e| io(dir, e))?;
        if let Ok(mut held) = HELD.lock() {
            held.push(resolved.clone());
        }
        Ok(RunFolder { dir: dir.to_path_buf(), resolved, _lock: lock })
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

/// This machine's name, for naming a lock's holder.
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "this machine".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("arbor-run-folder-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        dir
    }

    #[test]
    fn a_second_claim_is_refused_naming_the_holder_until_the_first_ends() {
        let dir = scratch("twice");
        let first = RunFolder::claim(&dir, Existing::Refuse).unwrap();
        let err = RunFolder::claim(&dir, Existing::Resume).unwrap_err().to_string();
        assert!(err.contains(&format!("arbor pid {}", std::process::id())), "{err}");
        drop(first);
        RunFolder::claim(&dir, Existing::Refuse).unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn checkpoints_of_another_run_are_refused_kept_or_removed_as_asked() {
        let dir = scratch("existing");
        std::fs::create_dir_all(dir.join("best")).unwrap();
        std::fs::write(dir.join("best/meta.json"), "{}").unwrap();
        let err = RunFolder::claim(&dir, Existing::Refuse).unwrap_err().to_string();
        assert!(err.contains("another run's checkpoints") && err.contains("--overwrite"), "{err}");
        drop(RunFolder::claim(&dir, Existing::Resume).unwrap());
        assert!(dir.join("best/meta.json").is_file());
        drop(RunFolder::claim(&dir, Existing::Overwrite).unwrap());
        assert!(!holds_checkpoints(&dir));
        std::fs::write(dir.join("file"), "").unwrap();
        let err = RunFolder::claim(&dir.join("file"), Existing::Refuse).unwrap_err().to_string();
        assert!(err.contains("a file"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
