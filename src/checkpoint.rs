//! Checkpoints: named f32 tensors in a safetensors file plus a JSON metadata file that records
//! the tensors' checksum. Both are written to temporary files, synced and renamed into place, so
//! a crash leaves the previous checkpoint whole; loading verifies the checksum.

use arbor_core::error::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::io::Write;
use std::path::Path;

const TENSORS: &str = "model.safetensors";
const META: &str = "meta.json";

/// A named tensor: name, shape, values.
pub type Named = (String, Vec<usize>, Vec<f32>);

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

/// Writes `bytes` to `dir/name` through a synced temporary file and a rename.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, dir.join(name)).map_err(|e| io(&dir.join(name), e))
}

impl Checkpoint {
    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<&[f32]> {
        self.tensors.iter().find(|t| t.0 == name).map(|t| t.2.as_slice()).ok_or_else(|| Error::Input {
            what: "checkpoint".into(),
            expected: format!("a tensor named `{name}`"),
            got: "none".into(),
        })
    }

    /// Saves to `dir` (created if needed): tensors first, then the metadata naming their checksum.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let bytes: Vec<Vec<u8>> =
            self.tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
        let mut views = Vec::with_capacity(self.tensors.len());
        for ((name, shape, _), b) in self.tensors.iter().zip(&bytes) {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), b).map_err(|e| io(dir, e))?;
            views.push((name.clone(), view));
        }
        let data = safetensors::serialize(views, None).map_err(|e| io(dir, e))?;
        let mut meta = self.meta.clone();
        meta["tensors_checksum"] = Value::String(checksum(&data));
        write_atomic(dir, TENSORS, &data)?;
        write_atomic(dir, META, meta.to_string().as_bytes())
    }

    /// Loads from `dir`, refusing files whose checksum does not match.
    pub fn load(dir: &Path) -> Result<Checkpoint> {
        let meta_path = dir.join(META);
        let text = std::fs::read_to_string(&meta_path).map_err(|e| io(&meta_path, e))?;
        let meta: Value = serde_json::from_str(&text).map_err(|e| io(&meta_path, format!("not valid JSON: {e}")))?;
        let path = dir.join(TENSORS);
        let data = std::fs::read(&path).map_err(|e| io(&path, e))?;
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
            let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            tensors.push((name, view.shape().to_vec(), values));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Checkpoint { tensors, meta })
    }
}
