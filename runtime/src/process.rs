//! Another process on this host: its memory, reached with cross-memory
//! attach (`process_vm_readv(2)` / `process_vm_writev(2)`), and whether it
//! has exited, through a pidfd.
//!
//! The pidfd pins the process's identity: a pid reused after the process
//! exited is never mistaken for it, and [`PeerProcess::exited`] turns true
//! once it is gone — after which it reads and writes no memory, this
//! process's included. Where `pidfd_open(2)` is missing (kernels before
//! 5.3, valgrind) the process is known by its pid and its start time
//! (`/proc/PID/stat`), which a reused pid does not share.
//!
//! The kernel checks every remote access (the caller needs ptrace access to
//! the process, `PTRACE_MODE_ATTACH_REALCREDS`; an unmapped address fails
//! with `EFAULT`), so a wrong remote address is an error, never undefined
//! behaviour here. The local side is an owned buffer ([`IoBuf`] /
//! [`IoBufMut`]), whose memory is valid for the call.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::buf::{IoBuf, IoBufMut};

/// A process of this host, held by a pidfd.
#[derive(Debug)]
pub struct PeerProcess {
    pid: u32,
    identity: Identity,
}

/// How the process is told apart from a later one with its pid.
#[derive(Debug)]
enum Identity {
    Pidfd(OwnedFd),
    /// Its start time, in clock ticks after boot.
    Started(u64),
}

/// The state and start time of process `pid`, from `/proc/PID/stat`.
fn stat(pid: u32) -> Option<(char, u64)> {
    // Bytes: the command is whatever the process named itself, UTF-8 or not.
    let raw = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&raw).map(|(_, state, started)| (state, started))
}

/// The command, state and start time in a `/proc/…/stat` line.
fn parse_stat(raw: &[u8]) -> Option<(&[u8], char, u64)> {
    // The command is in parentheses and may hold anything, ')' included.
    let open = raw.iter().position(|&b| b == b'(')?;
    let close = raw.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(raw.get(close + 2..)?).ok()?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // state is field 3 of the whole line, starttime field 22.
    Some((
        raw.get(open + 1..close)?,
        fields.first()?.chars().next()?,
        fields.get(19)?.parse().ok()?,
    ))
}

/// Waits up to `within` until every thread of process `pid` is stopped
/// (SIGSTOP). The kernel wakes one thread for a stop signal and that one
/// stops the rest, so kill(2) returns while others may still run code.
/// io_uring's kernel workers (`iou-*`) run none of the process's code and
/// are not waited for.
pub fn wait_stopped(pid: u32, within: Duration) -> io::Result<()> {
    let deadline = crate::time::deadline_in(within);
    loop {
        let (mut threads, mut running) = (0, Vec::new());
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            // A thread that ended since the listing has no stat.
            let Ok(raw) = std::fs::read(t?.path().join("stat")) else {
                continue;
            };
            match parse_stat(&raw) {
                Some((comm, _, _)) if comm.starts_with(b"iou-") => {}
                Some((_, state, _)) => {
                    threads += 1;
                    if !matches!(state, 'T' | 't') {
                        running.push(state);
                    }
                }
                None => continue,
            }
        }
        if threads > 0 && running.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("process {pid} did not stop: threads in states {running:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl PeerProcess {
    /// Opens process `pid` (`pidfd_open(2)`).
    pub fn open(pid: u32) -> io::Result<PeerProcess> {
        let raw = i32::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: pidfd_open takes a pid and flags, no memory, and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
        let identity = if fd >= 0 {
            // SAFETY: the syscall returned a new descriptor nothing else owns.
            Identity::Pidfd(unsafe { OwnedFd::from_raw_fd(fd as i32) })
        } else {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOSYS) {
                return Err(e);
            }
            match stat(pid) {
                Some((_, started)) => Identity::Started(started),
                None => return Err(io::Error::from_raw_os_error(libc::ESRCH)),
            }
        };
        Ok(PeerProcess { pid, identity })
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// True once the process has exited (its pidfd is readable; or it is
    /// gone, a zombie, or another process with its pid).
    pub fn exited(&self) -> bool {
        match &self.identity {
            Identity::Pidfd(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, a zero timeout.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP) != 0
            }
            Identity::Started(at) => match stat(self.pid) {
                Some((state, started)) => started != *at || matches!(state, 'Z' | 'X'),
                None => true,
            },
        }
    }

    /// A duplicate of the process's file descriptor `fd`
    /// (`pidfd_getfd(2)`: the same ptrace access as the copies). Only a
    /// process held by a pidfd can be asked: by pid alone, another process
    /// could have taken its place.
    pub fn take_fd(&self, fd: i32) -> io::Result<OwnedFd> {
        let Identity::Pidfd(pidfd) = &self.identity else {
            return Err(io::ErrorKind::Unsupported.into());
        };
        // SAFETY: pidfd_getfd takes a pidfd, a number and flags, no memory, and returns a new fd or -1.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the syscall returned a new descriptor nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(raw as i32) })
    }

    /// Copies `len` bytes at the process's address `remote` into the first
    /// bytes of `dst` (`len <= dst.bytes_total()`). Returns the bytes
    /// copied: fewer than `len` only with an error after a partial copy.
    pub fn read_into<B: IoBufMut>(
        &self,
        remote: u64,
        dst: &mut B,
        len: usize,
    ) -> (usize, io::Result<()>) {
        assert!(len <= dst.bytes_total(), "destination too small");
        let local = dst.stable_mut_ptr();
        // SAFETY: `dst`'s first `len` bytes are valid and writable while it is mutably borrowed.
        unsafe { self.copy(libc::process_vm_readv, local, remote, len) }
    }

    /// Copies the initialised bytes of `src` to the process's address
    /// `remote`. Returns the bytes copied, as [`read_into`](Self::read_into).
    pub fn write_from<B: IoBuf>(&self, remote: u64, src: &B) -> (usize, io::Result<()>) {
        let (local, len) = (src.stable_ptr().cast_mut(), src.bytes_init());
        // SAFETY: `src`'s initialised bytes are valid while it is borrowed, and the kernel only reads them.
        unsafe { self.copy(libc::process_vm_writev, local, remote, len) }
    }

    /// Runs `call` (`process_vm_readv` or `process_vm_writev`) until `len`
    /// bytes moved (the kernel may stop early at a page it cannot reach),
    /// an error, or no progress.
    ///
    /// # Safety
    /// `local` must be valid for `len` bytes for the whole call — writable
    /// when `call` writes it — and the remote side is the kernel's to check.
    unsafe fn copy(
        &self,
        call: VmCopy,
        local: *mut u8,
        remote: u64,
        len: usize,
    ) -> (usize, io::Result<()>) {
        let mut done = 0usize;
        while done < len {
            let local_iov = libc::iovec {
                iov_base: local.wrapping_add(done).cast(),
                iov_len: len - done,
            };
            let remote_iov = libc::iovec {
                iov_base: (remote as usize).wrapping_add(done) as *mut libc::c_void,
                iov_len: len - done,
            };
            // SAFETY: `local_iov` lies in the `len` bytes the caller vouches for; the kernel checks `remote_iov`.
            let n = unsafe { call(self.pid as i32, &local_iov, 1, &remote_iov, 1, 0) };
            match n {
                n if n > 0 => done += n as usize,
                0 => return (done, Err(io::Error::from_raw_os_error(libc::EFAULT))),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return (done, Err(e));
                    }
                }
            }
        }
        (done, Ok(()))
    }
}

/// `process_vm_readv(2)` and `process_vm_writev(2)` share this signature.
type VmCopy = unsafe extern "C" fn(
    libc::pid_t,
    *const libc::iovec,
    libc::c_ulong,
    *const libc::iovec,
    libc::c_ulong,
    libc::c_ulong,
) -> libc::ssize_t;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn copies_to_and_from_own_memory_and_refuses_bad_addresses() {
        let me = PeerProcess::open(std::process::id()).unwrap();
        assert!(!me.exited());
        let src = vec![7u8; 100_000];
        let mut dst = Vec::with_capacity(100_000);
        let (n, r) = me.read_into(src.as_ptr() as u64, &mut dst, src.len());
        assert_eq!((n, r.is_ok()), (100_000, true));
        // SAFETY: the copy wrote all 100,000 bytes.
        unsafe { dst.set_len(n) };
        assert_eq!(dst, src);
        let mut target = vec![0u8; 64];
        let at = target.as_mut_ptr() as u64;
        let (n, r) = me.write_from(at, &vec![9u8; 64]);
        assert_eq!((n, r.is_ok()), (64, true));
        assert!(
            std::hint::black_box(&target).iter().all(|&b| b == 9),
            "the write landed"
        );
        let (n, r) = me.read_into(8, &mut dst, 16);
        assert_eq!(n, 0);
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EFAULT));
    }

    /// A stopped process is seen stopped, within any limit; a running one
    /// times out.
    #[test]
    fn wait_stopped_waits_for_every_thread_to_stop() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pid = child.id();
        let running = wait_stopped(pid, Duration::from_millis(20));
        // SAFETY: kill(2) takes no pointers.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let stopped = wait_stopped(pid, Duration::from_secs(10));
        // However long a caller will wait (it panicked on the overflow of
        // now + Duration::MAX).
        let forever = std::panic::catch_unwind(|| wait_stopped(pid, Duration::MAX));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(running.unwrap_err().kind(), io::ErrorKind::TimedOut);
        stopped.unwrap();
        forever
            .expect("Duration::MAX is a wait, not a panic")
            .unwrap();
    }

    /// `comm` is whatever bytes the process set: not UTF-8 must not make
    /// a live process look gone.
    #[test]
    fn a_process_whose_name_is_not_utf8_still_has_a_stat() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "printf '\\377x' > /proc/self/comm; sleep 5"])
            .spawn()
            .unwrap();
        let named = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            std::fs::read(format!("/proc/{}/comm", child.id()))
                .is_ok_and(|c| c.starts_with(b"\xff"))
        });
        let seen = stat(child.id());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(named, "the child never renamed itself");
        assert!(seen.is_some_and(|(state, _)| state != 'Z'));
    }

    #[test]
    fn a_process_is_known_by_its_start_time_too() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let (_, started) = stat(child.id()).unwrap();
        let p = PeerProcess {
            pid: child.id(),
            identity: Identity::Started(started),
        };
        assert!(!p.exited());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(p.exited());
        let reused = PeerProcess {
            pid: std::process::id(),
            identity: Identity::Started(started.wrapping_add(1)),
        };
        assert!(reused.exited(), "another process with the pid is not it");
    }

    #[test]
    fn a_file_descriptor_is_taken_only_through_a_pidfd() {
        let me = PeerProcess::open(std::process::id()).unwrap();
        let (r, w) = {
            let mut fds = [0; 2];
            // SAFETY: `fds` has room for the two new descriptors.
            assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
            // SAFETY: pipe returned two new descriptors nothing else owns.
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
        };
        let w2 = me.take_fd(w.as_raw_fd()).unwrap();
        assert_ne!(w2.as_raw_fd(), w.as_raw_fd());
        drop(w);
        std::fs::File::from(w2).write_all(b"x").unwrap();
        let mut got = [0u8; 1];
        std::fs::File::from(r).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"x");
        let by_pid = PeerProcess {
            pid: std::process::id(),
            identity: Identity::Started(0),
        };
        assert!(by_pid.take_fd(0).is_err());
    }

    #[test]
    fn an_exited_process_is_seen_as_exited() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let p = PeerProcess::open(child.id()).unwrap();
        child.wait().unwrap();
        assert!(p.exited());
    }
}
