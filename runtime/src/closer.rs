//! Closing files off the calling thread.
//!
//! The last close of some files blocks whoever makes it: a TCP socket with
//! `SO_LINGER` waits out the linger time for bytes it cannot send, and an
//! `AF_UNIX` socket closes the files still queued in it, which may be such
//! sockets. A reactor that closes a file another process could have shaped
//! (a doorbell, or a file that came through one) hands it to
//! [`close_elsewhere`] instead: one thread per process closes them, in
//! order. (In a forked child that thread does not exist, and what is handed
//! over stays open until the child exits: a leak, never a hang.)

use std::os::fd::OwnedFd;
use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

/// The closer thread's queue; `None` if the thread could not start.
static CLOSER: OnceLock<Option<Sender<OwnedFd>>> = OnceLock::new();

/// Closes `fd` on the closer thread, started on first use (on this thread
/// only if that thread could not start).
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
            .map(|_| tx)
    });
    match closer {
        Some(tx) => {
            if let Err(back) = tx.send(fd) {
                drop(back.0);
            }
        }
        None => drop(fd),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd};

    #[test]
    fn a_handed_over_file_is_closed_on_another_thread() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        // SAFETY: into_raw_fd gives up ownership of a live fd.
        let fd = unsafe { OwnedFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(a)) };
        let raw = fd.as_raw_fd();
        close_elsewhere(fd);
        // Its peer reads end-of-file once it is closed.
        b.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(
            std::io::Read::read(&mut &b, &mut buf).unwrap(),
            0,
            "fd {raw} still open"
        );
    }
}
