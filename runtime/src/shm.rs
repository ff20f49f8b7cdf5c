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
//! [`Doorbell`] is one end of a connected `AF_UNIX` stream socket pair: one
//! side rings the other, whose reactor watches its end (a
//! [`CompletionSource`](crate::source::CompletionSource)'s notification
//! fd). The process that did not make the pair takes its end with
//! [`Doorbell::open`]; nothing here relies on the file's flags, which the
//! maker can still change.

use std::io;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use crate::closer::close_elsewhere;

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
    /// changes of size and holds exactly `len` bytes. A file refused is
    /// closed off this thread (`crate::closer`): the other process chose
    /// it, and the last close of some files blocks.
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<SharedMemory> {
        match SharedMemory::may_map(&fd, len) {
            Ok(()) => SharedMemory::map(fd, len),
            Err(e) => {
                close_elsewhere(fd);
                Err(e)
            }
        }
    }

    /// Whether `fd` may be mapped as `len` bytes of shared memory.
    fn may_map(fd: &OwnedFd, len: usize) -> io::Result<()> {
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
        Ok(())
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

/// The most one [`Doorbell::quiet`] drains.
pub const QUIET_MOST: usize = 1024;

/// One end of a doorbell between two processes: a connected `AF_UNIX`
/// stream socket. [`ring`](Self::ring) sends a byte to the other end,
/// which turns readable (its reactor watches [`fd`](Self::fd)) until
/// [`quiet`](Self::quiet) drains it.
///
/// The process that made the pair shares the other end by fd number, and
/// the other process takes it with `pidfd_getfd(2)` ([`Doorbell::open`]):
/// the maker still holds that open file and can change its flags, so no
/// call here relies on them — each send and receive says `MSG_DONTWAIT`
/// itself, and sends say `MSG_NOSIGNAL` (an end whose peer is gone answers
/// `EPIPE`, never a signal that would kill a host that did not ignore
/// `SIGPIPE`).
#[derive(Debug)]
pub struct Doorbell {
    /// Closed off the reactor when the doorbell drops (`Drop`).
    fd: ManuallyDrop<OwnedFd>,
}

impl Drop for Doorbell {
    /// Closes the end off this thread (`crate::closer`): its last close
    /// closes the files still queued in it, which the other process may
    /// have sent to block whoever closes them.
    fn drop(&mut self) {
        // SAFETY: `drop` runs once, and nothing uses `self.fd` after it.
        let fd = unsafe { ManuallyDrop::take(&mut self.fd) };
        close_elsewhere(fd);
    }
}

impl Doorbell {
    /// A new, quiet doorbell: this process's end, and the other end, for
    /// the other process to take.
    pub fn pair() -> io::Result<(Doorbell, OwnedFd)> {
        let mut fds = [0; 2];
        let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
        // SAFETY: writes two fds into a live array of two, or returns -1.
        if unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: socketpair returned two new descriptors nothing else owns.
        let (mine, theirs) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok((Doorbell::own(mine), theirs))
    }

    /// Takes `fd`, the end of a doorbell another process made, if it is a
    /// connected `AF_UNIX` stream socket (anything else could stay readable
    /// without ever draining, or not be a doorbell at all). A file refused
    /// is closed off this thread, as a doorbell is when it drops.
    pub fn open(fd: OwnedFd) -> io::Result<Doorbell> {
        let refuse = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "a doorbell must be a connected AF_UNIX stream socket",
            )
        };
        let opt = |name| {
            let mut v: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: writes at most `len` bytes into a live c_int.
            let r = unsafe {
                libc::getsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    name,
                    (&mut v as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            (r == 0).then_some(v)
        };
        // Connected: a socket that never was polls as hung up for ever.
        let connected = {
            // SAFETY: zeroed sockaddr_storage is a valid out-buffer.
            let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            // SAFETY: writes at most `len` bytes into a live sockaddr_storage.
            let r = unsafe {
                libc::getpeername(
                    fd.as_raw_fd(),
                    (&mut addr as *mut libc::sockaddr_storage).cast(),
                    &mut len,
                )
            };
            r == 0
        };
        let ok = opt(libc::SO_DOMAIN) == Some(libc::AF_UNIX)
            && opt(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
            && opt(libc::SO_ACCEPTCONN) == Some(0)
            && connected;
        if !ok {
            // Not this thread's to close: the other process chose the file.
            close_elsewhere(fd);
            return Err(refuse());
        }
        Ok(Doorbell::own(fd))
    }

    fn own(fd: OwnedFd) -> Doorbell {
        Doorbell {
            fd: ManuallyDrop::new(fd),
        }
    }

    /// Rings the other end: its reactor wakes. A full socket is ringing
    /// anyway, and one whose other end is gone has nobody to wake.
    pub fn ring(&self) {
        // SAFETY: sends one byte from a live array.
        let _ = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                [1u8].as_ptr().cast(),
                1,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
    }

    /// Quiets this end after it rang: drains what came, up to
    /// [`QUIET_MOST`] bytes (a ring is one byte; an end that sends more is
    /// left the rest for the next wake, so that it cannot hold the reactor).
    /// A one-shot watch fires again at once on the rest; an edge-triggered
    /// one does not, which loses nothing: a doorbell only wakes its owner,
    /// whose work is in the mailbox, looked at after every arm. `false` once the
    /// other end is gone — it will never ring again, and this end stays
    /// readable: stop watching it — or sent ancillary data, which no ring
    /// does: files (`SCM_RIGHTS`) are taken and closed off this thread
    /// (a receive without room for them would close them here, and the last
    /// close of some files blocks: a TCP socket lingering over bytes it
    /// cannot send), and the doorbell is done with.
    pub fn quiet(&self) -> bool {
        let mut buf = [0u8; 64];
        // Room for the most files one message carries (SCM_MAX_FD, 253),
        // after what else a socket option the maker can set adds (its
        // credentials, pidfd or security label): taken, not truncated.
        // Left uninitialised: the kernel writes it, and only what it wrote
        // (`msg_controllen`) is read — no 8 KiB to clear on every wake.
        let mut control = MaybeUninit::<[u64; 1024]>::uninit();
        for _ in 0..QUIET_MOST / buf.len() {
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            // SAFETY: a zeroed msghdr is a valid, empty one.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = std::mem::size_of::<[u64; 1024]>() as _;
            // SAFETY: receives at most 64 bytes and 8 KiB of ancillary data
            // into the live buffers `msg` points at.
            let n = unsafe {
                libc::recvmsg(
                    self.fd.as_raw_fd(),
                    &mut msg,
                    libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
                )
            };
            if n >= 0 && (msg.msg_controllen > 0 || msg.msg_flags & libc::MSG_CTRUNC != 0) {
                close_passed_files(&msg);
                return false;
            }
            match n {
                0 => return false,
                n if n == buf.len() as isize => continue,
                n if n > 0 => return true,
                _ => {
                    // Nothing more to drain, or a signal: still there. Any
                    // other error (a reset end) will not ring again.
                    let e = io::Error::last_os_error().raw_os_error();
                    return matches!(e, Some(libc::EAGAIN) | Some(libc::EINTR));
                }
            }
        }
        // More came than any ringing sends: the rest waits for the next wake.
        true
    }

    /// The fd to watch: readable while the doorbell rings.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// `SCM_PIDFD` (Linux 6.5): a pidfd of the sender, for a socket with
/// `SO_PASSPIDFD`.
const SCM_PIDFD: libc::c_int = 4;

/// Hands the files `msg` brought (`SCM_RIGHTS`, `SCM_PIDFD`), now this
/// process's, to closer threads.
fn close_passed_files(msg: &libc::msghdr) {
    // SAFETY: recvmsg filled `msg`'s control buffer with `msg_controllen` bytes of the kernel's well-formed headers, which CMSG_FIRSTHDR and CMSG_NXTHDR walk without leaving it; each data part holds `cmsg_len` minus its header's length in bytes.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            let files = matches!((*c).cmsg_type, libc::SCM_RIGHTS | SCM_PIDFD);
            if (*c).cmsg_level == libc::SOL_SOCKET && files {
                let data = libc::CMSG_DATA(c);
                let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    // SAFETY: the kernel installed `fd` in this process for
                    // this receive; nothing else owns it.
                    close_elsewhere(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
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
    fn a_doorbell_is_only_a_connected_unix_stream_socket() {
        let (mine, theirs) = Doorbell::pair().unwrap();
        let other = Doorbell::open(theirs).unwrap();
        let readable = |d: &Doorbell| {
            let mut fds = [libc::pollfd {
                fd: d.fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: one live pollfd; no wait.
            unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) == 1 }
        };
        for (ringer, watcher) in [(&mine, &other), (&other, &mine)] {
            ringer.ring();
            assert!(readable(watcher), "it did not ring");
            assert!(watcher.quiet());
            assert!(!readable(watcher), "it did not quiet");
        }
        let mem = SharedMemory::create("test", 4096).unwrap();
        assert!(Doorbell::open(dup(mem.fd())).is_err());
        let mut fds = [0; 2];
        // SAFETY: writes two fds into a live array, or returns -1.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: pipe2 returned two new descriptors.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        assert!(Doorbell::open(r).is_err() && Doorbell::open(w).is_err());
        // Its other end gone (closed on a closer thread, so soon after
        // the drop): quieting says so (and ringing raises nothing).
        drop(mine);
        let t0 = std::time::Instant::now();
        while !readable(&other) && t0.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        other.ring();
        assert!(!other.quiet());
    }

    /// The maker shares the other end's open file: it can fill the socket
    /// and make the file blocking. Ringing and quieting still return.
    #[test]
    fn a_doorbell_the_maker_jammed_neither_blocks_a_ring_nor_a_quiet() {
        let (mine, theirs) = Doorbell::pair().unwrap();
        let shared = theirs.as_raw_fd();
        let taken = Doorbell::open(dup(shared)).unwrap();
        // Both ways full, then blocking.
        for fd in [mine.fd(), shared] {
            // SAFETY: sends 4 KiB from a live array to a live fd, till refused.
            while unsafe { libc::send(fd, [0u8; 4096].as_ptr().cast(), 4096, libc::MSG_DONTWAIT) }
                > 0
            {}
            // SAFETY: a plain syscall on a live fd: clears O_NONBLOCK.
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFL, 0) }, 0);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            taken.ring();
            taken.quiet();
            taken.quiet();
            tx.send(()).unwrap();
        });
        let returned = rx.recv_timeout(std::time::Duration::from_secs(2)).is_ok();
        drop(theirs);
        assert!(returned, "a ring or a quiet blocked on a jammed doorbell");
    }

    /// One quiet drains a bounded amount, however much the other end sent:
    /// an end that keeps it full (sends faster than the drain's receives)
    /// must not hold the reactor that quiets it. The rest waits for the
    /// next wake, the doorbell still readable.
    #[test]
    fn a_quiet_drains_a_bounded_amount() {
        let (mine, theirs) = Doorbell::pair().unwrap();
        let theirs = Doorbell::open(theirs).unwrap();
        let mut sent = 0usize;
        // SAFETY: sends 4 KiB from a live array to a live fd, till refused.
        while unsafe {
            libc::send(
                theirs.fd(),
                [1u8; 4096].as_ptr().cast(),
                4096,
                libc::MSG_DONTWAIT,
            )
        } > 0
        {
            sent += 4096;
        }
        assert!(sent > QUIET_MOST, "{sent} bytes fill the socket");
        assert!(mine.quiet(), "the other end is there");
        let mut left = 0usize;
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: receives at most 4 KiB into a live array.
            let n = unsafe {
                libc::recv(
                    mine.fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                break;
            }
            left += n as usize;
        }
        assert!(
            sent - left <= QUIET_MOST,
            "one quiet drained {} of {sent} bytes",
            sent - left
        );
    }
}
