//! Which of this process's addresses it may read and write: the check for
//! memory that bindings receive as bare addresses (Python's Mooncake API),
//! before the engine copies from them, receives into them or lends them.
//!
//! A GPU pointer is such an address: CUDA reserves device allocations in
//! the process's address space as inaccessible ranges. Copied from, it
//! killed the process; the check makes it a refusal. The kernel's table of
//! mappings (`/proc/self/maps`) says what is readable and writable;
//! [`HostRanges`] keeps the spans it found good, so that a program reusing
//! its buffers reads the table once per mapping, not once per call.

use std::sync::Mutex;

/// The span of `[lo, hi)` mappings, each readable and writable and each
/// starting where the one before ends, that holds `addr..addr + len`;
/// `None` if a byte of it lies outside such mappings. If the table cannot
/// be read, the range alone is taken on the caller's word (as before the
/// check existed).
pub(super) fn span(addr: u64, len: u64) -> Option<(u64, u64)> {
    let end = addr.checked_add(len)?;
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Some((addr, end));
    };
    let mut first = None;
    let mut at = addr;
    // The table's lines run in address order.
    for line in maps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= at {
            continue;
        }
        // A gap before `at`'s mapping, or one this process may not read
        // and write.
        if lo > at || !perms.starts_with("rw") {
            return None;
        }
        first.get_or_insert(lo);
        at = hi;
        if at >= end {
            return first.map(|lo| (lo, hi));
        }
    }
    None
}

/// Most spans a [`HostRanges`] keeps (the oldest goes first).
const KEPT: usize = 64;

/// Spans of this process's memory found readable and writable.
///
/// A span stays known until it is pushed out: memory unmapped and mapped
/// again inaccessible at the same addresses is not noticed. A program
/// frees and reuses its transfer buffers' address ranges far less often
/// than it transfers, and the check is against passing device memory, not
/// a guard against every use-after-free.
#[derive(Default)]
pub struct HostRanges {
    known: Mutex<Vec<(u64, u64)>>,
}

impl HostRanges {
    /// A check that knows nothing yet.
    pub fn new() -> HostRanges {
        HostRanges::default()
    }

    /// The first of `ranges` (`(addr, len)`) that is not wholly memory this
    /// process may read and write, or `None` if each one is.
    pub fn first_bad(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> Option<(u64, u64)> {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        for (addr, len) in ranges {
            let Some(end) = addr.checked_add(len) else {
                return Some((addr, len));
            };
            if known.iter().any(|&(lo, hi)| lo <= addr && end <= hi) {
                continue;
            }
            let Some(found) = span(addr, len) else {
                return Some((addr, len));
            };
            if known.len() == KEPT {
                known.remove(0);
            }
            known.push(found);
        }
        None
    }
}
