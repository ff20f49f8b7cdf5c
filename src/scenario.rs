//! The seed scenario from the Mooncake measurement, as a reusable routine:
//! a batch of [a 4 KiB write the target refuses, a valid large write], then
//! the returned source is overwritten and the destination is checked for the
//! overwrite. With quiesce no round can be corrupted: the source comes back
//! only once nothing reads it any more.

use std::time::{Duration, Instant};

use quiesce_batch::{Batch, BatchOptions, FailurePolicy, Outcome, RemoteRange, Tcp};
use quiesce_runtime::time::sleep;
use quiesce_transports::{AlignedBuf, RemoteSegment};

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

/// The remote side of the scenario: the large segment and the refusing one.
#[derive(Clone)]
pub struct Remote {
    /// Read-write segment that takes the valid transfer.
    pub kv: RemoteSegment,
    /// Segment that refuses the small transfer (read-only for writes,
    /// write-only for reads).
    pub refuse: RemoteSegment,
}

/// Runs one write round: returns the source buffer for the next round.
pub async fn write_round(
    remote: &Remote,
    mut src: AlignedBuf,
    round: u32,
    opts: BatchOptions,
    settle: Duration,
) -> (Round, AlignedBuf) {
    let pre = (round % 200) as u8 + 1;
    src.fill(pre);
    let size = src.len() as u64;
    let mut batch = Batch::new(Tcp, opts);
    batch
        .write(
            AlignedBuf::from_slice(&[pre; 4096]),
            RemoteRange::new(&remote.refuse, 0, 4096),
        )
        .map_err(|r| r.reason)
        .unwrap();
    batch
        .write(src, RemoteRange::new(&remote.kv, 0, size))
        .map_err(|r| r.reason)
        .unwrap();
    let t0 = Instant::now();
    let outcome = batch.submit().await;
    let time_to_safe = t0.elapsed();
    let (kind, q) = resolve(outcome).await;
    let mut bufs = q.into_buffers();
    let mut src = bufs.pop().expect("the large buffer");
    // The caller reuses its buffer at once, as a serving runtime would.
    src.fill(POST_OUTCOME);
    sleep(settle).await;
    let corrupted_bytes = count_remote(&remote.kv, size, POST_OUTCOME).await;
    (
        Round {
            kind,
            time_to_safe,
            corrupted_bytes,
        },
        src,
    )
}

/// Runs one read round (the mirror): returns the destination for the next round.
pub async fn read_round(
    remote: &Remote,
    dst: AlignedBuf,
    round: u32,
    opts: BatchOptions,
    settle: Duration,
) -> (Round, AlignedBuf) {
    let _ = round;
    let size = dst.len() as u64;
    let mut batch = Batch::new(Tcp, opts);
    batch
        .read(
            AlignedBuf::new(4096),
            RemoteRange::new(&remote.refuse, 0, 4096),
        )
        .map_err(|r| r.reason)
        .unwrap();
    batch
        .read(dst, RemoteRange::new(&remote.kv, 0, size))
        .map_err(|r| r.reason)
        .unwrap();
    let t0 = Instant::now();
    let outcome = batch.submit().await;
    let time_to_safe = t0.elapsed();
    let (kind, q) = resolve(outcome).await;
    let mut dst = q.into_buffers().pop().expect("the large buffer");
    dst.fill(POST_OUTCOME);
    sleep(settle).await;
    // Remote data landing in the buffer after the outcome would overwrite the marker.
    let corrupted_bytes = dst.iter().filter(|&&b| b != POST_OUTCOME).count();
    (
        Round {
            kind,
            time_to_safe,
            corrupted_bytes,
        },
        dst,
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

/// Counts bytes equal to `b` in `seg[0..len]` (read in 8 MiB pieces).
pub async fn count_remote(seg: &RemoteSegment, len: u64, b: u8) -> usize {
    const PIECE: u64 = 8 << 20;
    let mut n = 0;
    let mut buf = AlignedBuf::new(PIECE.min(len) as usize);
    let mut off = 0;
    while off < len {
        let l = PIECE.min(len - off);
        let mut batch = Batch::new(Tcp, BatchOptions::default());
        let dst = std::mem::replace(&mut buf, AlignedBuf::new(0));
        batch
            .read(dst, RemoteRange::new(seg, off, l))
            .map_err(|r| r.reason)
            .unwrap();
        let q = batch.submit().await.quiesced().await;
        assert!(
            q.all_completed(),
            "reading the destination back failed: {:?}",
            q.tasks()
        );
        buf = q.into_buffers().pop().unwrap();
        n += buf[..l as usize].iter().filter(|&&x| x == b).count();
        off += l;
    }
    n
}

/// The options of the seed scenario: fail fast, 10 s deadline, 1 s grace.
pub fn seed_options() -> BatchOptions {
    BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_secs(10))
        .fence_grace(Duration::from_secs(1))
}
