//! The seed scenario from the Mooncake measurement, as a reusable routine:
//! a batch of [a 4 KiB write the target refuses, a valid large write], then
//! the returned source is overwritten and the destination is checked for the
//! overwrite. With quiesce no round can be corrupted: the source comes back
//! only once nothing reads it any more.

use std::time::{Duration, Instant};

use std::ops::DerefMut;

use quiesce_batch::{
    Batch, BatchOptions, FailurePolicy, Outcome, Rdma, RdmaRange, RemoteRange, Tcp, Transport,
};
use quiesce_runtime::time::sleep;
use quiesce_runtime::{IoBuf, IoBufMut};
use quiesce_transports::rdma::RdmaSegment;
use quiesce_transports::RemoteSegment;

/// The byte written into a returned buffer after the outcome. Pre-outcome
/// data never uses it.
pub const POST_OUTCOME: u8 = 0xEE;

/// How a round's batch resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Every task completed (the refused write was not refused?).
    Completed,
    /// Failed, buffers quiescent (sync code -1).
    Failed,
    /// Completion unknown first (sync code -2), then drained.
    Unknown,
}

/// One round's result.
#[derive(Debug, Clone, Copy)]
pub struct Round {
    /// How the batch resolved.
    pub kind: Kind,
    /// From submit to a safe outcome (Quiesced, or the ticket).
    pub time_to_safe: Duration,
    /// Post-outcome bytes seen where they must never be.
    pub corrupted_bytes: usize,
}

/// A remote segment the scenario can address, over TCP or RDMA.
pub trait Seg: Clone + 'static {
    /// The transport that reaches it.
    type T: Transport;
    /// The transport value.
    fn transport(&self) -> Self::T;
    /// `self[offset..offset + len]` as a transfer target.
    fn range(&self, offset: u64, len: u64) -> <Self::T as Transport>::Target;
}

impl Seg for RemoteSegment {
    type T = Tcp;
    fn transport(&self) -> Tcp {
        Tcp
    }
    fn range(&self, offset: u64, len: u64) -> RemoteRange {
        RemoteRange::new(self, offset, len)
    }
}

impl Seg for RdmaSegment {
    type T = Rdma;
    fn transport(&self) -> Rdma {
        Rdma
    }
    fn range(&self, offset: u64, len: u64) -> RdmaRange {
        RdmaRange::new(self, offset, len)
    }
}

/// Buffers a round moves: plain memory for TCP, leases of a registered
/// region for RDMA.
pub trait Buf: IoBuf + IoBufMut + DerefMut<Target = [u8]> {}
impl<B: IoBuf + IoBufMut + DerefMut<Target = [u8]>> Buf for B {}

/// The remote side of the scenario: the large segment and the refusing one.
#[derive(Clone)]
pub struct Remote<S> {
    /// Read-write segment that takes the valid transfer.
    pub kv: S,
    /// Segment that refuses the small transfer (read-only for writes,
    /// write-only for reads). Over RDMA the target's NIC refuses it (the
    /// memory region's access flags).
    pub refuse: S,
}

/// The buffers of one round, handed back with its result.
pub struct Bufs<B> {
    /// The large source (writes) or destination (reads).
    pub big: B,
    /// The 4 KiB buffer of the refused transfer.
    pub probe: B,
    /// Where the destination is read back into, in pieces.
    pub scratch: B,
}

/// The scenario's batch: the 4 KiB `probe` into the refusing segment,
/// then `src` over the start of `kv`.
pub fn seed_batch<S: Seg, B: IoBuf>(
    remote: &Remote<S>,
    probe: B,
    src: B,
    opts: BatchOptions,
) -> Batch<S::T, B> {
    let mut batch = Batch::new(remote.kv.transport(), opts);
    batch
        .write(probe, remote.refuse.range(0, 4096))
        .map_err(|r| r.reason)
        .unwrap();
    write_over_kv(&mut batch, remote, src);
    batch
}

/// A batch of one write: all of `src` over the start of `kv`.
pub fn one_write<S: Seg, B: IoBuf>(
    remote: &Remote<S>,
    src: B,
    opts: BatchOptions,
) -> Batch<S::T, B> {
    let mut batch = Batch::new(remote.kv.transport(), opts);
    write_over_kv(&mut batch, remote, src);
    batch
}

fn write_over_kv<S: Seg, B: IoBuf>(batch: &mut Batch<S::T, B>, remote: &Remote<S>, src: B) {
    let size = src.bytes_init() as u64;
    batch
        .write(src, remote.kv.range(0, size))
        .map_err(|r| r.reason)
        .unwrap();
}

/// Runs one write round.
pub async fn write_round<S: Seg, B: Buf>(
    remote: &Remote<S>,
    bufs: Bufs<B>,
    round: u32,
    opts: BatchOptions,
    settle: Duration,
) -> (Round, Bufs<B>) {
    let Bufs {
        big: mut src,
        mut probe,
        scratch,
    } = bufs;
    let pre = (round % 200) as u8 + 1;
    src.fill(pre);
    probe.fill(pre);
    let size = src.len() as u64;
    let batch = seed_batch(remote, probe, src, opts);
    let t0 = Instant::now();
    let outcome = batch.submit().await;
    let time_to_safe = t0.elapsed();
    let (kind, q) = resolve(outcome).await;
    let mut bufs = q.into_buffers();
    let mut src = bufs.next_back().expect("the large buffer");
    let probe = bufs.next_back().expect("the probe");
    // The caller reuses its buffer at once, as a serving runtime would.
    src.fill(POST_OUTCOME);
    sleep(settle).await;
    let (corrupted_bytes, scratch) = count_remote(&remote.kv, size, POST_OUTCOME, scratch).await;
    let round = Round {
        kind,
        time_to_safe,
        corrupted_bytes,
    };
    (
        round,
        Bufs {
            big: src,
            probe,
            scratch,
        },
    )
}

/// Runs one read round (the mirror).
pub async fn read_round<S: Seg, B: Buf>(
    remote: &Remote<S>,
    bufs: Bufs<B>,
    opts: BatchOptions,
    settle: Duration,
) -> (Round, Bufs<B>) {
    let Bufs {
        big: dst,
        probe,
        scratch,
    } = bufs;
    let size = dst.len() as u64;
    let mut batch = Batch::new(remote.kv.transport(), opts);
    batch
        .read(probe, remote.refuse.range(0, 4096))
        .map_err(|r| r.reason)
        .unwrap();
    batch
        .read(dst, remote.kv.range(0, size))
        .map_err(|r| r.reason)
        .unwrap();
    let t0 = Instant::now();
    let outcome = batch.submit().await;
    let time_to_safe = t0.elapsed();
    let (kind, q) = resolve(outcome).await;
    let mut bufs = q.into_buffers();
    let mut dst = bufs.next_back().expect("the large buffer");
    let probe = bufs.next_back().expect("the probe");
    dst.fill(POST_OUTCOME);
    sleep(settle).await;
    // Remote data landing in the buffer after the outcome would overwrite the marker.
    let corrupted_bytes = dst.iter().filter(|&&b| b != POST_OUTCOME).count();
    let round = Round {
        kind,
        time_to_safe,
        corrupted_bytes,
    };
    (
        round,
        Bufs {
            big: dst,
            probe,
            scratch,
        },
    )
}

/// The outcome's kind, and its quiescent result (waiting on a ticket).
async fn resolve<B>(outcome: Outcome<B>) -> (Kind, quiesce_batch::Quiesced<B>) {
    match outcome {
        Outcome::Quiesced(q) if q.all_completed() => (Kind::Completed, q),
        Outcome::Quiesced(q) => (Kind::Failed, q),
        Outcome::CompletionUnknown(t) => (Kind::Unknown, t.wait().await),
    }
}

/// Counts bytes equal to `b` in `seg[0..len]`, read back in pieces of
/// `scratch`'s size.
pub async fn count_remote<S: Seg, B: Buf>(seg: &S, len: u64, b: u8, scratch: B) -> (usize, B) {
    let piece = scratch.len() as u64;
    assert!(piece > 0, "empty scratch buffer");
    let mut n = 0;
    let mut buf = scratch;
    let mut off = 0;
    while off < len {
        let l = piece.min(len - off);
        let mut batch = Batch::new(seg.transport(), BatchOptions::default());
        batch
            .read(buf, seg.range(off, l))
            .map_err(|r| r.reason)
            .unwrap();
        let q = batch.submit().await.quiesced().await;
        assert!(
            q.all_completed(),
            "reading the destination back failed: {:?}",
            q.tasks()
        );
        buf = q.into_buffers().next_back().unwrap();
        n += buf[..l as usize].iter().filter(|&&x| x == b).count();
        off += l;
    }
    (n, buf)
}

/// The options of the seed scenario: fail fast, 10 s deadline, 1 s grace.
pub fn seed_options() -> BatchOptions {
    BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_secs(10))
        .fence_grace(Duration::from_secs(1))
}
