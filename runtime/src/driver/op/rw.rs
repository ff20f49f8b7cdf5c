//! `read(2)`/`pread(2)` and `write(2)`/`pwrite(2)` on any fd.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::{cvt, sealed, Operation};
use crate::buf::{BufResult, IoBuf, IoBufMut};
use crate::driver::shared_fd::SharedFd;
use crate::driver::Interest;

/// `None`: the fd's current position (io_uring's offset -1). An offset
/// past `i64::MAX` is negative to the kernel, which refuses it (`EINVAL`,
/// as `pread` does) — all but `u64::MAX`, which is -1, "the position":
/// that one becomes -2, refused the same way.
fn uring_offset(off: Option<u64>) -> u64 {
    match off {
        None => u64::MAX,
        Some(u64::MAX) => u64::MAX - 1,
        Some(off) => off,
    }
}

/// Reads into `buf` from its first byte, at `offset` or the fd's position.
pub struct ReadAt<B> {
    fd: SharedFd,
    buf: B,
    offset: Option<u64>,
    pollable: bool,
}

impl<B: IoBufMut> ReadAt<B> {
    pub(crate) fn new(fd: SharedFd, buf: B, offset: Option<u64>, pollable: bool) -> Self {
        ReadAt {
            fd,
            buf,
            offset,
            pollable,
        }
    }
}

impl<B> sealed::Sealed for ReadAt<B> {}

impl<B: IoBufMut> Operation for ReadAt<B> {
    type Output = BufResult<usize, B>;
    const MOVES_BYTES: bool = true;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let len = self.buf.bytes_total().min(u32::MAX as usize) as u32;
        opcode::Read::new(types::Fd(self.fd.raw()), self.buf.stable_mut_ptr(), len)
            .offset(uring_offset(self.offset))
            .build()
    }

    fn complete(mut self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        if let Ok(n) = res {
            // SAFETY: the kernel wrote the first `n` bytes.
            unsafe { self.buf.set_init(n as usize) };
        }
        (res.map(|n| n as usize), self.buf)
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        self.pollable.then_some((self.fd.raw(), Interest::Read))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        let len = self.buf.bytes_total().min(u32::MAX as usize);
        let ptr = self.buf.stable_mut_ptr().cast();
        // SAFETY: `ptr..ptr+len` is writable capacity of the owned buffer.
        cvt(unsafe {
            match self.offset {
                Some(off) => libc::pread(self.fd.raw(), ptr, len, off as libc::off_t),
                None => libc::read(self.fd.raw(), ptr, len),
            }
        })
    }
}

/// Writes the initialised bytes of `buf`, at `offset` or the fd's position.
pub struct WriteAt<B> {
    fd: SharedFd,
    buf: B,
    offset: Option<u64>,
    pollable: bool,
}

impl<B: IoBuf> WriteAt<B> {
    pub(crate) fn new(fd: SharedFd, buf: B, offset: Option<u64>, pollable: bool) -> Self {
        WriteAt {
            fd,
            buf,
            offset,
            pollable,
        }
    }
}

impl<B> sealed::Sealed for WriteAt<B> {}

impl<B: IoBuf> Operation for WriteAt<B> {
    type Output = BufResult<usize, B>;
    const MOVES_BYTES: bool = true;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let len = self.buf.bytes_init().min(u32::MAX as usize) as u32;
        opcode::Write::new(types::Fd(self.fd.raw()), self.buf.stable_ptr(), len)
            .offset(uring_offset(self.offset))
            .build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        (res.map(|n| n as usize), self.buf)
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        self.pollable.then_some((self.fd.raw(), Interest::Write))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        let len = self.buf.bytes_init().min(u32::MAX as usize);
        let ptr = self.buf.stable_ptr().cast();
        // SAFETY: the first `len` bytes of the owned buffer are initialised.
        cvt(unsafe {
            match self.offset {
                Some(off) => libc::pwrite(self.fd.raw(), ptr, len, off as libc::off_t),
                None => libc::write(self.fd.raw(), ptr, len),
            }
        })
    }
}
