//! Typed transfer errors.

use std::io;

use crate::control::wire::{FrameError, Status};

/// Why a transfer (or one slice of it) failed. Every variant leaves the
/// caller's buffer intact and returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The segment is not registered at the target (or not known locally).
    #[error("no such segment {0}")]
    NoSuchSegment(u64),
    /// The peer has not proven the segment's token, or lacks the right.
    #[error("forbidden: segment {0}")]
    Forbidden(u64),
    /// The target refused to open the segment named so: a wrong token, or no
    /// such segment — it does not say which.
    #[error("the target refused to open segment {0:?} (wrong token, or no such segment)")]
    OpenRefused(String),
    /// `offset + length` is outside the segment, or overflows.
    #[error("out of bounds: {offset}+{len} exceeds segment of {seg_len} bytes")]
    OutOfBounds {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The segment's length.
        seg_len: u64,
    },
    /// A transfer of zero bytes, or a buffer smaller than the range.
    #[error("bad length: {0}")]
    BadLength(&'static str),
    /// A malformed frame (sent or received).
    #[error("bad frame: {0}")]
    BadFrame(String),
    /// The batch was fenced before this request applied anything.
    #[error("fenced")]
    Fenced,
    /// RDMA: the request was posted and then flushed when this initiator
    /// reset its queue pair for a fence or an abort. Packets it had sent may
    /// still be written at the target until the target confirms the fence
    /// (its queue pair reset), so it does not settle the remote side; the
    /// batch layer reports it fenced, and confirmed only once a fence is
    /// acknowledged.
    #[error("flushed by this initiator's queue pair reset; the target has not confirmed")]
    Flushed,
    /// The batch was fenced while this write was landing: `landed` bytes of
    /// it landed before the fence. For one frame they are its prefix; for a
    /// transfer striped over connections they are the sum over its slices,
    /// which land in parallel, so not necessarily a prefix of the range.
    #[error("fenced after {landed} bytes landed")]
    FencedPartial {
        /// Bytes applied before the fence.
        landed: u64,
    },
    /// The target's owner revoked the range after this initiator proved the
    /// token (or withdrew the segment mid-write): prove it again
    /// (`Peer::open`) to write there; `landed` bytes of the write landed
    /// before it — for a write striped over connections, summed over its
    /// slices, which land in parallel, so not necessarily a prefix.
    #[error("revoked by the target after {landed} bytes landed")]
    Revoked {
        /// Bytes applied before the revoke.
        landed: u64,
    },
    /// The request was never handed to the NIC or the socket (its link
    /// failed or was reset first): nothing of it was sent, so nothing of it
    /// lands, and it may be retried.
    #[error("not sent: {0}")]
    NotSent(String),
    /// No peer at that address, or the handshake was refused. (Boxed: the
    /// error sits in every task's report, which this keeps at 32 bytes.)
    #[error("handshake with {} failed: {}", .0.peer, .0.reason)]
    Handshake(Box<HandshakeFailure>),
    /// The connection died before the request completed; the request's
    /// local operations have been reaped.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// Connecting took longer than the configured timeout.
    #[error("connect timed out")]
    ConnectTimeout,
    /// RDMA: the target's NIC refused the access (remote key, bounds or the
    /// memory region's access flags); nothing of this request landed past
    /// the refusal, and the queue pair was reset.
    #[error("remote access refused: {0}")]
    RemoteAccess(String),
    /// Local transport: the target could not reach this process's memory,
    /// and stopped after `landed` bytes of the write had landed (for a
    /// write striped over connections, summed over its slices).
    #[error("the target could not reach this process's memory after {landed} bytes")]
    Unreachable {
        /// Bytes applied before it stopped.
        landed: u64,
    },
    /// RDMA: the local buffer is not inside memory registered with the
    /// engine (`RdmaEngine::register_region`); nothing was posted.
    #[error("buffer {addr:#x}+{len} is not in registered memory")]
    Unregistered {
        /// The buffer's address.
        addr: u64,
        /// Its length.
        len: u64,
    },
}

/// Why a handshake with a peer failed ([`TransferError::Handshake`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandshakeFailure {
    /// The peer's address.
    pub peer: String,
    /// Why.
    pub reason: String,
}

impl TransferError {
    /// A failed handshake with `peer`, for `reason`.
    pub fn handshake(peer: impl ToString, reason: impl Into<String>) -> Self {
        TransferError::Handshake(Box::new(HandshakeFailure {
            peer: peer.to_string(),
            reason: reason.into(),
        }))
    }

    /// The error a target's status maps to (`None` for `Ok`).
    pub(crate) fn from_status(st: Status, segment: u64, landed: u64) -> Option<TransferError> {
        Some(match st {
            Status::Ok => return None,
            Status::NoSuchSegment => TransferError::NoSuchSegment(segment),
            Status::Forbidden => TransferError::Forbidden(segment),
            Status::OutOfBounds => TransferError::OutOfBounds {
                offset: 0,
                len: 0,
                seg_len: 0,
            },
            Status::BadFrame => TransferError::BadFrame("rejected by the target".into()),
            Status::Fenced => TransferError::Fenced,
            Status::FencedPartial => TransferError::FencedPartial { landed },
            Status::Revoked => TransferError::Revoked { landed },
            Status::Unreachable => TransferError::Unreachable { landed },
        })
    }

    /// True if the error itself settles the request at the target: the
    /// target refused it (or applied it up to a fence), or it was never sent.
    /// False when the request ended without the target's answer (a lost
    /// connection, a timeout, a broken stream): bytes already sent may still
    /// land there until a fence is acknowledged.
    pub fn settles_remote(&self) -> bool {
        match self {
            TransferError::NoSuchSegment(_)
            | TransferError::Forbidden(_)
            | TransferError::OpenRefused(_)
            | TransferError::OutOfBounds { .. }
            | TransferError::BadLength(_)
            | TransferError::Fenced
            | TransferError::FencedPartial { .. }
            | TransferError::Revoked { .. }
            | TransferError::RemoteAccess(_)
            | TransferError::Unreachable { .. }
            | TransferError::NotSent(_)
            | TransferError::Unregistered { .. } => true,
            TransferError::BadFrame(_)
            | TransferError::Flushed
            | TransferError::Handshake { .. }
            | TransferError::ConnectionLost(_)
            | TransferError::ConnectTimeout => false,
        }
    }

    /// Bytes the target answered as landed before the request failed
    /// (`None`: it answered none, or did not answer).
    pub fn landed(&self) -> Option<u64> {
        match self {
            TransferError::FencedPartial { landed }
            | TransferError::Revoked { landed }
            | TransferError::Unreachable { landed } => Some(*landed),
            _ => None,
        }
    }

    /// Whether retrying the same request may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            TransferError::ConnectionLost(_)
                | TransferError::ConnectTimeout
                | TransferError::NotSent(_)
        )
    }
}

impl From<io::Error> for TransferError {
    fn from(e: io::Error) -> TransferError {
        TransferError::ConnectionLost(e.to_string())
    }
}

impl From<FrameError> for TransferError {
    fn from(e: FrameError) -> TransferError {
        TransferError::BadFrame(e.to_string())
    }
}
