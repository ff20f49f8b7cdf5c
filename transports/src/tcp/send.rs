//! How an initiator connection puts a request's frame on the wire (under
//! its send guard): straight from the bytes with one `sendmsg(2)` when the
//! socket takes them, and the rest through the driver.

use quiesce_runtime::IoBuf;

use crate::control::frame::{send_now, send_unsent};
use crate::control::wire::{Header, HEADER_LEN};
use crate::tcp::conn::Conn;
use crate::tcp::split::{bytes_of, Part};

/// Lent payloads up to this size first try one `sendmsg(2)` with their
/// header, on the calling thread ([`Conn::send_lent`]); larger slices always
/// go through the driver.
const DIRECT_PAYLOAD: usize = 64 * 1024;

impl Conn {
    /// Sends `h` then the lent `part` (under the send guard): a part of up
    /// to [`DIRECT_PAYLOAD`] bytes, not zero-copy, goes with its header in
    /// one `sendmsg(2)` when the socket takes it ([`send_now`]: the kernel
    /// has copied the bytes when it returns); what it did not take — or a
    /// larger part, which always leaves the thread between slices — goes
    /// through the driver, the header's rest from a frame buffer and the
    /// part's rest lent to the send.
    pub(super) async fn send_lent<B: IoBuf>(
        &self,
        h: &Header,
        part: Part<B>,
        zc: bool,
    ) -> (std::io::Result<()>, Part<B>) {
        let head = h.encode();
        let sent = if zc || part.len() > DIRECT_PAYLOAD {
            0
        } else {
            match send_now(&self.stream, &head, bytes_of(&part)) {
                Ok(n) => n,
                Err(e) => return (Err(e), part),
            }
        };
        if sent < HEADER_LEN {
            if let Err(e) = send_unsent(&self.stream, &head, &[], sent).await {
                return (Err(e), part);
            }
            return if zc {
                self.stream.write_all_zc(part).await
            } else {
                self.stream.write_all(part).await
            };
        }
        let done = sent - HEADER_LEN;
        let len = part.len();
        if done == len {
            return (Ok(()), part);
        }
        let (res, rest) = self.stream.write_all(part.slice(done..len)).await;
        (res, rest.into_inner())
    }
}
