//! Memory shared with another process of this host, and the doorbells
//! that wake it.
//!
//! [`SharedMemory`] is a sealed `memfd` mapped into this process; the
//! other process maps the same file, which it takes from this one with
//! [`PeerProcess::take_fd`](crate::process::PeerProcess::take_fd) (the fd
//! number travels in a message). The file is sealed against shrinking and
//! growing before it is shared, and [`SharedMemory::open`] refuses one that
//! is not: a peer that could truncate it would turn this process's next
//! access into `SIGBUS`.
//!
//! The other process writes the memory whenever it likes, so nothing here
//! hands out a reference to it: words are read and written as atomics
//! ([`SharedMemory::word`]), byte ranges are copied in and out
//! ([`SharedMemory::copy_into`], [`SharedMemory::copy_from`]). A peer that
//! races a copy changes which bytes are copied, never what is safe: every
//! bound is checked against the mapping, and bytes have no invalid values.
//!
//! [`Doorbell`] is an eventfd: one side rings it, the other's reactor
//! watches it (a [`CompletionSource`](crate::source::CompletionSource)'s
//! notification fd).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use crate::buf::{IoBuf, IoBufMut};

/// The seals a shared file must carry: its size is fixed.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// A `memfd` of fixed size, mapped shared into this process.
pub struct SharedMemory {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: plain memory reached only through atomics and bounds-checked copies; it may move to another thread with its fd.
unsafe impl Send for SharedMemory {}

impl SharedMemory {
    /// Creates `len` bytes of zeroed shared memory (`name` shows in
    /// `/proc/PID/maps`), sealed against any change of size.
    pub fn create(name: &str, len: usize) -> io::Result<SharedMemory> {
        if len == 0 || !len.is_multiple_of(8) {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        let name = std::ffi::CString::new(name).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: a NUL-terminated name and flags; returns a new fd or -1.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain syscalls on the fd we own.
        let sized = unsafe {
            libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) == 0
                && libc::fcntl(
                    fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    SIZE_SEALS | libc::F_SEAL_SEAL,
                ) == 0
        };
        if !sized {
            return Err(io::Error::last_os_error());
        }
        SharedMemory::map(fd, len)
    }

    /// Maps `fd`, a file another process shared, if it is sealed against
    /// changes of size and holds exactly `len` bytes.
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<SharedMemory> {
        let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        if len == 0 || !len.is_multiple_of(8) {
            return Err(invalid(
                "a shared memory size must be a positive multiple of 8",
            ));
        }
        // SAFETY: F_GET_SEALS takes no argument; -1 for a file that is no memfd.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SIZE_SEALS != SIZE_SEALS {
            return Err(invalid("the shared file is not sealed against resizing"));
        }
        // SAFETY: an all-zero stat is valid storage for fstat to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is valid for writes.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if st.st_size as u64 != len as u64 {
            return Err(invalid("the shared file has another size than announced"));
        }
        SharedMemory::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<SharedMemory> {
        // SAFETY: a new shared mapping of a file we hold; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(io::ErrorKind::Other)?;
        Ok(SharedMemory { ptr, len, fd })
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a mapping has at least 8 bytes.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The file, to share (its number goes to the other process).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The 8-byte word at `offset`.
    ///
    /// # Panics
    /// If `offset` is not a multiple of 8 inside the mapping.
    pub fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset.checked_add(8).is_some_and(|e| e <= self.len),
            "a shared word out of place"
        );
        // The other process reaches the word only atomically too (it runs
        // this code).
        // SAFETY: aligned (page-aligned mapping, offset a multiple of 8) and inside the mapping, which lives as long as `self`.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    /// Copies `len` bytes at `offset` into the first bytes of `dst`.
    ///
    /// # Panics
    /// If the range is outside the mapping or `dst` is smaller.
    pub fn copy_into<B: IoBufMut>(&self, offset: usize, dst: &mut B, len: usize) {
        self.check(offset, len);
        assert!(len <= dst.bytes_total(), "destination too small");
        // A peer writing the source meanwhile changes only which bytes arrive.
        // SAFETY: the source is inside the mapping (checked); `dst`'s first `len` bytes are writable while it is borrowed, and an owned buffer never overlaps the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.stable_mut_ptr(), len)
        };
    }

    /// Copies the initialised bytes of `src` to `offset`.
    ///
    /// # Panics
    /// If they do not fit inside the mapping there.
    pub fn copy_from<B: IoBuf>(&self, offset: usize, src: &B) {
        // SAFETY: `src`'s initialised bytes are readable while it is borrowed.
        unsafe { self.write_raw(offset, src.stable_ptr(), src.bytes_init()) };
    }

    /// Copies `src` to `offset`.
    ///
    /// # Panics
    /// If it does not fit inside the mapping there.
    pub fn copy_from_slice(&self, offset: usize, src: &[u8]) {
        // SAFETY: a live slice is readable for its length.
        unsafe { self.write_raw(offset, src.as_ptr(), src.len()) };
    }

    /// Copies `len` bytes from `src` to `offset`.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes during the call.
    unsafe fn write_raw(&self, offset: usize, src: *const u8, len: usize) {
        self.check(offset, len);
        // No reference into the mapping is ever handed out, so `src` (the caller's) cannot overlap it.
        // SAFETY: the destination is inside the mapping (checked); the caller vouches for `src`.
        unsafe { std::ptr::copy_nonoverlapping(src, self.ptr.as_ptr().add(offset), len) };
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "a shared range out of bounds"
        );
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; nothing borrows it any more (`word` borrows `self`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("fd", &self.fd.as_raw_fd())
            .field("len", &self.len)
            .finish()
    }
}

/// An eventfd that one process rings and another's reactor watches.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    /// A new, quiet doorbell (non-blocking).
    pub fn new() -> io::Result<Doorbell> {
        // SAFETY: plain syscall; returns a new fd or -1.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: eventfd returned a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Doorbell { fd })
    }

    /// Takes `fd`, another process's doorbell, if it is a non-blocking
    /// eventfd that is not a semaphore (one that counts down by one per
    /// read would never quiet: its reactor would never sleep).
    ///
    /// The other process shares the open file, so it can clear
    /// `O_NONBLOCK` later: [`quiet`](Self::quiet) does not rely on the
    /// flag. [`ring`](Self::ring) does (eventfds refuse `RWF_NOWAIT`
    /// writes): a peer that clears the flag *and* fills the counter to its
    /// maximum can block the ringing thread (DESIGN.md §16.5).
    pub fn open(fd: OwnedFd) -> io::Result<Doorbell> {
        let refuse = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_string());
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        // SAFETY: F_GETFL takes no argument.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        if link.as_os_str() != "anon_inode:[eventfd]" || flags < 0 || flags & libc::O_NONBLOCK == 0
        {
            return Err(refuse("a doorbell must be a non-blocking eventfd"));
        }
        // Kernels since 6.2 say; older ones cannot be asked, and are trusted.
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))?;
        if info
            .lines()
            .any(|l| l.split_whitespace().eq(["eventfd-semaphore:", "1"]))
        {
            return Err(refuse("a doorbell must not be a semaphore eventfd"));
        }
        Ok(Doorbell { fd })
    }

    /// Rings it: the watching reactor wakes.
    pub fn ring(&self) {
        let one = 1u64;
        // It fails only if the counter is saturated, when the bell is ringing anyway.
        // SAFETY: writes 8 bytes from a live u64.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Quiets it (after it rang). Never blocks, whatever the file's flags
    /// (`RWF_NOWAIT`: `EAGAIN` when quiet).
    pub fn quiet(&self) {
        let mut n = 0u64;
        let iov = libc::iovec {
            iov_base: (&mut n as *mut u64).cast(),
            iov_len: 8,
        };
        // SAFETY: one iovec over a live u64; offset -1 is the (unused)
        // file position; the kernel writes at most 8 bytes there.
        let r = unsafe { libc::preadv2(self.fd.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
        let refused = || {
            let e = io::Error::last_os_error().raw_os_error();
            e == Some(libc::EOPNOTSUPP) || e == Some(libc::EINVAL)
        };
        if r < 0 && refused() {
            // Kernels before 5.12 take no RWF_NOWAIT read of an eventfd:
            // a plain read, non-blocking as the file was when checked.
            // SAFETY: reads at most 8 bytes into a live u64; EAGAIN when quiet.
            let _ = unsafe { libc::read(self.fd.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
        }
    }

    /// Its fd: the one to watch, or to share.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn dup(fd: RawFd) -> OwnedFd {
        // SAFETY: duplicates a live fd; returns a new one nothing else owns.
        unsafe { OwnedFd::from_raw_fd(libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0)) }
    }

    #[test]
    fn two_mappings_of_one_file_see_each_other() {
        let a = SharedMemory::create("test", 4096).unwrap();
        let b = SharedMemory::open(dup(a.fd()), 4096).unwrap();
        a.word(8).store(42, Ordering::Release);
        assert_eq!(b.word(8).load(Ordering::Acquire), 42);
        a.copy_from_slice(100, b"hello");
        let mut out = vec![0u8; 5];
        b.copy_into(100, &mut out, 5);
        assert_eq!(&out, b"hello");
    }

    #[test]
    fn a_file_that_could_be_resized_or_has_another_size_is_refused() {
        let a = SharedMemory::create("test", 4096).unwrap();
        assert!(SharedMemory::open(dup(a.fd()), 8192).is_err());
        // SAFETY: a NUL-terminated name; returns a new fd or -1.
        let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: memfd_create returned a new descriptor.
        let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a plain syscall on that fd.
        assert_eq!(unsafe { libc::ftruncate(unsealed.as_raw_fd(), 4096) }, 0);
        let e = SharedMemory::open(unsealed, 4096).unwrap_err();
        assert!(e.to_string().contains("sealed"), "{e}");
        // The seals hold: the file cannot shrink under a mapping.
        // SAFETY: a plain syscall on a live fd.
        assert_ne!(unsafe { libc::ftruncate(a.fd(), 0) }, 0);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn a_copy_past_the_end_panics_rather_than_reach_outside() {
        let a = SharedMemory::create("test", 4096).unwrap();
        a.copy_from(4090, &vec![1u8; 8]);
    }

    #[test]
    fn a_doorbell_is_only_an_eventfd() {
        let bell = Doorbell::new().unwrap();
        let same = Doorbell::open(dup(bell.fd())).unwrap();
        same.ring();
        bell.quiet();
        let mem = SharedMemory::create("test", 4096).unwrap();
        assert!(Doorbell::open(dup(mem.fd())).is_err());
    }

    #[test]
    fn a_semaphore_eventfd_is_no_doorbell() {
        // SAFETY: plain syscall; returns a new fd or -1.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_SEMAPHORE) };
        assert!(raw >= 0);
        // SAFETY: eventfd returned a new descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let Err(e) = Doorbell::open(fd) else {
            panic!("took a semaphore eventfd")
        };
        assert!(e.to_string().contains("semaphore"), "{e}");
    }

    /// The peer shares the open file and can make it blocking after the
    /// check: quieting a quiet doorbell must still return.
    #[test]
    fn quieting_a_doorbell_the_peer_made_blocking_returns() {
        let peer = Doorbell::new().unwrap();
        let mine = Doorbell::open(dup(peer.fd())).unwrap();
        // SAFETY: a plain syscall on a live fd: clears O_NONBLOCK.
        assert_eq!(unsafe { libc::fcntl(peer.fd(), libc::F_SETFL, 0) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            mine.quiet();
            tx.send(()).unwrap();
        });
        let returned = rx.recv_timeout(std::time::Duration::from_secs(2)).is_ok();
        // Unblock a stuck read either way, so the test process can end.
        peer.ring();
        assert!(
            returned,
            "quiet blocked on a doorbell the peer made blocking"
        );
    }
}
