//! Cross-thread wake-ups: a remote ready queue plus an eventfd that the
//! reactor watches while it is parked.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Wakes a runtime from another thread.
pub(crate) struct Unparker {
    /// Id of the runtime this unparker belongs to.
    pub(crate) runtime_id: usize,
    /// Tasks woken from other threads, drained by the runtime each tick.
    remote: Mutex<Vec<u64>>,
    /// True while the reactor is (about to be) blocked: a remote wake must then write the eventfd.
    parked: AtomicBool,
    eventfd: OwnedFd,
}

impl Unparker {
    pub(crate) fn new(runtime_id: usize) -> std::io::Result<Self> {
        // SAFETY: eventfd has no memory arguments; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Unparker {
            runtime_id,
            remote: Mutex::new(Vec::new()),
            parked: AtomicBool::new(false),
            // SAFETY: fd is a fresh descriptor that nothing else owns.
            eventfd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.eventfd.as_raw_fd()
    }

    /// Queues task `id` from another thread and wakes the reactor if it sleeps.
    pub(crate) fn wake_remote(&self, id: u64) {
        self.remote
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(id);
        self.notify();
    }

    /// Wakes the reactor if it sleeps (or is about to).
    pub(crate) fn notify(&self) {
        if self.parked.swap(false, Ordering::SeqCst) {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
            let _ = unsafe { libc::write(self.fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Moves remotely woken task ids into `out`.
    pub(crate) fn drain_into(&self, out: &mut std::collections::VecDeque<u64>) {
        let mut q = self.remote.lock().unwrap_or_else(|e| e.into_inner());
        out.extend(q.drain(..));
    }

    /// Whether tasks were woken from other threads and not yet drained.
    pub(crate) fn has_remote(&self) -> bool {
        !self
            .remote
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Announces that the reactor is going to block. Returns false (and does
    /// not announce) when remote work is already queued, so the caller must not block.
    pub(crate) fn prepare_park(&self) -> bool {
        self.parked.store(true, Ordering::SeqCst);
        let empty = self
            .remote
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        if !empty {
            self.parked.store(false, Ordering::SeqCst);
        }
        empty
    }

    /// The reactor is awake again.
    pub(crate) fn unpark_done(&self) {
        self.parked.store(false, Ordering::SeqCst);
    }

    /// Consumes the eventfd's counter after it became readable.
    pub(crate) fn drain_eventfd(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking eventfd.
        let _ = unsafe { libc::read(self.fd(), (&mut v as *mut u64).cast(), 8) };
    }
}
