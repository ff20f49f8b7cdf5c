//! Which of this process's addresses it may read and write: the check for
//! memory that bindings receive as bare addresses (Python's Mooncake API),
//! before the engine copies from them, receives into them or lends them.
//!
//! A GPU pointer is such an address: CUDA reserves device allocations in
//! the process's address space as inaccessible ranges. Copied from, it
//! killed the process; the check makes it a refusal. The kernel's table of
//! mappings (`/proc/self/maps`) says what is readable and writable;
//! [`HostRanges`] keeps the spans it found good, so that a program reusing
//! its buffers does not read the table at all, and one that does not reads
//! it once per call, however many mappings the call's buffers lie in.

use std::sync::Mutex;

/// One line of the kernel's table: `[lo, hi)` and what this process may
/// do with it.
#[derive(Clone, Copy)]
struct Mapping {
    lo: u64,
    hi: u64,
    r: bool,
    w: bool,
}

/// What a range is for: the source of a write (read from), or the
/// destination of a read (written into, and read back by the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryAccess {
    /// Readable.
    Read,
    /// Readable and writable.
    ReadWrite,
}

impl Mapping {
    fn allows(&self, access: MemoryAccess) -> bool {
        self.r && (access == MemoryAccess::Read || self.w)
    }
}

/// The kernel's table of this process's mappings, in address order; `None`
/// if it cannot be read.
fn table() -> Option<Vec<Mapping>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let parse = |line: &str| {
        let mut fields = line.split_ascii_whitespace();
        let (lo, hi) = fields.next()?.split_once('-')?;
        let perms = fields.next()?.as_bytes();
        let (r, w) = (perms.first() == Some(&b'r'), perms.get(1) == Some(&b'w'));
        let lo = u64::from_str_radix(lo, 16).ok()?;
        let hi = u64::from_str_radix(hi, 16).ok()?;
        Some(Mapping { lo, hi, r, w })
    };
    Some(maps.lines().filter_map(parse).collect())
}

/// The span of `[lo, hi)` mappings in `table`, each readable and writable
/// and each starting where the one before ends, that holds
/// `addr..addr + len`; `None` if a byte of it lies outside such mappings.
/// Without a table the range alone is taken on the caller's word (as before
/// the check existed).
fn span_in(
    table: Option<&[Mapping]>,
    addr: u64,
    len: u64,
    access: MemoryAccess,
) -> Option<(u64, u64)> {
    let end = addr.checked_add(len)?;
    let Some(table) = table else {
        return Some((addr, end));
    };
    // The first mapping that ends after `addr`; the table is sorted.
    let from = table.partition_point(|m| m.hi <= addr);
    let mut first = None;
    let mut at = addr;
    for m in &table[from..] {
        // A gap before `at`'s mapping, or one that does not allow `access`.
        if m.lo > at || !m.allows(access) {
            return None;
        }
        first.get_or_insert(m.lo);
        at = m.hi;
        if at >= end {
            return first.map(|lo| (lo, m.hi));
        }
    }
    None
}

/// [`span_in`] a fresh read of the table.
pub(super) fn span(addr: u64, len: u64) -> Option<(u64, u64)> {
    span_in(table().as_deref(), addr, len, MemoryAccess::ReadWrite)
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
    known: Mutex<Known>,
}

#[derive(Default)]
struct Known {
    /// Spans found good, and for what (one good for `ReadWrite` is good
    /// for `Read`).
    spans: Vec<(u64, u64, MemoryAccess)>,
    table_reads: u64,
}

impl HostRanges {
    /// A check that knows nothing yet.
    pub fn new() -> HostRanges {
        HostRanges::default()
    }

    /// The first of `ranges` (`(addr, len)`) that is not wholly memory this
    /// process may read and write, or `None` if each one is.
    pub fn first_bad(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> Option<(u64, u64)> {
        self.first_without(ranges, MemoryAccess::ReadWrite)
    }

    /// Runs `f` with this check's lock held (tests: a thread that forks
    /// while another is inside a check).
    #[cfg(test)]
    pub(crate) fn while_held<R>(&self, f: impl FnOnce() -> R) -> R {
        let _held = self.known.lock().unwrap_or_else(|e| e.into_inner());
        f()
    }

    /// The first of `ranges` that is not wholly memory this process may
    /// access as `access` says (a write's source need only be readable),
    /// or `None` if each one is.
    pub fn first_without(
        &self,
        ranges: impl IntoIterator<Item = (u64, u64)>,
        access: MemoryAccess,
    ) -> Option<(u64, u64)> {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        // Read once, when the first range not known yet needs it.
        let mut table: Option<Option<Vec<Mapping>>> = None;
        for (addr, len) in ranges {
            let Some(end) = addr.checked_add(len) else {
                return Some((addr, len));
            };
            let good = |a: MemoryAccess| a == access || a == MemoryAccess::ReadWrite;
            if known
                .spans
                .iter()
                .any(|&(lo, hi, a)| lo <= addr && end <= hi && good(a))
            {
                continue;
            }
            let table = table.get_or_insert_with(|| {
                known.table_reads += 1;
                self::table()
            });
            let Some((lo, hi)) = span_in(table.as_deref(), addr, len, access) else {
                return Some((addr, len));
            };
            if known.spans.len() == KEPT {
                known.spans.remove(0);
            }
            known.spans.push((lo, hi, access));
        }
        None
    }

    /// How many times this check has read the kernel's table of mappings:
    /// its cost, which tests and benchmarks count.
    pub fn table_reads(&self) -> u64 {
        self.known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .table_reads
    }
}
