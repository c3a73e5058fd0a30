//! The CPU backend's buffers: host memory that changes only through the backend, so that the
//! backend knows when a copy it made from one (a transposed parameter) is stale.

use std::sync::atomic::{AtomicU64, Ordering};

/// Ids of buffers, never reused.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A buffer of the [`CpuBackend`](super::CpuBackend): `f32`s on the host, read through
/// `Deref`, changed only by the backend's calls. Each buffer has an id of its own and a version
/// that every call writing it moves on, which is what copies derived from it are keyed by.
#[derive(Debug)]
pub struct HostBuffer {
    id: u64,
    version: u64,
    data: Vec<f32>,
}

impl HostBuffer {
    /// A buffer holding `data`.
    pub fn new(data: Vec<f32>) -> HostBuffer {
        HostBuffer { id: NEXT_ID.fetch_add(1, Ordering::Relaxed), version: 0, data }
    }

    /// The values.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }

    /// The id and the version of the values now.
    pub(crate) fn stamp(&self) -> (u64, u64) {
        (self.id, self.version)
    }

    /// The values, to be changed: the version moves on.
    pub(crate) fn changing(&mut self) -> &mut Vec<f32> {
        self.version += 1;
        &mut self.data
    }

    /// The start of the values, for a call that reads them or changes them after
    /// [`HostBuffer::changing`] moved the version on.
    pub(crate) fn base(&mut self) -> *mut f32 {
        self.data.as_mut_ptr()
    }
}

impl From<Vec<f32>> for HostBuffer {
    fn from(data: Vec<f32>) -> HostBuffer {
        HostBuffer::new(data)
    }
}

impl Clone for HostBuffer {
    /// A buffer of its own holding the same values.
    fn clone(&self) -> HostBuffer {
        HostBuffer::new(self.data.clone())
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.data
    }
}

impl<'a> IntoIterator for &'a HostBuffer {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;

    fn into_iter(self) -> Self::IntoIter {
        self.data.iter()
    }
}
