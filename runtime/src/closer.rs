//! Closing files off the calling thread.
//!
//! The last close of some files blocks whoever makes it: a TCP socket with
//! `SO_LINGER` waits out the linger time for bytes it cannot send, an
//! `AF_UNIX` socket closes the files still queued in it (which may be such
//! sockets), and a FUSE file waits for its daemon to answer the flush. A
//! reactor that closes a file another process could have shaped (a
//! doorbell, a file that came through one, or one it refused) hands it to
//! [`close_elsewhere`] instead. Each close gets a short-lived thread of its
//! own, so a close that never returns holds only that thread — not the
//! reactor, and not the closes queued behind it. At most [`MOST_CLOSERS`]
//! run at once; past that a file is left open (a leak, said once), which
//! only a peer that already wedged that many closes brings about. A forked
//! child of the process that first closed this way closes on the calling
//! thread (it runs no reactor that serves peers).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::fork::Lineage;

/// Closer threads alive at most at once.
pub(crate) const MOST_CLOSERS: usize = 16;

/// Closer threads alive now.
static CLOSERS: AtomicUsize = AtomicUsize::new(0);
/// The process the first close-elsewhere ran in.
static FIRST: OnceLock<Lineage> = OnceLock::new();
/// Whether a file was left open for want of a closer (said once).
static LEFT_OPEN: AtomicBool = AtomicBool::new(false);

/// Closes `fd` on a thread of its own (on this thread in a forked child,
/// or if no thread could start; not at all past [`MOST_CLOSERS`]).
pub(crate) fn close_elsewhere(fd: OwnedFd) {
    if FIRST.get_or_init(Lineage::here).forked() {
        return drop(fd);
    }
    if CLOSERS.fetch_add(1, Ordering::AcqRel) >= MOST_CLOSERS {
        CLOSERS.fetch_sub(1, Ordering::AcqRel);
        if !LEFT_OPEN.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                closers = MOST_CLOSERS,
                "every closer thread is held by a close that does not return: leaving files open"
            );
        }
        return std::mem::forget(fd);
    }
    // The fd travels as a number: a spawn that fails hands the closure
    // back dropped, and the file must still be closed, here.
    let raw = std::os::fd::IntoRawFd::into_raw_fd(fd);
    let spawned = std::thread::Builder::new()
        .name("quiesce-closer".into())
        .spawn(move || {
            // SAFETY: `raw` came from an OwnedFd given up above; this
            // thread is its only owner.
            drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) });
            CLOSERS.fetch_sub(1, Ordering::AcqRel);
        });
    if let Err(e) = spawned {
        CLOSERS.fetch_sub(1, Ordering::AcqRel);
        tracing::warn!(error = %e, "no closer thread: closing a shared file on this thread");
        // SAFETY: the spawn failed, so its closure (and the number) was
        // dropped unused: this thread owns `raw` again.
        drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    #[test]
    fn a_handed_over_file_is_closed() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        close_elsewhere(OwnedFd::from(a));
        // Its peer reads end-of-file once it is closed.
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut &b, &mut buf).unwrap(), 0);
    }

    /// A loopback TCP socket whose last close lingers `secs` over bytes
    /// it cannot send (its peer, returned, never reads).
    fn lingering(secs: u64) -> (std::net::TcpStream, std::net::TcpStream) {
        use std::io::Write;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (peer, _) = l.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        while s.write(&[7u8; 65536]).is_ok() {}
        crate::driver::socket::set_linger(&s, Some(Duration::from_secs(secs))).unwrap();
        (s, peer)
    }

    /// Closes that do not return hold neither the caller nor the closes
    /// after them: two files whose close lingers 60 s, then a plain one,
    /// which is closed at once. (A single thread for all closes would still be
    /// held by the first.)
    #[test]
    fn a_close_that_blocks_holds_only_its_own_thread() {
        let (s1, _p1) = lingering(60);
        let (s2, _p2) = lingering(60);
        let t0 = Instant::now();
        close_elsewhere(OwnedFd::from(s1));
        close_elsewhere(OwnedFd::from(s2));
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the caller waited on a close"
        );
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        close_elsewhere(OwnedFd::from(a));
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(
            std::io::Read::read(&mut &b, &mut buf).unwrap(),
            0,
            "a close queued behind one that blocks"
        );
    }

    /// A forked child has no closer threads of its parent's: what it hands
    /// over is closed at once, on its own thread.
    #[test]
    fn a_forked_child_closes_at_once() {
        let (x, _y) = std::os::unix::net::UnixStream::pair().unwrap();
        close_elsewhere(OwnedFd::from(x)); // the first close-elsewhere
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let a = OwnedFd::from(a);
        let raw = a.as_raw_fd();
        // SAFETY: the child makes system calls only (close, fcntl) and
        // leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            close_elsewhere(a);
            // SAFETY: F_GETFD on a number: -1 (EBADF) once it is closed.
            let closed = unsafe { libc::fcntl(raw, libc::F_GETFD) } == -1;
            // SAFETY: leaves the child without running the parent's atexit.
            unsafe { libc::_exit(if closed { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child's handed-over file stayed open: {status}"
        );
        drop(a);
    }
}
