//! What the workers of a run exchange besides gradients: a parted model's checkpoint, gathered
//! on worker 0, and small values one worker knows and every worker needs.

use crate::checkpoint::{Checkpoint, Named};
use crate::dist::Collective;
use arbor_core::error::{Error, Result};
use serde_json::Value;

/// `tensors` as bytes: per tensor its name, shape and values, little-endian.
fn encode(tensors: &[Named]) -> Vec<u8> {
    fn len(out: &mut Vec<u8>, n: usize) {
        out.extend((n as u64).to_le_bytes());
    }
    let mut out = Vec::new();
    len(&mut out, tensors.len());
    for (name, shape, values) in tensors {
        len(&mut out, name.len());
        out.extend(name.as_bytes());
        len(&mut out, shape.len());
        shape.iter().for_each(|&d| len(&mut out, d));
        len(&mut out, values.len());
        values.iter().for_each(|v| out.extend(v.to_le_bytes()));
    }
    out
}

/// Reads what [`encode`] wrote.
struct Reader<'a> {
    bytes: &'a [u8],
    from: usize,
}

impl Reader<'_> {
    fn bad(&self) -> Error {
        Error::Worker { rank: self.from, msg: "sent a malformed part of a checkpoint".into() }
    }

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if n > self.bytes.len() {
            return Err(self.bad());
        }
        let (piece, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(piece)
    }

    fn len(&mut self) -> Result<usize> {
        let b: [u8; 8] = self.take(8)?.try_into().map_err(|_| self.bad())?;
        usize::try_from(u64::from_le_bytes(b)).map_err(|_| self.bad())
    }

    fn tensors(mut self) -> Result<Vec<Named>> {
        let n = self.len()?;
        let mut out = Vec::new();
        for _ in 0..n {
            let chars = self.len()?;
            let name = String::from_utf8(self.take(chars)?.to_vec()).map_err(|_| self.bad())?;
            let dims = self.len()?;
            let shape = (0..dims).map(|_| self.len()).collect::<Result<Vec<_>>>()?;
            let count = self.len()?;
            let bytes = self.take(count.checked_mul(4).ok_or_else(|| self.bad())?)?;
            let values = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            out.push((name, shape, values));
        }
        Ok(out)
    }
}

/// The checkpoint of a parted model of `parts` parts on worker 0 (`None` elsewhere): worker 0's
/// `mine` with the tensors of workers `1..parts` after its own, in rank order (the workers
/// after them hold copies of those parts). Every worker calls it.
pub(crate) fn gather_parts(coll: &mut dyn Collective, parts: usize, mine: Checkpoint) -> Result<Option<Checkpoint>> {
    match coll.rank() {
        0 => {}
        r if r < parts => {
            coll.send(0, encode(&mine.tensors))?;
            return Ok(None);
        }
        _ => return Ok(None),
    }
    let mut ck = mine;
    for from in 1..parts {
        let bytes = coll.recv(from)?;
        ck.tensors.extend(Reader { bytes: &bytes, from }.tensors()?);
    }
    Ok(Some(ck))
}

/// Sends `value` (which worker `from` alone knows) to every other worker; every worker calls
/// it and gets what `from` holds.
pub(crate) fn share_from(coll: &mut dyn Collective, from: usize, value: Value) -> Result<Value> {
    if coll.rank() == from {
        let bytes = value.to_string().into_bytes();
        for to in (0..coll.size()).filter(|&r| r != from) {
            coll.send(to, bytes.clone())?;
        }
        return Ok(value);
    }
    let bytes = coll.recv(from)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::Worker { rank: from, msg: format!("sent a malformed message ({e})") })
}
