//! A timer armed in the kernel: `IORING_OP_TIMEOUT`, or a `timerfd` on epoll.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::time::Duration;

use io_uring::{opcode, types};

use super::{cvt, sealed, Operation};
use crate::context::Context;
use crate::driver::shared_fd::SharedFd;
use crate::driver::Interest;

/// Completes once `duration` has passed.
pub struct Timeout {
    duration: Duration,
    /// Read by the kernel: boxed so it does not move with the op.
    ts: Box<types::Timespec>,
    /// epoll: the armed timerfd, registered with the runtime's poller.
    timerfd: Option<SharedFd>,
    /// The op's runtime (whose poller watches the timerfd).
    cx: Rc<Context>,
}

impl Timeout {
    pub(crate) fn new(duration: Duration, cx: Rc<Context>) -> Self {
        let ts = types::Timespec::new()
            .sec(duration.as_secs())
            .nsec(duration.subsec_nanos());
        Timeout {
            duration,
            ts: Box::new(ts),
            timerfd: None,
            cx,
        }
    }

    fn arm_timerfd(&mut self) -> io::Result<()> {
        // SAFETY: timerfd_create takes no pointers; the result is checked.
        let fd = cvt(unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        } as isize)? as RawFd;
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // A zero it_value would disarm the timer: round up to 1 ns.
        let d = self.duration.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: d.as_secs() as _,
                tv_nsec: d.subsec_nanos() as _,
            },
        };
        // SAFETY: `spec` is live; the old value is not requested.
        cvt(
            unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) }
                as isize,
        )?;
        self.timerfd = Some(SharedFd::new(fd, self.cx.clone()));
        Ok(())
    }
}

impl sealed::Sealed for Timeout {}

impl Operation for Timeout {
    type Output = io::Result<()>;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        opcode::Timeout::new(&*self.ts).build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        match res {
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(()),
            r => r.map(drop),
        }
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        self.timerfd.as_ref().map(|fd| (fd.raw(), Interest::Read))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        if self.timerfd.is_none() {
            self.arm_timerfd()?;
        }
        let fd = self.timerfd.as_ref().map(SharedFd::raw).unwrap_or(-1);
        let mut expirations: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from a non-blocking timerfd.
        cvt(unsafe { libc::read(fd, (&mut expirations as *mut u64).cast(), 8) })
    }
}
