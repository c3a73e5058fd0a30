//! Checkpoints: named f32 tensors in a safetensors file plus a JSON metadata file that names the
//! tensor file and records its checksum. The tensor file is named by its checksum, and each file
//! is written to a temporary file, synced and renamed into place; the metadata's rename commits
//! the checkpoint, and older tensor files are removed only after it. A crash at any point leaves
//! the previous checkpoint whole. Loading verifies the checksum, and reads the metadata again
//! when a save committed in the meantime removed the tensor file it named.
//!
//! [`Persister`] writes checkpoints in the background (CheckFreq's two phases: the caller
//! snapshots the state in memory between steps, a thread persists the snapshot).

use arbor_core::error::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Duration;

const META: &str = "meta.json";
const TENSORS_PREFIX: &str = "model-";
const TENSORS_SUFFIX: &str = ".safetensors";
/// The metadata key of the checksum of the metadata itself (computed without this key).
const META_CHECKSUM: &str = "meta_checksum";

/// A named tensor: name, shape, values.
pub type Named = (String, Vec<usize>, Vec<f32>);

/// A named tensor whose values may be lent by the model that holds them.
pub type Lent<'a> = (String, Vec<usize>, std::borrow::Cow<'a, [f32]>);

/// `lent` as owned tensors.
pub fn owned(lent: Vec<Lent<'_>>) -> Vec<Named> {
    lent.into_iter().map(|(name, shape, values)| (name, shape, values.into_owned())).collect()
}

/// Everything a checkpoint holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// The tensors.
    pub tensors: Vec<Named>,
    /// Free-form metadata (model, sizes, vocabulary, step, optimizer settings, RNG state, …).
    pub meta: Value,
}

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io { path: path.display().to_string(), msg: e.to_string() }
}

/// FNV-1a over the bytes, as 16 hex digits.
fn checksum(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{h:016x}")
}

/// Writes `bytes` to `dir/name` through a synced temporary file, a rename and a synced folder.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, dir.join(name)).map_err(|e| io(&dir.join(name), e))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io(dir, e))
}

/// The metadata of the checkpoint in `dir` and the path of the tensor file it names (a plain
/// file name in `dir`, nothing else).
fn read_meta(dir: &Path) -> Result<(Value, PathBuf)> {
    let meta_path = dir.join(META);
    let text = std::fs::read_to_string(&meta_path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound if dir.is_dir() => io(
            dir,
            format!("no checkpoint here: neither `best/` nor `last/` of a run folder, nor a checkpoint's {META}"),
        ),
        _ => io(&meta_path, e),
    })?;
    let mut meta: Value = serde_json::from_str(&text).map_err(|e| io(&meta_path, format!("not valid JSON: {e}")))?;
    let want = meta.as_object_mut().and_then(|m| m.remove(META_CHECKSUM));
    let found = checksum(meta.to_string().as_bytes());
    if want.is_none() {
        return Err(io(&meta_path, "has no `meta_checksum` (written by an older arbor, or edited)"));
    }
    if want.as_ref().and_then(Value::as_str) != Some(found.as_str()) {
        return Err(io(
            &meta_path,
            format!(
                "checksum mismatch (expected {}, found {found}): the file is corrupted",
                want.as_ref().and_then(Value::as_str).unwrap_or("none")
            ),
        ));
    }
    match meta["tensors_file"].as_str() {
        Some(f) if f.starts_with(TENSORS_PREFIX) && f.ends_with(TENSORS_SUFFIX) && !f.contains(['/', '\\']) => {
            let path = dir.join(f);
            Ok((meta, path))
        }
        _ => Err(io(&meta_path, "names no tensor file (`tensors_file`)")),
    }
}

impl Checkpoint {
    /// The metadata of the checkpoint in `dir`, checked against its checksum, without reading
    /// its tensors.
    pub fn meta(dir: &Path) -> Result<Value> {
        read_meta(dir).map(|(meta, _)| meta)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<&[f32]> {
        self.tensors
            .iter()
            .find(|t| t.0 == name)
            .map(|t| t.2.as_slice())
            .ok_or_else(|| Error::input("checkpoint", format!("a tensor named `{name}`"), "none"))
    }

    /// The values of the tensor `name`, which must hold `len` values: an error names a missing
    /// tensor or one of another size.
    pub fn sized(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let values = self.tensor(name)?;
        if values.len() != len {
            return Err(Error::input(
                format!("checkpoint tensor `{name}`"),
                format!("{len} values"),
                values.len().to_string(),
            ));
        }
        Ok(values.to_vec())
    }

    /// Saves to `dir` (created if needed): tensors first, then the metadata that commits them.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_paced(dir, Duration::ZERO)
    }

    /// [`Checkpoint::save`], pausing `between` the tensor file and the metadata (crash tests
    /// use it to kill a process in the middle of a save).
    /// A first save, into a folder that does not exist yet, is built beside it and renamed into
    /// place, so the folder appears whole or not at all.
    pub fn save_paced(&self, dir: &Path, between: Duration) -> Result<()> {
        let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
            return self.write_into(dir, between);
        };
        if dir.is_dir() {
            return self.write_into(dir, between);
        }
        let partial = parent.join(format!(".{}.partial", name.to_string_lossy()));
        std::fs::remove_dir_all(&partial).ok();
        self.write_into(&partial, between)?;
        std::fs::rename(&partial, dir).map_err(|e| io(dir, e))
    }

    /// Writes the checkpoint into the folder `dir` (created if needed): tensors first, then the
    /// metadata that commits them; then removes what earlier saves left.
    fn write_into(&self, dir: &Path, between: Duration) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let bytes: Vec<Vec<u8>> =
            self.tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
        let mut views = Vec::with_capacity(self.tensors.len());
        for ((name, shape, _), b) in self.tensors.iter().zip(&bytes) {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), b).map_err(|e| io(dir, e))?;
            views.push((name.clone(), view));
        }
        let data = safetensors::serialize(views, None).map_err(|e| io(dir, e))?;
        let sum = checksum(&data);
        let file = format!("{TENSORS_PREFIX}{sum}{TENSORS_SUFFIX}");
        let mut meta = self.meta.clone();
        meta["tensors_checksum"] = Value::String(sum);
        meta["tensors_file"] = Value::String(file.clone());
        meta[META_CHECKSUM] = Value::String(checksum(meta.to_string().as_bytes()));
        write_atomic(dir, &file, &data)?;
        std::thread::sleep(between);
        write_atomic(dir, META, meta.to_string().as_bytes())?;
        // Committed: tensor files of earlier checkpoints, and temporary files of writes that a
        // crash cut short, are garbage now.
        let entries = std::fs::read_dir(dir).map_err(|e| io(dir, e))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let tensors = name.starts_with(TENSORS_PREFIX) && name.ends_with(TENSORS_SUFFIX) && name != file;
            if tensors || (name.starts_with(&format!(".{TENSORS_PREFIX}")) && name.ends_with(".tmp")) {
                std::fs::remove_file(entry.path()).map_err(|e| io(&entry.path(), e))?;
            }
        }
        Ok(())
    }

    /// The tensor file of the checkpoint in `dir`.
    pub fn tensors_path(dir: &Path) -> Result<PathBuf> {
        read_meta(dir).map(|(_, file)| file)
    }

    /// The checkpoint of `folder` whose weights training scored: its `best/` wherever it exists
    /// (readable or not: an unreadable one is an error when loaded, not a reason to read other
    /// weights), else its `last/` (no epoch ended with a finite dev score), else `folder` itself
    /// (a checkpoint folder).
    pub fn scored_dir(folder: &Path) -> PathBuf {
        let (best, last) = (folder.join("best"), folder.join("last"));
        if best.symlink_metadata().is_ok() {
            best
        } else if last.symlink_metadata().is_ok() {
            last
        } else {
            folder.to_path_buf()
        }
    }

    /// Loads from `dir`, refusing files whose checksum does not match and tensors holding a value
    /// that is not finite. A writer may commit a newer checkpoint (and remove the tensor file the metadata read
    /// first named) while this reads: the metadata is then read again, so a reader always gets
    /// one whole checkpoint.
    pub fn load(dir: &Path) -> Result<Checkpoint> {
        let (mut meta, mut path) = read_meta(dir)?;
        let mut tries = 0;
        let data = loop {
            match std::fs::read(&path) {
                Ok(data) => break data,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 100 => {
                    let (newer, newer_path) = read_meta(dir)?;
                    if newer_path == path {
                        return Err(io(&path, e));
                    }
                    (meta, path, tries) = (newer, newer_path, tries + 1);
                }
                Err(e) => return Err(io(&path, e)),
            }
        };
        let want = meta["tensors_checksum"].as_str().unwrap_or_default();
        if checksum(&data) != want {
            return Err(io(
                &path,
                format!("checksum mismatch (expected {want}, found {}): the file is corrupted", checksum(&data)),
            ));
        }
        let st = SafeTensors::deserialize(&data).map_err(|e| io(&path, e))?;
        let mut tensors = Vec::new();
        for (name, view) in st.tensors() {
            if view.dtype() != Dtype::F32 {
                return Err(io(&path, format!("tensor `{name}` is {:?}, not F32", view.dtype())));
            }
            let values: Vec<f32> =
                view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if !arbor_core::finite::all_finite(&values) {
                let v = values.iter().find(|v| !v.is_finite()).unwrap_or(&f32::NAN);
                return Err(io(&path, format!("tensor `{name}` holds {v}: a diverged model, not loaded")));
            }
            tensors.push((current_name(&name), view.shape().to_vec(), values));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Checkpoint { tensors, meta })
    }
}

/// A tensor's name as this version of arbor calls it: checkpoints written before one model
/// type named the one-layer classifier's output layer `classifier.*` (also inside optimizer
/// state and weight averages); it is the head, `head.*`.
fn current_name(name: &str) -> String {
    name.split('.').map(|part| if part == "classifier" { "head" } else { part }).collect::<Vec<_>>().join(".")
}

/// Persists checkpoints on a background thread, one at a time: [`Persister::persist`] waits for
/// the previous write, then hands the snapshot to a new thread and returns.
#[derive(Debug, Default)]
pub struct Persister {
    pending: Option<JoinHandle<Result<Duration>>>,
    pause: Duration,
    /// How long the last finished write took (its pauses left out).
    last: Duration,
}

impl Persister {
    /// A persister that pauses `pause` inside each save (see [`Checkpoint::save_paced`]).
    pub fn paced(pause: Duration) -> Persister {
        Persister { pending: None, pause, last: Duration::ZERO }
    }

    /// Starts writing `ck` to `dir` in the background, after the previous write has finished.
    pub fn persist(&mut self, ck: Checkpoint, dir: PathBuf) -> Result<()> {
        self.wait()?;
        let pause = self.pause;
        let handle = std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || {
                let start = std::time::Instant::now();
                ck.save_paced(&dir, pause)?;
                Ok(start.elapsed().saturating_sub(pause))
            })
            .map_err(|e| Error::Io { path: "checkpoint thread".into(), msg: e.to_string() })?;
        self.pending = Some(handle);
        Ok(())
    }

    /// Waits for the write in flight, if any, and returns its result.
    pub fn wait(&mut self) -> Result<()> {
        match self.pending.take() {
            None => Ok(()),
            Some(h) => {
                let took =
                    h.join().map_err(|_| Error::Io { path: "checkpoint thread".into(), msg: "panicked".into() })?;
                self.last = took?;
                Ok(())
            }
        }
    }

    /// How long the last finished write took in the background (zero before one has finished):
    /// time it shared the cores with training.
    pub fn last_write(&self) -> Duration {
        self.last
    }
}

impl Drop for Persister {
    /// Finishes the write in flight (a run that fails still leaves its last snapshot on disk).
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            eprintln!("arbor: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A background write's time is known once it has finished, its pause left out.
    #[test]
    fn a_persister_times_its_writes() {
        let dir = std::env::temp_dir().join(format!("arbor-persister-{}", std::process::id()));
        let mut p = Persister::paced(Duration::from_millis(200));
        assert_eq!(p.last_write(), Duration::ZERO);
        let ck = Checkpoint { tensors: vec![("w".into(), vec![2, 2], vec![1.0; 4])], meta: serde_json::json!({}) };
        p.persist(ck, dir.join("last")).unwrap();
        p.wait().unwrap();
        let took = p.last_write();
        std::fs::remove_dir_all(&dir).ok();
        assert!(took > Duration::ZERO && took < Duration::from_millis(150), "{took:?}");
    }
}
