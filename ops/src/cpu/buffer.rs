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

    /// A buffer of `len` zeros, backed by 2 MB pages where it is large and the system offers
    /// them ([`huge_pages`]).
    pub(crate) fn zeros(len: usize) -> HostBuffer {
        let mut data = vec![0.0; len];
        huge_pages(&mut data);
        HostBuffer::new(data)
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

/// Bytes from which a buffer asks for 2 MB pages.
const HUGE_FROM: usize = 4 << 20;

/// Asks Linux to back `x` with 2 MB pages (transparent huge pages, where the system leaves them
/// to `madvise`, as many do): a minibatch's arena and a word-vector table are read and written a
/// row at a time anywhere in tens of MB, and with 4 KB pages nearly every such row costs a page
/// walk — two nested ones in a virtual machine. Takes effect for the pages not yet touched (a
/// fresh allocation's); only advice, so nothing changes where the system declines it.
fn huge_pages(x: &mut [f32]) {
    #[cfg(target_os = "linux")]
    if std::mem::size_of_val(x) >= HUGE_FROM {
        const PAGE: usize = 4096;
        let start = x.as_mut_ptr() as usize;
        let first = start.next_multiple_of(PAGE);
        let len = (start + std::mem::size_of_val(x) - first) / PAGE * PAGE;
        // SAFETY: the range is whole pages inside `x`'s allocation; advice reads and writes none
        // of its values (the result is ignored: declining it changes nothing).
        unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = x;
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The flags of the mapping holding `x`'s middle element, from `/proc/self/smaps`.
    fn mapping_flags(x: &[f32]) -> Option<String> {
        let at = x.as_ptr() as usize + std::mem::size_of_val(x) / 2;
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or_default();
            if let Some((a, b)) = first.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                    inside = (a..b).contains(&at);
                    continue;
                }
            }
            if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
                return Some(flags.trim().to_string());
            }
        }
        None
    }

    /// A large buffer holds zeros and its mapping is marked for 2 MB pages (`hg`), wherever the
    /// kernel has transparent huge pages at all.
    #[test]
    fn large_buffers_ask_for_huge_pages() {
        // Twice the size from which a buffer asks.
        let len = 2 * HUGE_FROM / std::mem::size_of::<f32>();
        let big = HostBuffer::zeros(len);
        assert!(big.len() == len && big.iter().all(|&x| x == 0.0));
        if std::fs::metadata("/sys/kernel/mm/transparent_hugepage/enabled").is_err() {
            return;
        }
        let flags = mapping_flags(&big).expect("the buffer's mapping in /proc/self/smaps");
        assert!(flags.split_whitespace().any(|f| f == "hg"), "flags {flags}");
    }
}
