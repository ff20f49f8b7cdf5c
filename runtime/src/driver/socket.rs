//! Socket and fd set-up syscalls that the backends need.

use std::io;
use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::op::cvt;
use super::shared_fd::SharedFd;
use super::Driver;
use crate::context;

/// A new TCP socket for `addr`'s family; non-blocking for epoll.
pub(crate) fn tcp_socket(addr: &SocketAddr, nonblocking: bool) -> io::Result<OwnedFd> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let ty =
        libc::SOCK_STREAM | libc::SOCK_CLOEXEC | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: socket takes no pointers; the result is checked.
    let fd = cvt(unsafe { libc::socket(domain, ty, 0) } as isize)? as RawFd;
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sets or clears `O_NONBLOCK`.
pub(crate) fn set_nonblocking(fd: &impl AsRawFd, on: bool) -> io::Result<()> {
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl F_GETFL/F_SETFL take no pointers.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) } as isize)? as i32;
    let new = if on {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    if new != flags {
        // SAFETY: as above.
        cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, new) } as isize)?;
    }
    Ok(())
}

/// True if epoll can watch `fd` (not a regular file or block device).
pub(crate) fn is_pollable(fd: &impl AsRawFd) -> io::Result<bool> {
    // SAFETY: stat is plain old data; all-zero is valid, and fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable stat buffer.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } as isize)?;
    let fmt = st.st_mode & libc::S_IFMT;
    Ok(fmt != libc::S_IFREG && fmt != libc::S_IFBLK && fmt != libc::S_IFDIR)
}

/// One non-blocking `sendmsg(2)` of `bufs` on `fd`, with no `SIGPIPE`: the
/// kernel has copied whatever it reports sent before this returns.
pub(crate) fn send_vectored_now(fd: &SharedFd, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: msghdr is plain old data; all-zero is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: `msg` names `bufs`, which live for the call (`IoSlice` is
    // ABI-compatible with `iovec` on Unix); the kernel only reads them.
    let n = cvt(unsafe { libc::sendmsg(fd.raw(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) })?;
    Ok(n as usize)
}

/// One non-blocking `recv(2)` into `buf` on `fd`: the kernel has copied
/// what it reports received before this returns.
pub(crate) fn recv_now(fd: &SharedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its whole length during the call.
    let n = unsafe { recv_dontwait(fd.raw(), buf.as_mut_ptr(), buf.len()) }?;
    Ok(n as usize)
}

/// One non-blocking `recv(2)` of at most `len` bytes to `ptr` on `fd`
/// (`TcpStream::try_read`, and a receive op's try before the ring).
///
/// # Safety
/// `ptr..ptr + len` must be writable (initialised or not) for the call;
/// the kernel writes at most `len` bytes there.
pub(crate) unsafe fn recv_dontwait(fd: RawFd, ptr: *mut u8, len: usize) -> io::Result<u32> {
    // SAFETY: the caller's promise above.
    cvt(unsafe { libc::recv(fd, ptr.cast(), len, libc::MSG_DONTWAIT) })
}

/// True if the current runtime uses epoll.
pub(crate) fn current_is_epoll() -> bool {
    context::with(|cx| matches!(*cx.driver.borrow(), Driver::Poll(_)))
}

/// `std`'s socket type over a shared fd without owning it, for its getters
/// and setters. Use it within one expression, while `fd` lives.
pub(crate) fn view<T: FromRawFd>(fd: &SharedFd) -> ManuallyDrop<T> {
    // SAFETY: the descriptor is open while `fd` lives, which the caller's borrow
    // guarantees for the view's use; ManuallyDrop keeps the view from closing it.
    ManuallyDrop::new(unsafe { T::from_raw_fd(fd.raw()) })
}

/// The calling thread's affinity.
fn affinity() -> io::Result<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is plain old data; all-zero is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is live and its size is passed; 0 means the calling thread.
    cvt(
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
            as isize,
    )?;
    Ok(set)
}

/// Sets the calling thread's affinity to `set` (the kernel moves the
/// thread before the call returns if its core is not in it).
fn set_affinity(set: &libc::cpu_set_t) -> io::Result<()> {
    // SAFETY: `set` is live and its size is passed; 0 means the calling thread.
    cvt(
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) } as isize,
    )?;
    Ok(())
}

/// The cores this process may run on, in order.
pub(crate) fn allowed_cores() -> io::Result<Vec<usize>> {
    let set = affinity()?;
    // SAFETY: CPU_ISSET reads the live set; the index is below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Pins the calling thread to `core`.
pub(crate) fn pin_to_core(core: usize) -> io::Result<()> {
    if core >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("core {core} is past the CPU set ({})", libc::CPU_SETSIZE),
        ));
    }
    // SAFETY: cpu_set_t is plain old data; all-zero is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET writes into the live set; `core` is below CPU_SETSIZE (checked above).
    unsafe { libc::CPU_SET(core, &mut set) };
    set_affinity(&set)
}

/// Sets `SO_LINGER` on a socket; a time past an `int` of seconds is the
/// longest one (cut to its low bits it could be 0, a reset).
pub(crate) fn set_linger(fd: &impl AsRawFd, linger: Option<std::time::Duration>) -> io::Result<()> {
    let secs = |d: std::time::Duration| d.as_secs().min(libc::c_int::MAX as u64) as libc::c_int;
    let l = libc::linger {
        l_onoff: linger.is_some() as libc::c_int,
        l_linger: linger.map_or(0, secs),
    };
    // SAFETY: `l` is a live linger struct and its size is passed.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    } as isize)?;
    Ok(())
}

/// Turns keep-alive probes on for a connection whose stall limit is
/// `limit` (`TCP_USER_TIMEOUT`): the first after `limit / 2` of silence,
/// then every `limit / 6` (at least a second each). With the user timeout
/// set, the kernel drops the connection once nothing was received for
/// `limit` and a probe went unanswered — a peer that fell silent while
/// this side had nothing unacknowledged is found out too. `None` or zero
/// leaves keep-alive off.
pub(crate) fn set_keepalive(
    fd: &impl AsRawFd,
    limit: Option<std::time::Duration>,
) -> io::Result<()> {
    let Some(limit) = limit.filter(|d| !d.is_zero()) else {
        return Ok(());
    };
    // (The kernel takes 1..=32767 s for each.)
    let secs = |d: std::time::Duration| d.as_secs().clamp(1, 32_767) as libc::c_int;
    let opts = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(limit / 2)),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, secs(limit / 6)),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6),
    ];
    for (level, name, value) in opts {
        // SAFETY: `value` is a live c_int and its size is passed.
        cvt(unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        } as isize)?;
    }
    Ok(())
}

/// Sets `TCP_USER_TIMEOUT`: data sent and not acknowledged (or held back
/// by a zero window) for `limit` makes the kernel drop the connection with
/// `ETIMEDOUT`; `None` or zero restores the system's retransmission limits.
/// The kernel takes an `int` of milliseconds: longer limits are clamped to
/// its largest (24.8 days), shorter ones to 1 ms.
pub(crate) fn set_user_timeout(
    fd: &impl AsRawFd,
    limit: Option<std::time::Duration>,
) -> io::Result<()> {
    let ms: libc::c_uint = match limit {
        Some(d) if !d.is_zero() => d.as_millis().clamp(1, i32::MAX as u128) as libc::c_uint,
        _ => 0,
    };
    // SAFETY: `ms` is a live c_uint and its size is passed.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            (&ms as *const libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    } as isize)?;
    Ok(())
}

/// Longest congestion-control name the kernel keeps (`TCP_CA_NAME_MAX`,
/// its NUL included).
const CA_NAME_MAX: usize = 16;

/// Sets `TCP_CONGESTION`: the congestion-control algorithm the kernel runs
/// for this TCP socket (`cubic`, `reno`, `bbr`, … — one the kernel has; an
/// unprivileged process only one listed in
/// `net.ipv4.tcp_allowed_congestion_control`). A listening socket passes it
/// on to the connections it accepts.
pub(crate) fn set_congestion(fd: &impl AsRawFd, name: &str) -> io::Result<()> {
    if name.is_empty() || name.len() >= CA_NAME_MAX || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a congestion-control name (1 to 15 bytes, no NUL)"),
        ));
    }
    // SAFETY: `name`'s bytes are live for the call and their length is
    // passed; the kernel copies them and needs no NUL.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        )
    } as isize)
    .map_err(|e| {
        let why = match e.raw_os_error() {
            Some(libc::ENOENT) => "this kernel has no such algorithm \
                                   (net.ipv4.tcp_available_congestion_control lists those it has)"
                .to_string(),
            Some(libc::EPERM) => "this process may not choose it \
                                  (net.ipv4.tcp_allowed_congestion_control lists those it may)"
                .to_string(),
            _ => e.to_string(),
        };
        io::Error::new(e.kind(), format!("TCP congestion control {name:?}: {why}"))
    })?;
    Ok(())
}

/// The congestion-control algorithm the kernel runs for this TCP socket.
pub(crate) fn congestion(fd: &impl AsRawFd) -> io::Result<String> {
    let mut name = [0u8; CA_NAME_MAX];
    let mut len = CA_NAME_MAX as libc::socklen_t;
    // SAFETY: `name` is a live buffer of `len` bytes, `len` a live socklen_t.
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_mut_ptr().cast(),
            &mut len,
        )
    } as isize)?;
    let name = &name[..(len as usize).min(CA_NAME_MAX)];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// Disconnects a TCP socket at once (`connect` to an `AF_UNSPEC` address:
/// the kernel's `tcp_disconnect`): an RST goes out and both queues are
/// dropped, whoever else holds the socket; every op on it ends.
pub(crate) fn reset(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: sockaddr is plain old data; all-zero with AF_UNSPEC is valid.
    let mut addr: libc::sockaddr = unsafe { std::mem::zeroed() };
    addr.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: `addr` is a live sockaddr and its size is passed.
    cvt(unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &addr,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    } as isize)?;
    Ok(())
}

/// Moves the calling thread off the core it runs on, to another of those
/// its affinity allows, and gives it its own affinity back (the kernel
/// does not move it back). `Ok(false)`: allowed on this core only.
pub(crate) fn move_off_current_core() -> io::Result<bool> {
    // SAFETY: sched_getcpu takes no arguments.
    let here = unsafe { libc::sched_getcpu() };
    let here = usize::try_from(here).map_err(|_| io::Error::last_os_error())?;
    let own = affinity()?;
    // SAFETY: CPU_COUNT and CPU_ISSET read the live set; `here` is a core
    // number the kernel gave, below CPU_SETSIZE.
    if unsafe { libc::CPU_COUNT(&own) } < 2 || !unsafe { libc::CPU_ISSET(here, &own) } {
        return Ok(false);
    }
    let mut elsewhere = own;
    // SAFETY: as above, on the live copy.
    unsafe { libc::CPU_CLR(here, &mut elsewhere) };
    set_affinity(&elsewhere)?;
    set_affinity(&own)?;
    Ok(true)
}
