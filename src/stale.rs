//! The stale-bytes scenario: a write batch that resolves without its
//! target's confirmation, a second writer, and what lands after both.
//!
//! Batch A writes `0xA1` over the whole `kv` segment of a `quiesce target`
//! process that is stopped (SIGSTOP) mid-transfer; its fence cannot be
//! acknowledged, so A resolves with `remote_confirmed() == false`. The target
//! resumes — and, in the `revoke` variant, its owner revokes `kv` — then
//! batch B, from another engine, rewrites the segment with `0xB2` and
//! completes. Any `0xA1` found afterwards is a byte of A that landed over B.
//!
//! Over the local transport A's buffer stays lent while the target is
//! stopped (the target itself would copy it), so A's outcome is taken before
//! the target resumes and A quiesces only after B — the order in which a
//! caller meets them.

use std::time::Duration;

use quiesce_batch::{Batch, BatchOptions, FailurePolicy, Outcome, RemoteRange, Tcp};
use quiesce_runtime::time::sleep;
use quiesce_transports::{AlignedBuf, Engine, EngineConfig, LocalMode, RemoteSegment};

use crate::scenario::count_remote;
use crate::target_child::TargetChild;

/// What one round saw.
#[derive(Debug, Clone, Copy)]
pub struct StaleRound {
    /// A's outcome claimed the target confirmed it although A did not
    /// complete (it must not: the target was stopped).
    pub a_confirmed: bool,
    /// A completed before the stop took hold (a small `size` can): the round
    /// tested nothing.
    pub a_completed: bool,
    /// Bytes of A found over B's, 200 ms after B completed.
    pub stale_bytes: usize,
}

async fn open_kv(
    t: &TargetChild,
    local: LocalMode,
) -> Result<(Engine, RemoteSegment), Box<dyn std::error::Error>> {
    let e = Engine::bind(EngineConfig {
        local,
        ..EngineConfig::default()
    })?;
    let kv = e.connect(t.addr).await?.open("kv", t.tokens["kv"]).await?;
    Ok((e, kv))
}

/// Runs one round against `t`, whose `kv` segment is `size` bytes, over
/// TCP (`LocalMode::Off`) or the local transport.
pub async fn stale_bytes_round(
    t: &mut TargetChild,
    size: usize,
    revoke: bool,
    local: LocalMode,
) -> Result<StaleRound, Box<dyn std::error::Error>> {
    let (ea, kv_a) = open_kv(t, local).await?;
    let opts = BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_millis(20))
        .fence_grace(Duration::from_millis(100));
    let mut a = Batch::new(Tcp, opts);
    a.write(vec![0xA1; size], RemoteRange::new(&kv_a, 0, size as u64))
        .map_err(|r| r.reason)?;
    let sub = a.submit();
    sleep(Duration::from_millis(3)).await;
    t.signal(libc::SIGSTOP)?;
    let outcome = sub.await;
    let (a_completed, a_confirmed, pending_a) = match outcome {
        Outcome::Quiesced(q) => (
            q.all_completed(),
            q.remote_confirmed() && !q.all_completed(),
            None,
        ),
        // TCP: A's buffer is A's own once its local operations are reaped,
        // target stopped or not. Local: not before the target lets go.
        Outcome::CompletionUnknown(_) if local == LocalMode::Off => {
            let q = outcome.quiesced().await;
            (
                q.all_completed(),
                q.remote_confirmed() && !q.all_completed(),
                None,
            )
        }
        unknown => (false, false, Some(unknown)),
    };
    t.signal(libc::SIGCONT)?;
    if revoke {
        t.revoke("kv")?;
    }
    let (eb, kv_b) = open_kv(t, local).await?;
    let mut b = Batch::new(Tcp, BatchOptions::default());
    b.write(vec![0xB2; size], RemoteRange::new(&kv_b, 0, size as u64))
        .map_err(|r| r.reason)?;
    let qb = b.submit().await.quiesced().await;
    if !qb.all_completed() {
        return Err(format!("the second writer failed: {:?}", qb.tasks()).into());
    }
    sleep(Duration::from_millis(200)).await;
    let (stale_bytes, _) = count_remote(&kv_b, size as u64, 0xA1, AlignedBuf::new(8 << 20)).await;
    if let Some(a) = pending_a {
        a.quiesced().await;
    }
    ea.shutdown();
    eb.shutdown();
    Ok(StaleRound {
        a_confirmed,
        a_completed,
        stale_bytes,
    })
}
