//! TCP sockets whose operations take owned buffers.

use std::io;
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};

use crate::buf::{BufResult, IoBuf, IoBufMut};
use crate::context;
use crate::driver::op::{Accept, Connect, Discard, PollAdd, Recv, Send, SendZc};
use crate::driver::shared_fd::SharedFd;
use crate::driver::socket::{
    current_is_epoll, recv_now, send_vectored_now, set_nonblocking, tcp_socket, view,
};
use crate::driver::Op;

/// A listening TCP socket.
pub struct TcpListener {
    fd: SharedFd,
    epoll: bool,
}

impl TcpListener {
    /// Binds and listens (synchronously) on the current runtime.
    ///
    /// # Panics
    /// Outside a runtime (the socket is set up for the runtime's driver).
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<TcpListener> {
        TcpListener::from_std(std::net::TcpListener::bind(addr)?)
    }

    /// Adopts a listening socket on the current runtime.
    ///
    /// # Panics
    /// Outside a runtime.
    pub fn from_std(inner: std::net::TcpListener) -> io::Result<TcpListener> {
        let epoll = current_is_epoll();
        set_nonblocking(&inner, epoll)?;
        Ok(TcpListener {
            fd: SharedFd::new(OwnedFd::from(inner), context::current()),
            epoll,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        view::<std::net::TcpListener>(&self.fd).local_addr()
    }

    /// Sets the congestion-control algorithm (`TCP_CONGESTION`) that the
    /// connections accepted from now on start with; see
    /// [`TcpStream::set_congestion`].
    pub fn set_congestion(&self, name: &str) -> io::Result<()> {
        crate::driver::socket::set_congestion(&self.fd.raw(), name)
    }

    /// The accept operation (cancellable through [`Op::canceller`]).
    pub fn accept_op(&self) -> Op<Accept> {
        Op::on(
            self.fd.context().clone(),
            Accept::new(self.fd.clone(), self.epoll),
        )
    }

    /// Accepts one connection (on the listener's runtime).
    pub async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        let (fd, addr) = self.accept_op().await?;
        let stream = TcpStream {
            fd: SharedFd::new(fd, self.fd.context().clone()),
        };
        Ok((stream, addr))
    }
}

impl AsRawFd for TcpListener {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.raw()
    }
}

/// A connected TCP socket.
///
/// Each operation holds the socket's shared fd, so the descriptor is closed
/// only when the stream and every op started on it are gone: an op dropped
/// early is parked in its runtime's driver until the kernel lets go of its
/// buffer, and the fd number cannot be reused meanwhile.
pub struct TcpStream {
    fd: SharedFd,
}

impl TcpStream {
    fn op<T: crate::driver::op::Operation>(&self, spec: T) -> Op<T> {
        Op::on(self.fd.context().clone(), spec)
    }

    /// Connects to `addr`.
    ///
    /// # Panics
    /// Outside a runtime.
    pub async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
        let fd = tcp_socket(&addr, current_is_epoll())?;
        let stream = TcpStream {
            fd: SharedFd::new(fd, context::current()),
        };
        stream.op(Connect::new(stream.fd.clone(), &addr)).await?;
        Ok(stream)
    }

    /// Adopts a connected socket on the current runtime.
    ///
    /// # Panics
    /// Outside a runtime.
    pub fn from_std(inner: std::net::TcpStream) -> io::Result<TcpStream> {
        set_nonblocking(&inner, current_is_epoll())?;
        Ok(TcpStream {
            fd: SharedFd::new(OwnedFd::from(inner), context::current()),
        })
    }

    /// Receives into `buf` (from its first byte); `Ok(0)` at EOF.
    ///
    /// The first `n` bytes become initialised; a `Vec`'s length is raised to
    /// `n` but never lowered, so reuse a `Vec` with `clear()` (or pass
    /// `buf.slice(..)` and look at the returned count).
    pub fn read<B: IoBufMut>(&self, buf: B) -> Op<Recv<B>> {
        self.op(Recv::new(self.fd.clone(), buf))
    }

    /// Receives what the socket holds now into `buf`, with one non-blocking
    /// `recv(2)` and without the driver: `WouldBlock` if it holds nothing,
    /// or if a receive operation on the socket exists (taking bytes ahead
    /// of it would split the stream). The kernel copies the bytes before
    /// this returns, so `buf` is only borrowed. `Ok(0)` at EOF.
    ///
    /// For a reader that polls while its runtime spins: nothing is armed in
    /// the kernel, so a peer's send wakes nobody.
    pub fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        if self.fd.recvs_pending() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        recv_now(&self.fd, buf)
    }

    /// [`read`](Self::read) of bytes most likely in the socket already (a
    /// payload right after its header): on io_uring it tries `recv(2)` at
    /// once and goes to the ring only if the socket is empty.
    pub fn read_expected<B: IoBufMut>(&self, buf: B) -> Op<Recv<B>> {
        self.op(Recv::expecting(self.fd.clone(), buf))
    }

    /// Drops up to `len` of the stream's next bytes without copying them
    /// (`recv(2)` with `MSG_TRUNC`); resolves to how many it dropped (at
    /// least one), `Ok(0)` at EOF. `expected`: the bytes are most likely in
    /// the socket already, so on io_uring it tries at once, as
    /// [`read_expected`](Self::read_expected) does.
    pub fn discard(&self, len: usize, expected: bool) -> Op<Discard> {
        self.op(Discard::new(self.fd.clone(), len, expected))
    }

    /// Sends the initialised bytes of `buf`; may send fewer.
    pub fn write<B: IoBuf>(&self, buf: B) -> Op<Send<B>> {
        self.op(Send::new(self.fd.clone(), buf))
    }

    /// Zero-copy send on io_uring (`SEND_ZC`): resolves only after the
    /// kernel's notification that it no longer references `buf`. A plain send on epoll.
    pub fn send_zc<B: IoBuf>(&self, buf: B) -> Op<SendZc<B>> {
        self.op(SendZc::new(self.fd.clone(), buf))
    }

    /// Sends what the socket takes of `bufs` now, with one non-blocking
    /// `sendmsg(2)` and without the driver — if no send operation on the
    /// socket is queued or in flight (`WouldBlock` otherwise: going first
    /// would reorder the stream). The kernel copies the bytes before this
    /// returns, so nothing holds them afterwards: they may be borrowed.
    /// Returns the bytes sent, possibly fewer than given (`WouldBlock` when
    /// the socket buffer is full). The caller orders its own sends: between
    /// a partial send and the rest, nothing else may go on the socket.
    pub fn try_send_vectored(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        if self.fd.sends_pending() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        send_vectored_now(&self.fd, bufs)
    }

    /// Sends all initialised bytes of `buf`.
    pub async fn write_all<B: IoBuf>(&self, buf: B) -> BufResult<(), B> {
        self.write_all_with(buf, false).await
    }

    /// Sends all initialised bytes of `buf` with `SEND_ZC` on io_uring.
    pub async fn write_all_zc<B: IoBuf>(&self, buf: B) -> BufResult<(), B> {
        self.write_all_with(buf, true).await
    }

    async fn write_all_with<B: IoBuf>(&self, mut buf: B, zc: bool) -> BufResult<(), B> {
        let len = buf.bytes_init();
        let mut off = 0;
        while off < len {
            let slice = buf.slice(off..len);
            let (res, slice) = if zc {
                self.send_zc(slice).await
            } else {
                self.write(slice).await
            };
            buf = slice.into_inner();
            match res {
                Ok(0) => return (Err(io::ErrorKind::WriteZero.into()), buf),
                Ok(n) => off += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return (Err(e), buf),
            }
        }
        (Ok(()), buf)
    }

    /// Fills `buf` up to `bytes_total()`; `UnexpectedEof` if the peer closes first.
    pub async fn read_exact<B: IoBufMut>(&self, buf: B) -> BufResult<(), B> {
        self.read_exact_with(buf, false).await
    }

    /// [`read_exact`](Self::read_exact) for bytes most likely in the socket
    /// already (a payload right after its header): on io_uring each receive
    /// first tries `recv(2)` at once instead of waiting for the next park.
    pub async fn read_exact_expected<B: IoBufMut>(&self, buf: B) -> BufResult<(), B> {
        self.read_exact_with(buf, true).await
    }

    async fn read_exact_with<B: IoBufMut>(&self, mut buf: B, expected: bool) -> BufResult<(), B> {
        let len = buf.bytes_total();
        let mut off = 0;
        while off < len {
            let slice = buf.slice(off..len);
            let op = if expected {
                Recv::expecting(self.fd.clone(), slice)
            } else {
                Recv::new(self.fd.clone(), slice)
            };
            let (res, slice) = self.op(op).await;
            buf = slice.into_inner();
            match res {
                Ok(0) => return (Err(io::ErrorKind::UnexpectedEof.into()), buf),
                Ok(n) => off += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return (Err(e), buf),
            }
        }
        (Ok(()), buf)
    }

    /// Waits until the socket is readable (`POLL_ADD`); returns the events.
    pub fn readable(&self) -> Op<PollAdd> {
        self.op(PollAdd::new(self.fd.clone(), libc::POLLIN as u32))
    }

    /// Waits until the socket is writable.
    pub fn writable(&self) -> Op<PollAdd> {
        self.op(PollAdd::new(self.fd.clone(), libc::POLLOUT as u32))
    }

    /// Sets `TCP_NODELAY`.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        view::<std::net::TcpStream>(&self.fd).set_nodelay(on)
    }

    /// Sets `TCP_USER_TIMEOUT`: once data sent on the stream stays
    /// unacknowledged (or unsent behind a zero window) for `limit`, the
    /// kernel drops the connection and its ops fail with `ETIMEDOUT` — a
    /// peer behind a partition is found out even with no deadline. `None`
    /// leaves it to the system's retransmission limits (many minutes).
    pub fn set_user_timeout(&self, limit: Option<std::time::Duration>) -> io::Result<()> {
        crate::driver::socket::set_user_timeout(&self.fd.raw(), limit)
    }

    /// Turns keep-alive probes on, bounded by the stall limit `limit` (see
    /// [`set_user_timeout`](Self::set_user_timeout), which should be set to
    /// the same): a peer that falls silent while nothing sent here is
    /// unacknowledged — a read waiting for its data — is found out within
    /// about `limit` too. `None` leaves them off.
    pub fn set_keepalive(&self, limit: Option<std::time::Duration>) -> io::Result<()> {
        crate::driver::socket::set_keepalive(&self.fd.raw(), limit)
    }

    /// Sets the kernel's congestion-control algorithm for this connection
    /// (`TCP_CONGESTION`: `cubic`, `reno`, `bbr`, … — one the kernel has,
    /// and for an unprivileged process one listed in
    /// `net.ipv4.tcp_allowed_congestion_control`). Without it the socket
    /// runs the system's default (`net.ipv4.tcp_congestion_control`).
    pub fn set_congestion(&self, name: &str) -> io::Result<()> {
        crate::driver::socket::set_congestion(&self.fd.raw(), name)
    }

    /// The congestion-control algorithm the kernel runs for this connection.
    pub fn congestion(&self) -> io::Result<String> {
        crate::driver::socket::congestion(&self.fd.raw())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        view::<std::net::TcpStream>(&self.fd).peer_addr()
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        view::<std::net::TcpStream>(&self.fd).local_addr()
    }

    /// Sets `SO_LINGER`: `Some(Duration::ZERO)` makes the close send an RST
    /// and drop unsent data at once (which also releases zero-copy pages).
    /// The close happens when the stream and the last op on it are gone.
    pub fn set_linger(&self, linger: Option<std::time::Duration>) -> io::Result<()> {
        crate::driver::socket::set_linger(&self.fd.raw(), linger)
    }

    /// Aborts the connection now, whoever else holds the socket: the kernel
    /// sends an RST and drops everything still queued in both directions
    /// (which also releases zero-copy pages); every op on it ends. Unlike a
    /// zero-linger close, this does not wait for the last op to let go.
    pub fn reset(&self) -> io::Result<()> {
        crate::driver::socket::reset(&self.fd.raw())
    }

    /// Shuts down one or both directions.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        view::<std::net::TcpStream>(&self.fd).shutdown(how)
    }

    /// Closes the socket. When no op holds it any more, through the driver
    /// (`IORING_OP_CLOSE`); otherwise the descriptor closes when the last op
    /// on it (parked, its cancel posted) has been reaped.
    pub async fn close(self) -> io::Result<()> {
        self.fd.close().await
    }
}

impl AsRawFd for TcpStream {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.raw()
    }
}

/// Sets `TCP_CONGESTION` on any TCP socket (a `std` stream, another
/// runtime's): see [`TcpStream::set_congestion`].
pub fn set_tcp_congestion(fd: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    crate::driver::socket::set_congestion(&fd, name)
}

/// The congestion-control algorithm the kernel runs for any TCP socket.
pub fn tcp_congestion(fd: BorrowedFd<'_>) -> io::Result<String> {
    crate::driver::socket::congestion(&fd)
}

/// Whether this process may run `name` as its TCP congestion control here:
/// sets it on a fresh, unconnected socket (an unknown name is `NotFound`,
/// one the process may not choose `PermissionDenied`).
pub fn check_tcp_congestion(name: &str) -> io::Result<()> {
    let probe = tcp_socket(&SocketAddr::from(([127, 0, 0, 1], 0)), false)?;
    crate::driver::socket::set_congestion(&probe, name)
}
