//! Frame I/O over a `TcpStream`: headers, bounded payloads, discards.

use std::io;

use quiesce_runtime::net::TcpStream;
use quiesce_runtime::timeline::{self, Step};
use quiesce_runtime::IoBuf;

use crate::control::idle::IdleLimit;
use crate::control::wire::{FrameError, Header, HEADER_LEN};

/// Reads one header; `Ok(None)` on a clean EOF before its first byte.
/// Exactly its bytes: for the handshake, before a connection's frames go
/// through a [`ReadAhead`](crate::control::read_ahead::ReadAhead).
pub(crate) async fn read_header(s: &TcpStream) -> io::Result<Option<Result<Header, FrameError>>> {
    let mut buf = vec![0u8; HEADER_LEN].into_boxed_slice();
    let mut got = 0;
    while got < HEADER_LEN {
        let (res, slice) = s.read(buf.slice(got..)).await;
        buf = slice.into_inner();
        match res? {
            0 if got == 0 => return Ok(None),
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    Ok(Some(Header::decode(&buf)))
}

/// Reads a payload of exactly `len` bytes.
pub(crate) async fn read_payload(s: &TcpStream, len: usize) -> io::Result<Vec<u8>> {
    let (res, buf) = s.read_exact(vec![0u8; len].into_boxed_slice()).await;
    res.map(|()| buf.into_vec())
}

/// Drops the stream's next `len` bytes (the payload of a refused, fenced or
/// cut write): nothing is copied (`recv(2)` with `MSG_TRUNC`), so skipping
/// a megabyte a fence cut short costs the kernel's packet bookkeeping, not
/// a copy, and no buffer is allocated. The first try is at once (a refused
/// payload follows its header); EOF first is `UnexpectedEof`. With `idle`
/// (a target's connection), each receive is bounded by its limit
/// ([`IdleLimit::within`]): a payload that stops coming is `TimedOut`.
pub(crate) async fn discard(
    s: &TcpStream,
    mut len: u64,
    mut idle: Option<&mut IdleLimit>,
) -> io::Result<()> {
    let mut expected = true;
    while len > 0 {
        let want = usize::try_from(len).unwrap_or(usize::MAX);
        let op = s.discard(want, std::mem::take(&mut expected));
        let got = match idle.as_deref_mut() {
            Some(idle) => idle
                .within(op)
                .await
                .map_err(|c| io::Error::new(io::ErrorKind::TimedOut, format!("{c:?}")))?,
            None => op.await,
        };
        match got {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => len -= n.min(want) as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Frames up to this size are built in [`SPARE_FRAMES`]' buffers (a header
/// and an inline read's 16 KiB of data).
const SPARE_FRAME_LEN: usize = HEADER_LEN + 16 * 1024;

/// Spare frame buffers kept per thread at most (256 KiB in all).
const SPARE_FRAMES_MAX: usize = 16;

thread_local! {
    /// Sent frames' buffers, for the next frames of this thread's reactor: a
    /// status, a small read's answer or a control frame allocates nothing
    /// once warm. A buffer whose send was dropped mid-flight stays with its
    /// parked op instead.
    static SPARE_FRAMES: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Sends a header and an optional payload as one frame: straight from them
/// when the socket takes them ([`send_now`]), and whatever it did not take
/// through the driver, from a frame buffer. Callers send one frame at a time
/// on a stream.
pub(crate) async fn send_frame(s: &TcpStream, h: &Header, payload: &[u8]) -> io::Result<()> {
    let head = h.encode();
    let sent = send_now(s, &head, payload)?;
    if sent == head.len() + payload.len() {
        return Ok(());
    }
    // A full socket (rare): boxed, so the driver's send state is not part of
    // every frame's future.
    Box::pin(send_unsent(s, &head, payload, sent)).await
}

/// Sends through the driver what [`send_now`] left of `head` then
/// `payload` after `sent` bytes, copied into a frame buffer.
pub(crate) async fn send_unsent(
    s: &TcpStream,
    head: &[u8],
    payload: &[u8],
    sent: usize,
) -> io::Result<()> {
    let total = head.len() + payload.len();
    if sent == total {
        return Ok(());
    }
    let mut out = frame_buffer(total - sent);
    if sent < head.len() {
        out.extend_from_slice(&head[sent..]);
        out.extend_from_slice(payload);
    } else {
        out.extend_from_slice(&payload[sent - head.len()..]);
    }
    send_frame_buffer(s, out).await
}

/// Sends `head` then `payload` with one non-blocking `sendmsg(2)` when no
/// send is queued on `s` (the kernel copies the bytes before it returns, so
/// nothing is lent): the bytes sent, 0 if the socket took none now.
pub(crate) fn send_now(s: &TcpStream, head: &[u8], payload: &[u8]) -> io::Result<usize> {
    timeline::mark(Step::SendStarted);
    let sent = s.try_send_vectored(&[io::IoSlice::new(head), io::IoSlice::new(payload)]);
    timeline::mark(Step::SendReturned);
    match sent {
        Ok(n) => Ok(n),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) =>
        {
            Ok(0)
        }
        Err(e) => Err(e),
    }
}

/// A frame of a header and `len` bytes of payload that `fill` writes
/// straight into it, for one write ([`send_frame_buffer`]).
pub(crate) fn frame_filled(h: &Header, len: usize, fill: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let mut out = frame_buffer(HEADER_LEN + len);
    out.extend_from_slice(&h.encode());
    out.resize(HEADER_LEN + len, 0);
    fill(&mut out[HEADER_LEN..]);
    out
}

/// An empty buffer for a frame of `total` bytes: a spare one if it fits.
fn frame_buffer(total: usize) -> Vec<u8> {
    let mut out = if total <= SPARE_FRAME_LEN {
        // A thread whose locals are being torn down (a runtime dropped in
        // a thread-local's destructor) allocates instead.
        SPARE_FRAMES
            .try_with(|s| s.borrow_mut().pop())
            .ok()
            .flatten()
            .unwrap_or_else(|| Vec::with_capacity(SPARE_FRAME_LEN))
    } else {
        Vec::with_capacity(total)
    };
    out.clear();
    out
}

/// Sends `out` whole, then keeps it as a spare if it is small enough.
pub(crate) async fn send_frame_buffer(s: &TcpStream, out: Vec<u8>) -> io::Result<()> {
    let (res, out) = s.write_all(out).await;
    if out.capacity() <= SPARE_FRAME_LEN {
        let _ = SPARE_FRAMES.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            if spare.len() < SPARE_FRAMES_MAX {
                spare.push(out);
            }
        });
    }
    res
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::time::Duration;

    use quiesce_runtime::net::TcpStream;
    use quiesce_runtime::Runtime;

    use super::send_frame;
    use crate::control::wire::{Header, Opcode, HEADER_LEN};

    fn payload(i: usize) -> Vec<u8> {
        let len = (16 << 10) - i % 61;
        (0..len).map(|j| (i * 31 + j) as u8).collect()
    }

    /// Frames sent while the peer does not read fill the socket: they go
    /// partly straight to the kernel and the rest through the driver, and
    /// each still arrives whole and in order.
    #[test]
    fn frames_cut_by_a_full_socket_arrive_whole() {
        const N: usize = 600;
        // Made first: the frames must go faster than the reader wakes.
        let payloads: Vec<Vec<u8>> = (0..N).map(payload).collect();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut server, _) = l.accept().unwrap();
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut got = Vec::new();
            server.read_to_end(&mut got).unwrap();
            got
        });
        Runtime::new().unwrap().block_on(async {
            let s = TcpStream::from_std(client).unwrap();
            for (i, p) in payloads.iter().enumerate() {
                let h = Header {
                    task: i as u64,
                    length: p.len() as u64,
                    ..Header::new(Opcode::Write)
                };
                send_frame(&s, &h, p).await.unwrap();
            }
            s.shutdown(std::net::Shutdown::Write).unwrap();
        });
        let got = reader.join().unwrap();
        let mut at = 0;
        for (i, p) in payloads.iter().enumerate() {
            let h = Header::decode(&got[at..at + HEADER_LEN]).unwrap();
            assert_eq!((h.task, h.length), (i as u64, p.len() as u64), "frame {i}");
            at += HEADER_LEN;
            assert!(got[at..at + p.len()] == p[..], "frame {i}'s payload");
            at += h.length as usize;
        }
        assert_eq!(at, got.len(), "bytes after the last frame");
    }
}
