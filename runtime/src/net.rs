//! TCP sockets whose operations take owned buffers.

use std::io;
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::buf::{BufResult, IoBuf, IoBufMut};
use crate::driver::op::{Accept, BufPool, Close, Connect, PollAdd, Recv, RecvMulti, Send, SendZc};
use crate::driver::socket::{current_is_epoll, forget_fd, set_nonblocking, tcp_socket};
use crate::driver::Op;

/// A listening TCP socket.
pub struct TcpListener {
    inner: std::net::TcpListener,
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

    /// Adopts a listening socket.
    pub fn from_std(inner: std::net::TcpListener) -> io::Result<TcpListener> {
        let epoll = current_is_epoll();
        set_nonblocking(&inner, epoll)?;
        Ok(TcpListener { inner, epoll })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// The accept operation (cancellable through [`Op::canceller`]).
    pub fn accept_op(&self) -> Op<'_, Accept> {
        Op::new(Accept::new(self.inner.as_raw_fd(), self.epoll))
    }

    /// Accepts one connection.
    pub async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        let (fd, addr) = self.accept_op().await?;
        Ok((TcpStream::from_fd(fd, self.epoll), addr))
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        if self.epoll {
            forget_fd(self.inner.as_raw_fd());
        }
    }
}

impl AsRawFd for TcpListener {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_raw_fd()
    }
}

/// A connected TCP socket.
///
/// Every operation borrows the stream, so the fd outlives it; an operation
/// dropped early is parked in the driver until the kernel lets go of its buffer.
pub struct TcpStream {
    inner: Option<std::net::TcpStream>,
    epoll: bool,
}

impl TcpStream {
    fn from_fd(fd: OwnedFd, epoll: bool) -> TcpStream {
        TcpStream {
            inner: Some(std::net::TcpStream::from(fd)),
            epoll,
        }
    }

    fn std(&self) -> &std::net::TcpStream {
        self.inner.as_ref().expect("stream present until close")
    }

    fn fd(&self) -> RawFd {
        self.std().as_raw_fd()
    }

    /// Connects to `addr`.
    ///
    /// # Panics
    /// Outside a runtime.
    pub async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
        let epoll = current_is_epoll();
        let fd = tcp_socket(&addr, epoll)?;
        let stream = TcpStream::from_fd(fd, epoll);
        Op::new(Connect::new(stream.fd(), &addr)).await?;
        Ok(stream)
    }

    /// Adopts a connected socket.
    pub fn from_std(inner: std::net::TcpStream) -> io::Result<TcpStream> {
        let epoll = current_is_epoll();
        set_nonblocking(&inner, epoll)?;
        Ok(TcpStream {
            inner: Some(inner),
            epoll,
        })
    }

    /// Receives into `buf` (from its first byte); `Ok(0)` at EOF.
    ///
    /// The first `n` bytes become initialised; a `Vec`'s length is raised to
    /// `n` but never lowered, so reuse a `Vec` with `clear()` (or pass
    /// `buf.slice(..)` and look at the returned count).
    pub fn read<B: IoBufMut>(&self, buf: B) -> Op<'_, Recv<B>> {
        Op::new(Recv::new(self.fd(), buf))
    }

    /// Sends the initialised bytes of `buf`; may send fewer.
    pub fn write<B: IoBuf>(&self, buf: B) -> Op<'_, Send<B>> {
        Op::new(Send::new(self.fd(), buf))
    }

    /// Zero-copy send on io_uring (`SEND_ZC`): resolves only after the
    /// kernel's notification that it no longer references `buf`. A plain send on epoll.
    pub fn send_zc<B: IoBuf>(&self, buf: B) -> Op<'_, SendZc<B>> {
        Op::new(SendZc::new(self.fd(), buf))
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
    pub async fn read_exact<B: IoBufMut>(&self, mut buf: B) -> BufResult<(), B> {
        let len = buf.bytes_total();
        let mut off = 0;
        while off < len {
            let (res, slice) = self.read(buf.slice(off..len)).await;
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

    /// A multishot receive into buffers of `pool`.
    pub fn recv_multishot(&self, pool: &BufPool) -> RecvMulti<'_> {
        RecvMulti::new(self.fd(), pool)
    }

    /// Waits until the socket is readable (`POLL_ADD`); returns the events.
    pub fn readable(&self) -> Op<'_, PollAdd> {
        Op::new(PollAdd::new(self.fd(), libc::POLLIN as u32))
    }

    /// Waits until the socket is writable.
    pub fn writable(&self) -> Op<'_, PollAdd> {
        Op::new(PollAdd::new(self.fd(), libc::POLLOUT as u32))
    }

    /// Sets `TCP_NODELAY`.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.std().set_nodelay(on)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.std().peer_addr()
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.std().local_addr()
    }

    /// Sets `SO_LINGER`: `Some(Duration::ZERO)` makes close send an RST and
    /// drop unsent data at once (which also releases zero-copy pages).
    pub fn set_linger(&self, linger: Option<std::time::Duration>) -> io::Result<()> {
        crate::driver::socket::set_linger(self.std(), linger)
    }

    /// Shuts down one or both directions.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.std().shutdown(how)
    }

    /// Closes the socket through the driver (`IORING_OP_CLOSE`).
    pub async fn close(mut self) -> io::Result<()> {
        let s = self.inner.take().expect("stream present until close");
        if self.epoll {
            forget_fd(s.as_raw_fd());
        }
        Op::<Close>::new(Close::new(OwnedFd::from(s))).await
    }
}

impl AsRawFd for TcpStream {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl Drop for TcpStream {
    fn drop(&mut self) {
        if let (true, Some(s)) = (self.epoll, &self.inner) {
            forget_fd(s.as_raw_fd());
        }
    }
}
