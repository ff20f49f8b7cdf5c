//! Closing files off the calling thread.
//!
//! The last close of some files blocks whoever makes it: a TCP socket with
//! `SO_LINGER` waits out the linger time for bytes it cannot send, and an
//! `AF_UNIX` socket closes the files still queued in it, which may be such
//! sockets. A reactor that closes a file another process could have shaped
//! (a doorbell, or a file that came through one) hands it to
//! [`close_elsewhere`] instead: one thread per process closes them, in
//! order. A forked child of the process that started that thread has none
//! of it, and closes on the calling thread (its queue's lock may have been
//! held at the fork; a child runs no reactor that serves peers).

use std::os::fd::OwnedFd;
use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

use crate::fork::Lineage;

/// The closer thread's queue and the process it runs in; `None` if the
/// thread could not start.
static CLOSER: OnceLock<Option<(Sender<OwnedFd>, Lineage)>> = OnceLock::new();

/// Closes `fd` on the closer thread, started on first use (on this thread
/// if that thread could not start, or in a forked child).
pub(crate) fn close_elsewhere(fd: OwnedFd) {
    let closer = CLOSER.get_or_init(|| {
        let (tx, rx) = channel::<OwnedFd>();
        std::thread::Builder::new()
            .name("quiesce-closer".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .map_err(|e| {
                tracing::warn!(error = %e, "no closer thread: files shared with other processes close on the reactor")
            })
            .ok()
            .map(|_| (tx, Lineage::here()))
    });
    match closer {
        Some((tx, here)) if !here.forked() => {
            if let Err(back) = tx.send(fd) {
                drop(back.0);
            }
        }
        _ => drop(fd),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_handed_over_file_is_closed_on_another_thread() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        close_elsewhere(OwnedFd::from(a));
        // Its peer reads end-of-file once it is closed.
        b.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut &b, &mut buf).unwrap(), 0);
    }

    /// A forked child has no closer thread: what it hands over is closed
    /// at once, not queued for a thread that is not there.
    #[test]
    fn a_forked_child_closes_at_once() {
        let (x, _y) = std::os::unix::net::UnixStream::pair().unwrap();
        close_elsewhere(OwnedFd::from(x)); // the thread is started
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
