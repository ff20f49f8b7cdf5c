//! What a batch needs from a transport, and the TCP transport's answer.

use std::future::Future;
use std::hash::{Hash, Hasher};

use quiesce_runtime::{IoBuf, IoBufMut};
use quiesce_transports::rdma::{RdmaPeer, RdmaSegment};
use quiesce_transports::{Peer, RemoteSegment, TransferError};

/// A transport a batch can drive. Its transfer futures must resolve only
/// once the transfer has quiesced: the buffer they hand back is touched by
/// no kernel, NIC or peer any more.
pub trait Transport: Clone + 'static {
    /// Where a task's bytes go (write) or come from (read), with the length.
    type Target: Clone + 'static;
    /// The fence domain a target belongs to.
    type Peer: Clone + Eq + Hash + 'static;

    /// The peer serving `target`.
    fn peer(&self, target: &Self::Target) -> Self::Peer;

    /// Bytes the task moves.
    fn len(&self, target: &Self::Target) -> u64;

    /// Writes the initialised bytes of `src` to `target`.
    fn write<B: IoBuf>(
        &self,
        target: &Self::Target,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static;

    /// Reads `target` into the first bytes of `dst`.
    fn read<B: IoBufMut>(
        &self,
        target: &Self::Target,
        dst: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static;

    /// Remote fence: resolves once `peer` will apply no further byte of `batch`.
    fn fence(
        &self,
        peer: &Self::Peer,
        batch: u64,
    ) -> impl Future<Output = Result<(), TransferError>> + 'static;

    /// Local teardown: make every in-flight operation towards `peer` end
    /// (their futures still resolve only once reaped).
    fn abort(&self, peer: &Self::Peer);
}

/// A range of a remote segment.
#[derive(Clone)]
pub struct RemoteRange {
    /// The segment.
    pub segment: RemoteSegment,
    /// Offset within it.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

impl RemoteRange {
    /// `segment[offset..offset + len]`.
    pub fn new(segment: &RemoteSegment, offset: u64, len: u64) -> RemoteRange {
        RemoteRange {
            segment: segment.clone(),
            offset,
            len,
        }
    }
}

/// A peer compared by identity, for fence bookkeeping.
#[derive(Clone)]
pub struct PeerKey(pub Peer);

impl PartialEq for PeerKey {
    fn eq(&self, other: &Self) -> bool {
        self.0.addr() == other.0.addr()
    }
}

impl Eq for PeerKey {}

impl Hash for PeerKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.addr().hash(h)
    }
}

/// The TCP transport of `quiesce-transports`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tcp;

impl Transport for Tcp {
    type Target = RemoteRange;
    type Peer = PeerKey;

    fn peer(&self, t: &RemoteRange) -> PeerKey {
        PeerKey(t.segment.peer().clone())
    }

    fn len(&self, t: &RemoteRange) -> u64 {
        t.len
    }

    fn write<B: IoBuf>(
        &self,
        t: &RemoteRange,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        let t = t.clone();
        async move { t.segment.write(t.offset, src, batch).await }
    }

    fn read<B: IoBufMut>(
        &self,
        t: &RemoteRange,
        dst: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        let t = t.clone();
        async move { t.segment.read(t.offset, t.len, dst, batch).await }
    }

    fn fence(
        &self,
        peer: &PeerKey,
        batch: u64,
    ) -> impl Future<Output = Result<(), TransferError>> + 'static {
        let p = peer.0.clone();
        async move { p.fence(batch).await }
    }

    fn abort(&self, peer: &PeerKey) {
        peer.0.abort()
    }
}

/// A range of an RDMA segment.
#[derive(Clone)]
pub struct RdmaRange {
    /// The segment.
    pub segment: RdmaSegment,
    /// Offset within it.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

impl RdmaRange {
    /// `segment[offset..offset + len]`.
    pub fn new(segment: &RdmaSegment, offset: u64, len: u64) -> RdmaRange {
        RdmaRange {
            segment: segment.clone(),
            offset,
            len,
        }
    }
}

/// An RDMA peer compared by identity, for fence bookkeeping.
#[derive(Clone)]
pub struct RdmaPeerKey(pub RdmaPeer);

impl PartialEq for RdmaPeerKey {
    fn eq(&self, other: &Self) -> bool {
        self.0.addr() == other.0.addr()
    }
}

impl Eq for RdmaPeerKey {}

impl Hash for RdmaPeerKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.addr().hash(h)
    }
}

/// The RDMA verbs transport of `quiesce-transports`: buffers must lie in a
/// region registered with the initiator's `RdmaEngine`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rdma;

impl Transport for Rdma {
    type Target = RdmaRange;
    type Peer = RdmaPeerKey;

    fn peer(&self, t: &RdmaRange) -> RdmaPeerKey {
        RdmaPeerKey(t.segment.peer().clone())
    }

    fn len(&self, t: &RdmaRange) -> u64 {
        t.len
    }

    fn write<B: IoBuf>(
        &self,
        t: &RdmaRange,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        let t = t.clone();
        async move { t.segment.write(t.offset, src, batch).await }
    }

    fn read<B: IoBufMut>(
        &self,
        t: &RdmaRange,
        dst: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        let t = t.clone();
        async move { t.segment.read(t.offset, t.len, dst, batch).await }
    }

    fn fence(
        &self,
        peer: &RdmaPeerKey,
        batch: u64,
    ) -> impl Future<Output = Result<(), TransferError>> + 'static {
        let p = peer.0.clone();
        async move { p.fence(batch).await }
    }

    fn abort(&self, peer: &RdmaPeerKey) {
        peer.0.abort()
    }
}
