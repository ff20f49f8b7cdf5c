//! Lending only host memory: what this process may read and write, named
//! by its first bad range, read from the mappings' table once per call.

use super::*;

/// An anonymous mapping of `len` bytes with protection `prot`.
fn map(len: usize, prot: libc::c_int) -> u64 {
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p as u64
}

/// `len` bytes of read-write memory with an inaccessible page after them,
/// so that whatever another test maps next to it, a range running past
/// the end is never host memory, and the mapping never merges with a
/// neighbour.
fn map_rw_guarded(len: usize) -> u64 {
    let at = map(len + 4096, libc::PROT_READ | libc::PROT_WRITE);
    // SAFETY: the last page of the mapping just made; nothing refers to it.
    let rc = unsafe { libc::mprotect((at + len as u64) as *mut _, 4096, libc::PROT_NONE) };
    assert_eq!(rc, 0);
    at
}

/// Lending is refused, with a typed error, for a range that is not memory
/// this process may read and write: a device's reserved addresses (a CUDA
/// pointer is `PROT_NONE` here), read-only memory, a range running past
/// its mapping. Registered, the first crashed the process at the first
/// transfer from it, and the target at the first write into it.
#[test]
fn only_host_memory_this_process_can_read_and_write_is_lent() {
    let e = engine();
    let token = Token::derive(b"a secret both sides hold", "node");
    let page = 4096u64;
    let none = map(LEN, libc::PROT_NONE);
    let ro = map(LEN, libc::PROT_READ);
    let rw = map_rw_guarded(LEN);
    for (addr, len) in [
        (none, LEN as u64),
        (ro, LEN as u64),
        (rw + page, LEN as u64),
    ] {
        // SAFETY: refused before anything is registered (asserted).
        let r = unsafe { e.lend("x", addr, len, token) };
        assert_eq!(r, Err(SyncError::NotHostMemory { addr, len }), "{addr:#x}");
    }
    // SAFETY: `rw` stays mapped (never unmapped) until the engine stops.
    unsafe { e.lend("rw", rw, LEN as u64, token).unwrap() };
    assert_eq!(e.reclaim(rw, Duration::from_secs(5)), Ok(true));
}

/// The check the Python binding makes of a call's local buffers: memory
/// this process may read and write passes (and is remembered, by its
/// mapping); a reserved range, a read-only one, one running past its
/// mapping or past the end of the address space is named.
#[test]
fn host_ranges_name_the_first_buffer_that_is_not_host_memory() {
    use quiesce_batch::sync::HostRanges;

    let none = map(LEN, libc::PROT_NONE);
    let ro = map(LEN, libc::PROT_READ);
    let rw = map_rw_guarded(LEN);
    let check = HostRanges::new();
    let len = LEN as u64;
    assert_eq!(check.first_bad([(rw, len), (rw + 4096, 4096)]), None);
    assert_eq!(
        check.first_bad([(rw, 4096), (none, 4096)]),
        Some((none, 4096))
    );
    assert_eq!(check.first_bad([(ro + 8, 16)]), Some((ro + 8, 16)));
    assert_eq!(check.first_bad([(rw, len + 4096)]), Some((rw, len + 4096)));
    assert_eq!(
        check.first_bad([(u64::MAX - 8, 16)]),
        Some((u64::MAX - 8, 16))
    );
    // Known by its mapping now: a buffer elsewhere in it passes too.
    assert_eq!(check.first_bad([(rw + len - 64, 64)]), None);
}

/// A call whose buffers lie in many mappings reads the kernel's table once,
/// not once per mapping: a process with a large table (a PyTorch worker's
/// runs to thousands of lines) passing one buffer per allocation would
/// otherwise read and parse it for every entry of the call.
#[test]
fn host_ranges_read_the_table_once_per_call() {
    use quiesce_batch::sync::HostRanges;

    // Each buffer its own mapping.
    let pages: Vec<u64> = (0..100).map(|_| map_rw_guarded(4096)).collect();
    let check = HostRanges::new();
    assert_eq!(check.first_bad(pages.iter().map(|&p| (p, 4096))), None);
    assert_eq!(check.table_reads(), 1, "one call, one read of the table");
    // More mappings than it keeps: the next call reads it once more at most.
    assert_eq!(check.first_bad(pages.iter().map(|&p| (p, 4096))), None);
    assert!(check.table_reads() <= 2, "{} reads", check.table_reads());
    // And a bad one among them is still named.
    let none = map(4096, libc::PROT_NONE);
    let with_bad = pages.iter().map(|&p| (p, 4096)).chain([(none, 16)]);
    assert_eq!(check.first_bad(with_bad), Some((none, 16)));
}
