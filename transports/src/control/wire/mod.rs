//! The wire format: a fixed 48-byte frame header, little-endian, versioned,
//! optionally followed by a payload of `length` bytes. `docs/PROTOCOL.md`
//! describes it byte by byte. Decoding never panics: every malformed input is
//! a [`FrameError`].

mod handshake;
mod rdma;

pub use handshake::{
    AuthAck, AuthRequest, Descriptor, GrantReceipt, Hello, HelloAck, SegmentRef,
    MAX_HANDSHAKE_PAYLOAD,
};
pub use rdma::{QpAccept, QpConnect, QpWire, RemoteKey, MAX_QP_PAYLOAD, QP_CONNECT_PAYLOAD};

/// `b"QSCE"`, the first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"QSCE";
/// The protocol version this build speaks.
pub const VERSION: u16 = 7;
/// Size of the frame header.
pub const HEADER_LEN: usize = 48;

/// What a frame asks for or reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    /// Initiator → target: protocol versions, node, session, nonce.
    Hello = 1,
    /// Target → initiator: version chosen, node, nonce, segment descriptors.
    HelloAck = 2,
    /// Initiator → target: proofs of segment tokens.
    Auth = 3,
    /// Target → initiator: one status per proof.
    AuthAck = 4,
    /// Initiator → target: its RDMA queue pair (or none: keys only).
    QpConnect = 5,
    /// Target → initiator: the target's queue pair and the remote keys of
    /// the segments proven on this connection.
    QpAccept = 6,
    /// Initiator → target, same host: attach this connection to the
    /// initiator's process (payload: its pid, and the address of its nonce
    /// in its memory), so the target moves data by cross-memory attach.
    LocalAttach = 7,
    /// Initiator → target, attached connection: serve small requests of
    /// this connection from a mailbox in shared memory (payload: the fd
    /// numbers of its memory and doorbells in the initiator's process, and
    /// its slot count).
    LocalMailbox = 8,
    /// Initiator → target: `length` payload bytes to land at `segment[offset..]`.
    Write = 16,
    /// Initiator → target: send back `length` bytes of `segment[offset..]`.
    Read = 17,
    /// Initiator → target: apply no further byte of batch `batch`.
    Fence = 18,
    /// Initiator → target: nothing more of batch `batch` will be sent on
    /// this connection (the batch is finished at the initiator); the target
    /// may forget the batch once every connection that could carry it said
    /// so or closed.
    Forget = 19,
    /// Initiator → target, attached connection: copy `length` bytes from
    /// the initiator's memory at the address in the 8-byte payload to
    /// `segment[offset..]`.
    WriteLocal = 20,
    /// Initiator → target, attached connection: copy `length` bytes of
    /// `segment[offset..]` to the initiator's memory at the address in the
    /// 8-byte payload.
    ReadLocal = 21,
    /// Target → initiator: the outcome of a write or read (`flags` = [`Status`]).
    Status = 32,
    /// Target → initiator: `length` bytes of a read follow.
    ReadData = 33,
    /// Target → initiator: no further byte of batch `batch` will be applied.
    FenceAck = 34,
}

impl Opcode {
    fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            1 => Opcode::Hello,
            2 => Opcode::HelloAck,
            3 => Opcode::Auth,
            4 => Opcode::AuthAck,
            5 => Opcode::QpConnect,
            6 => Opcode::QpAccept,
            7 => Opcode::LocalAttach,
            8 => Opcode::LocalMailbox,
            16 => Opcode::Write,
            17 => Opcode::Read,
            18 => Opcode::Fence,
            19 => Opcode::Forget,
            20 => Opcode::WriteLocal,
            21 => Opcode::ReadLocal,
            32 => Opcode::Status,
            33 => Opcode::ReadData,
            34 => Opcode::FenceAck,
            _ => return None,
        })
    }
}

/// The target's verdict on one request, carried in a `Status` frame's `flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// Every byte landed (write) or was sent (read).
    Ok = 0,
    /// The segment id is not registered at the target.
    NoSuchSegment = 1,
    /// The peer has not proven the segment's token, or lacks the right.
    Forbidden = 2,
    /// `offset + length` is outside the segment (or overflows).
    OutOfBounds = 3,
    /// The frame is malformed (bad length, unknown op in this phase…).
    BadFrame = 4,
    /// The batch was fenced: nothing of this request was applied after the fence.
    Fenced = 5,
    /// A fenced write that had started: some bytes landed before the fence.
    FencedPartial = 6,
    /// The range was revoked by the segment's owner, and this connection
    /// holds an older grant than that revoke's (a proof naming the revoke's
    /// receipt grants it, PROTOCOL.md §5.1): nothing of the request lands
    /// after the revoke (`length` = bytes of a write's prefix that landed
    /// before it).
    Revoked = 7,
    /// Local transport: the target could not reach the initiator's memory
    /// (cross-memory attach failed); `length` = bytes moved before that.
    Unreachable = 8,
}

impl Status {
    /// Decodes a status byte.
    pub fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::NoSuchSegment,
            2 => Status::Forbidden,
            3 => Status::OutOfBounds,
            4 => Status::BadFrame,
            5 => Status::Fenced,
            6 => Status::FencedPartial,
            7 => Status::Revoked,
            8 => Status::Unreachable,
            _ => return None,
        })
    }
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer bytes than the structure needs.
    #[error("truncated frame: needed {needed} bytes, had {had}")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        had: usize,
    },
    /// The first four bytes are not `QSCE`.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("unsupported protocol version {0}")]
    Version(u16),
    /// An op code this build does not know.
    #[error("unknown op {0}")]
    UnknownOp(u8),
    /// A field holds a value outside its range.
    #[error("invalid field {0}")]
    Invalid(&'static str),
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The operation.
    pub op: Opcode,
    /// Opcode-specific flags; the [`Status`] of `Status` frames.
    pub flags: u8,
    /// The batch this frame belongs to (0 for handshake frames).
    pub batch: u64,
    /// The task within the batch.
    pub task: u64,
    /// The segment addressed.
    pub segment: u64,
    /// Byte offset within the segment.
    pub offset: u64,
    /// Payload bytes that follow (`Write`, `ReadData`, handshake), or bytes
    /// requested (`Read`), or bytes applied (`Status`).
    pub length: u64,
}

impl Header {
    /// A header for `op` with every other field zero.
    pub fn new(op: Opcode) -> Header {
        Header {
            op,
            flags: 0,
            batch: 0,
            task: 0,
            segment: 0,
            offset: 0,
            length: 0,
        }
    }

    /// Encodes into the 48-byte wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6] = self.op as u8;
        b[7] = self.flags;
        b[8..16].copy_from_slice(&self.batch.to_le_bytes());
        b[16..24].copy_from_slice(&self.task.to_le_bytes());
        b[24..32].copy_from_slice(&self.segment.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.length.to_le_bytes());
        b
    }

    /// Decodes the wire form; checks magic, version and op.
    pub fn decode(b: &[u8]) -> Result<Header, FrameError> {
        if b.len() < HEADER_LEN {
            return Err(FrameError::Truncated {
                needed: HEADER_LEN,
                had: b.len(),
            });
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        let op = Opcode::from_u8(b[6]).ok_or(FrameError::UnknownOp(b[6]))?;
        let u = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Ok(Header {
            op,
            flags: b[7],
            batch: u(8),
            task: u(16),
            segment: u(24),
            offset: u(32),
            length: u(40),
        })
    }

    /// The status of a `Status` frame.
    pub fn status(&self) -> Result<Status, FrameError> {
        Status::from_u8(self.flags).ok_or(FrameError::Invalid("status"))
    }
}

/// A bounds-checked little-endian reader over a payload.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(FrameError::Invalid("length"))?;
        if end > self.buf.len() {
            return Err(FrameError::Truncated {
                needed: end,
                had: self.buf.len(),
            });
        }
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub(crate) fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A string prefixed by its u8 length, UTF-8.
    pub(crate) fn str8(&mut self) -> Result<String, FrameError> {
        let n = self.u8()? as usize;
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| FrameError::Invalid("utf-8 string"))
    }

    /// Fails if bytes are left over.
    pub(crate) fn finish(self) -> Result<(), FrameError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(FrameError::Invalid("trailing bytes"))
        }
    }
}

/// Appends a u8-length-prefixed string (names are at most 255 bytes).
pub(crate) fn put_str8(out: &mut Vec<u8>, s: &str) -> Result<(), FrameError> {
    let n = u8::try_from(s.len()).map_err(|_| FrameError::Invalid("name longer than 255 bytes"))?;
    out.push(n);
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header {
            op: Opcode::Write,
            flags: 3,
            batch: 1,
            task: 2,
            segment: 3,
            offset: 4,
            length: u64::MAX,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn header_rejects_garbage() {
        let mut b = Header::new(Opcode::Read).encode();
        assert!(matches!(
            Header::decode(&b[..47]),
            Err(FrameError::Truncated { .. })
        ));
        b[6] = 99;
        assert_eq!(Header::decode(&b), Err(FrameError::UnknownOp(99)));
        b[4] = 9;
        assert_eq!(Header::decode(&b), Err(FrameError::Version(9)));
        b[0] = b'X';
        assert!(matches!(Header::decode(&b), Err(FrameError::BadMagic(_))));
    }
}
