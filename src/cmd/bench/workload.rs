//! The workloads every initiator runs, and what one iteration measures:
//! the cases, the quiesce loops (through a batch, or the transport alone)
//! and the sample each iteration leaves.

use std::time::{Duration, Instant};

use quiesce::batch::{Batch, BatchOptions, FailurePolicy};
use quiesce::scenario::{Buf, Seg};

/// The loop every quiesce initiator runs, over TCP or RDMA: one batch per
/// iteration (with the refused 4 KiB probe first for fail-fast), timed from
/// building the batch to its buffers back in hand — as the raw and tokio
/// loops time building their frames, sending and the answers.
pub async fn batch_loop<S: Seg, B: Buf>(
    kv: &S,
    ro: Option<&S>,
    case: Case,
    iters: usize,
    mut bufs: Vec<B>,
    mut small: Option<B>,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    let task_size = match case {
        Case::Batch { size, .. } => size,
        _ => case.size(),
    };
    let mut out = Vec::with_capacity(iters);
    for _ in 0..iters {
        let a0 = allocations();
        let t0 = Instant::now();
        let opts = match case {
            Case::FailFast(_) => BatchOptions::default().policy(FailurePolicy::FailFast),
            _ => BatchOptions::default(),
        };
        let mut batch = Batch::new(kv.transport(), opts);
        if let Some(ro) = ro {
            let small = small.take().expect("returned by the last round");
            batch
                .write(small, ro.range(0, 4096))
                .map_err(|r| r.reason)?;
        }
        for (i, b) in bufs.drain(..).enumerate() {
            let range = kv.range((i * task_size) as u64, task_size as u64);
            match case {
                Case::Read(_) => batch.read(b, range),
                _ => batch.write(b, range),
            }
            .map_err(|r| r.reason)?;
        }
        let q = batch.submit().await.quiesced().await;
        let fence = q.fence_time();
        match case {
            Case::FailFast(_) if q.all_completed() => {
                return Err("the target took the write the fail-fast case needs refused".into())
            }
            Case::FailFast(_) => {}
            _ => {
                if let Some(t) = q
                    .tasks()
                    .iter()
                    .find(|t| t.status != quiesce::batch::TaskStatus::Completed)
                {
                    return Err(format!("the target refused a transfer: {:?}", t.status).into());
                }
            }
        }
        // What moved: a fail-fast batch fences its large write part-way,
        // and throughput counts only the bytes that landed.
        let bytes = q.tasks().iter().map(|t| t.bytes).sum();
        let mut back = q.into_buffers();
        if ro.is_some() {
            small = back.next();
        }
        // Into the vector drained above: its room is still there.
        bufs.extend(back);
        let took = t0.elapsed();
        out.push(Sample {
            took,
            bytes,
            fence,
            allocs: allocations() - a0,
        });
    }
    Ok(out)
}

/// `iters` single writes or reads (`case`) of `len` bytes in `buf` through
/// a transport alone (`--impl direct`): `op(read, buf, wire)` makes one,
/// each its own wire batch, as a batch's would be. What it costs without
/// the batch layer.
pub async fn direct_loop<B, F, Fut>(
    case: Case,
    iters: usize,
    mut buf: B,
    len: u64,
    mut op: F,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>>
where
    F: FnMut(bool, B, u64) -> Fut,
    Fut: std::future::Future<Output = (Result<u64, quiesce::transports::TransferError>, B)>,
{
    let read = match case {
        Case::Read(_) => true,
        Case::Write(_) => false,
        _ => return Err("--impl direct runs single writes and reads".into()),
    };
    let mut out = Vec::with_capacity(iters);
    for i in 0..iters {
        let a0 = allocations();
        let t0 = Instant::now();
        let (r, b) = op(read, buf, 1 + i as u64).await;
        let took = t0.elapsed();
        r?;
        buf = b;
        out.push(Sample {
            took,
            bytes: len,
            fence: None,
            allocs: allocations() - a0,
        });
    }
    Ok(out)
}

/// One workload.
#[derive(Debug, Clone, Copy)]
pub enum Case {
    Write(usize),
    Read(usize),
    Batch {
        tasks: usize,
        size: usize,
    },
    /// [4 KiB write the target refuses + a valid write of this size], fail-fast.
    FailFast(usize),
}

impl Case {
    /// Bytes of local buffer one iteration needs.
    pub fn size(&self) -> usize {
        match *self {
            Case::Write(s) | Case::Read(s) | Case::FailFast(s) => s,
            Case::Batch { tasks, size } => tasks * size,
        }
    }

    /// Payload bytes one iteration asks to move.
    pub fn bytes(&self) -> u64 {
        self.size() as u64
    }

    pub fn name(&self) -> String {
        let sz = |s: usize| {
            if s >= 1 << 20 {
                format!("{}m", s >> 20)
            } else {
                format!("{}k", s >> 10)
            }
        };
        match *self {
            Case::Write(s) => format!("write_{}", sz(s)),
            Case::Read(s) => format!("read_{}", sz(s)),
            Case::Batch { tasks, size } => format!("batch_{tasks}x{}", sz(size)),
            Case::FailFast(s) => format!("fail_fast_{}", sz(s)),
        }
    }

    /// Iterations of one turn in `--compare`: a few milliseconds.
    pub(super) fn chunk(&self) -> usize {
        match self.size() {
            s if s <= 4096 => 100,
            s if s <= 64 << 10 => 50,
            s if s <= 1 << 20 => 10,
            s if s <= 4 << 20 => 2,
            _ => 1,
        }
    }

    pub(super) fn default_iters(&self) -> usize {
        match self.size() {
            s if s <= 4096 => 2000,
            s if s <= 64 << 10 => 1000,
            s if s <= 1 << 20 => 200,
            s if s <= 4 << 20 => 50,
            _ => 8,
        }
    }
}

/// One iteration.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub took: Duration,
    pub bytes: u64,
    /// quiesce: from the failure to the safe outcome (the fence).
    pub fence: Option<Duration>,
    /// Heap allocations this process made in the iteration, from building
    /// the batch (or frame) to holding the buffers again.
    pub allocs: u64,
}

impl Sample {
    /// An iteration of `case` without a fence that started at `t0` with
    /// `a0` allocations made (the hand-written initiators).
    pub fn unfenced(case: Case, t0: Instant, a0: u64) -> Sample {
        let took = t0.elapsed();
        Sample {
            took,
            bytes: case.bytes(),
            fence: None,
            allocs: allocations() - a0,
        }
    }
}

/// Heap allocations this process has made (the `quiesce` binary's counting
/// allocator). Only the measured initiator runs while a chunk does, so a
/// difference around one iteration is that iteration's.
pub fn allocations() -> u64 {
    quiesce::runtime::heap::Heap::now().allocations
}
