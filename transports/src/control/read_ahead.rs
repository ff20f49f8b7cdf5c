//! Reading a connection's frames ahead: a header's receive takes whatever
//! follows it in the socket too, up to [`READ_AHEAD`] bytes.
//!
//! A small write arrives as one segment of the stream — its header and its
//! payload sent together — and was received in two: the header, then the
//! payload into its destination. Reading ahead, one receive takes both, and
//! the payload is copied out of this buffer (4 KiB: ~100 ns, a receive
//! less: the socket lock, the skb walk and the syscall), as are the headers
//! of frames sent back to back (a batch's status frames, pipelined writes).
//! A large payload is copied only as far as it was read ahead; the rest
//! goes straight from the socket to its destination as before.
//!
//! Every read of the connection after the first header taken through a
//! `ReadAhead` must go through it (headers, payloads, discards): bytes it
//! holds are the stream's next ones. A receive abandoned mid-way (its future
//! dropped) loses its buffer — to the kernel's op, or with the future while
//! it polled — and the bytes held in it, so the framing is lost: the next
//! read fails instead of misreading the stream.
//!
//! While the runtime spins, a header's receive polls the socket before it
//! arms one in the ring ([`poll_socket`]).

use std::cell::Cell;
use std::io;
use std::time::Instant;

use quiesce_runtime::net::TcpStream;
use quiesce_runtime::timeline::{self, Step};
use quiesce_runtime::{offer_core, spin_time, tasks_ready, yield_now, IoBuf};

use crate::control::frame::discard;
use crate::control::idle::IdleLimit;
use crate::control::wire::{FrameError, Header, HEADER_LEN};

/// The largest receive a header read makes: a 4 KiB write's frame and the
/// next header fit.
pub(crate) const READ_AHEAD: usize = 8 * 1024;

/// Bytes of one connection received ahead of what was asked for.
#[derive(Default)]
pub(crate) struct ReadAhead {
    /// `None` while a receive holds it (or before the first).
    buf: Option<Box<[u8]>>,
    /// The unread bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    /// Set while a receive is in flight: still set on entry means one was
    /// abandoned and the stream's position is unknown.
    receiving: bool,
}

impl ReadAhead {
    /// Bytes held and not yet read.
    fn held(&self) -> usize {
        self.end - self.start
    }

    /// Reads one header; `Ok(None)` on a clean EOF before its first byte.
    pub(crate) async fn header(
        &mut self,
        s: &TcpStream,
    ) -> io::Result<Option<Result<Header, FrameError>>> {
        while self.held() < HEADER_LEN {
            if !self.receive(s).await? {
                return match self.held() {
                    0 => Ok(None),
                    _ => Err(io::ErrorKind::UnexpectedEof.into()),
                };
            }
        }
        let buf = self.buf.as_deref().expect("held bytes are in the buffer");
        let h = Header::decode(&buf[self.start..self.start + HEADER_LEN]);
        self.start += HEADER_LEN;
        Ok(Some(h))
    }

    /// Takes up to `max` held bytes (none when nothing is held): the
    /// stream's next ones.
    pub(crate) fn take(&mut self, max: usize) -> &[u8] {
        let n = self.held().min(max);
        let at = self.start;
        self.start += n;
        match &self.buf {
            Some(b) => &b[at..at + n],
            None => &[],
        }
    }

    /// Reads exactly `len` bytes (a control frame's payload).
    pub(crate) async fn payload(&mut self, s: &TcpStream, len: usize) -> io::Result<Vec<u8>> {
        let buf = self.fill(s, vec![0u8; len].into_boxed_slice()).await?;
        Ok(buf.into_vec())
    }

    /// Reads exactly `buf.len()` bytes into `buf` (a local request's
    /// address).
    pub(crate) async fn fill(
        &mut self,
        s: &TcpStream,
        mut buf: Box<[u8]>,
    ) -> io::Result<Box<[u8]>> {
        let len = buf.len();
        let ahead = self.take(len);
        let n = ahead.len();
        buf[..n].copy_from_slice(ahead);
        if n < len {
            self.check()?;
            let (res, slice) = s.read_exact_expected(buf.slice(n..)).await;
            res?;
            buf = slice.into_inner();
        }
        Ok(buf)
    }

    /// Reads and drops `len` bytes (a refused or cut write's payload).
    pub(crate) async fn discard(
        &mut self,
        s: &TcpStream,
        len: u64,
        idle: Option<&mut IdleLimit>,
    ) -> io::Result<()> {
        let n = self.take(usize::try_from(len).unwrap_or(usize::MAX)).len() as u64;
        if n < len {
            self.check()?;
            discard(s, len - n, idle).await?;
        }
        Ok(())
    }

    /// Fails if an earlier receive was abandoned (see the module).
    fn check(&self) -> io::Result<()> {
        match self.receiving {
            true => Err(io::Error::other(
                "a receive of this connection was abandoned mid-way; its framing is lost",
            )),
            false => Ok(()),
        }
    }

    /// One receive after the held bytes (moved to the front first); false
    /// on EOF. While the runtime spins, the socket is polled directly first
    /// (see [`poll_socket`]); the ring's receive is the fallback.
    async fn receive(&mut self, s: &TcpStream) -> io::Result<bool> {
        self.check()?;
        let mut buf = self
            .buf
            .take()
            .unwrap_or_else(|| vec![0u8; READ_AHEAD].into_boxed_slice());
        let held = self.held();
        if held > 0 && self.start > 0 {
            buf.copy_within(self.start..self.end, 0);
        }
        (self.start, self.end, self.receiving) = (0, 0, true);
        let res = match poll_socket(s, &mut buf[held..]).await {
            Some(res) => res,
            None => {
                let (res, slice) = s.read(buf.slice(held..)).await;
                buf = slice.into_inner();
                res
            }
        };
        if matches!(res, Ok(n) if n > 0) {
            timeline::mark(Step::Received);
        }
        self.buf = Some(buf);
        (self.end, self.receiving) = (held, false);
        match res {
            Ok(0) => Ok(false),
            Ok(n) => {
                self.end += n;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }
}

/// Readers polling their socket at once on this thread, at most
/// [`MAX_POLLING`]: each poll is a syscall per reactor turn.
const MAX_POLLING: usize = 4;

thread_local! {
    static POLLING: Cell<usize> = const { Cell::new(0) };
}

/// One of the thread's [`MAX_POLLING`] places, held while a reader polls.
struct PollingPlace;

impl PollingPlace {
    fn take() -> Option<PollingPlace> {
        POLLING.with(|p| {
            (p.get() < MAX_POLLING).then(|| {
                p.set(p.get() + 1);
                PollingPlace
            })
        })
    }
}

impl Drop for PollingPlace {
    fn drop(&mut self) {
        let _ = POLLING.try_with(|p| p.set(p.get() - 1));
    }
}

/// While the runtime spins ([`spin_time`]), polls the socket directly —
/// one non-blocking `recv(2)` per reactor turn — for up to the spin time:
/// `None` if nothing came (or polling is not for this reader), and the
/// caller receives through the ring. A receive armed in the ring makes the
/// peer's `send` run its wake-up (io_uring's poll and task work) and the
/// bytes arrive through that work; polled, the peer's `send` wakes nobody
/// and the bytes are taken by a plain `recv` (docs/BENCHMARKS.md,
/// 2026-12-04: a 4 KiB write's t_min 8.7–8.9 → 7.1–7.2 µs on io_uring
/// with both ends polling). Nothing is lent to the kernel meanwhile.
async fn poll_socket(s: &TcpStream, buf: &mut [u8]) -> Option<io::Result<usize>> {
    let spin = spin_time();
    if spin.is_zero() {
        return None;
    }
    let _place = PollingPlace::take()?;
    // Tasks the frame just read woke (a batch whose last status came, on
    // the initiator) run first: their answer is what the peer waits for,
    // and this soon after a frame the socket is most likely empty — a
    // `recv` and a `sched_yield` for nothing ahead of them (~0.5 µs of a
    // 4 KiB call from Python, docs/BENCHMARKS.md). Once per poll, so
    // readers that all poll cannot keep deferring to each other.
    if tasks_ready() {
        yield_now().await;
    }
    let start = Instant::now();
    let mut polls = 0;
    loop {
        timeline::mark(Step::PollStarted);
        match s.try_read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            res => return Some(res),
        }
        let now = Instant::now();
        if now.duration_since(start) >= spin {
            return None;
        }
        // After the reactor's turn, as its own spin does: other tasks run,
        // and the core is offered to other threads between polls (not
        // when this thread has tasks to run).
        polls += 1;
        if !tasks_ready() {
            offer_core(now, polls);
        }
        yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::wire::Opcode;
    use quiesce_runtime::net::{TcpListener, TcpStream};
    use quiesce_runtime::Runtime;
    use std::time::Duration;

    fn header(task: u64, length: u64) -> [u8; HEADER_LEN] {
        Header {
            task,
            length,
            ..Header::new(Opcode::Write)
        }
        .encode()
    }

    /// Frames sent back to back, split anywhere by the sender, read as
    /// headers, payloads, takes and discards in order.
    #[test]
    fn frames_read_in_order_across_any_split() {
        let mut stream = Vec::new();
        let payloads: Vec<Vec<u8>> = (0..6u8)
            .map(|i| vec![i + 1; [10, 4096, 0, 9000, 3, 20000][i as usize]])
            .collect();
        for (i, p) in payloads.iter().enumerate() {
            stream.extend_from_slice(&header(i as u64, p.len() as u64));
            stream.extend_from_slice(p);
        }
        // On a spinning runtime the reader polls its socket directly.
        let spins = [Duration::ZERO, Duration::from_micros(200)];
        for (chunk, spin) in [1usize, 7, 48, 4144, 5000, 100_000]
            .into_iter()
            .flat_map(|c| spins.map(|s| (c, s)))
        {
            let rt = Runtime::builder().spin(spin).build().unwrap();
            let stream = stream.clone();
            let payloads = payloads.clone();
            rt.block_on(async move {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                let addr = l.local_addr().unwrap();
                let sender = std::thread::spawn(move || {
                    use std::io::Write;
                    let mut c = std::net::TcpStream::connect(addr).unwrap();
                    c.set_nodelay(true).unwrap();
                    for part in stream.chunks(chunk) {
                        c.write_all(part).unwrap();
                        if chunk > 1 {
                            std::thread::sleep(std::time::Duration::from_micros(50));
                        }
                    }
                });
                let (s, _) = l.accept().await.unwrap();
                let s: TcpStream = s;
                let mut rx = ReadAhead::default();
                for (i, p) in payloads.iter().enumerate() {
                    let h = rx.header(&s).await.unwrap().unwrap().unwrap();
                    assert_eq!(
                        (h.task, h.length),
                        (i as u64, p.len() as u64),
                        "chunk {chunk}"
                    );
                    match i % 3 {
                        0 => assert_eq!(&rx.payload(&s, p.len()).await.unwrap(), p),
                        1 => {
                            let got = rx.fill(&s, vec![0; p.len()].into()).await.unwrap();
                            assert_eq!(&got[..], &p[..]);
                        }
                        _ => rx.discard(&s, p.len() as u64, None).await.unwrap(),
                    }
                }
                assert!(rx.header(&s).await.unwrap().is_none(), "clean EOF");
                sender.join().unwrap();
            });
        }
    }

    /// A 4 KiB write's frame sent in one piece is taken by one receive: its
    /// payload is held after the header.
    #[test]
    fn a_small_frame_comes_in_one_receive() {
        let rt = Runtime::new().unwrap();
        rt.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let mut frame = header(1, 4096).to_vec();
            frame.extend_from_slice(&[9u8; 4096]);
            let sender = std::thread::spawn(move || {
                use std::io::Write;
                let mut c = std::net::TcpStream::connect(addr).unwrap();
                c.write_all(&frame).unwrap();
                c
            });
            let (s, _) = l.accept().await.unwrap();
            let _c = sender.join().unwrap();
            let mut rx = ReadAhead::default();
            let h = rx.header(&s).await.unwrap().unwrap().unwrap();
            assert_eq!(h.length, 4096);
            assert_eq!(rx.held(), 4096);
            assert_eq!(rx.take(10_000), &[9u8; 4096][..]);
            assert_eq!(rx.held(), 0);
        });
    }
}
