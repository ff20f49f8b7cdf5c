//! [`check_schedule`]: one random batch on the simulator, and the checks of
//! every promise the batch layer makes.

use quiesce_runtime::{spawn_local, yield_now, IoBuf};

use super::{unwatch_all, watch, Rng, Sim, SimBuf, SimConfig, SimLog, SimTarget};

/// One checked schedule: what went wrong, if anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation(pub String);

/// What one schedule did (for counting).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScheduleStats {
    /// The outcome was `CompletionUnknown` first.
    pub unknown: bool,
    /// Every task completed.
    pub completed: bool,
    /// The batch fenced.
    pub fenced: bool,
    /// Tasks were retried.
    pub retried: bool,
    /// The batch future was dropped in flight.
    pub dropped: bool,
    /// A target revoked its grant while the batch ran, and a task saw it.
    pub revoked: bool,
}

/// Builds a random batch from `seed`, runs it on the simulator, and checks
/// the batch layer's promises: no outcome before every transfer ended; every
/// buffer back exactly once; no access to a buffer after it was handed back;
/// retries only after quiescence and only once every earlier attempt's
/// residue is confirmed fenced; no task claims remote confirmation that no
/// fence gave, and no byte of a task that claims it lands after the outcome;
/// a task's reported bytes are what its target said landed; no byte lands
/// under a grant after its revoke resolved. Call inside a runtime.
pub async fn check_schedule(seed: u64) -> Result<ScheduleStats, Violation> {
    use std::time::Duration;

    use crate::{Batch, BatchOptions, FailurePolicy, Outcome};
    use quiesce_transports::TransferError;

    let mut rng = Rng::new(seed ^ 0x5eed);
    let cfg = SimConfig {
        peers: 1 + rng.below(3) as usize,
        max_turns: 1 + rng.below(12),
        retryable_fail: rng.below(25),
        refused: rng.below(10),
        stuck_fence: rng.below(30),
        deaf: rng.below(20),
        sticky: rng.below(30),
        residue_delay: 1 + rng.below(60),
    };
    let sim = Sim::new(seed, cfg);
    let mut opts = BatchOptions::default()
        .policy(if rng.chance(50) {
            FailurePolicy::FailFast
        } else {
            FailurePolicy::Drain
        })
        .fence_grace(Duration::from_micros(100 + rng.below(1500)))
        .retry(rng.below(3) as u32, Duration::from_micros(rng.below(50)));
    if rng.chance(20) {
        opts = opts.deadline(Duration::from_micros(rng.below(1500)));
    }
    // Mostly small batches (transfers polled inline by the driver), some
    // large ones (a task per transfer).
    let n = if rng.chance(10) {
        17 + rng.below(8)
    } else {
        1 + rng.below(8)
    } as usize;
    let mut batch = Batch::new(sim.clone(), opts);
    let mut flags = Vec::new();
    let mut peers = Vec::new();
    for id in 0..n {
        let len = 1 + rng.below(64) as usize;
        let buf = SimBuf::new(id, len);
        watch(&buf);
        flags.push(buf.returned.clone());
        let t = SimTarget {
            peer: rng.below(cfg.peers as u64) as usize,
            len: len as u64,
        };
        peers.push(t.peer);
        let added = if rng.chance(50) {
            batch.write(buf, t)
        } else {
            batch.read(buf, t)
        };
        if added.is_err() {
            return Err(Violation(format!("seed {seed}: a valid task was rejected")));
        }
    }
    let sub = batch.submit();
    let mut stats = ScheduleStats::default();
    if rng.chance(15) {
        // A target revokes mid-schedule (the decode worker reusing pages).
        let (peer, after) = (rng.below(cfg.peers as u64) as usize, rng.below(16));
        let revoke = sim.revoke_later(peer, after);
        spawn_local(revoke);
    }
    let fail = |what: &str| Err(Violation(format!("seed {seed}: {what}")));

    if rng.chance(5) {
        // Dropped in flight: it must drain on its own, touching nothing after.
        for _ in 0..rng.below(4) {
            yield_now().await;
        }
        drop(sub);
        stats.dropped = true;
        let t0 = std::time::Instant::now();
        while sim.log().in_flight > 0 {
            if t0.elapsed() > Duration::from_secs(10) {
                return fail("a dropped batch never drained");
            }
            yield_now().await;
        }
        // Dropped, it still fences and retires on its own: the same rules.
        if let Some(broken) = broken_rule(&sim.log()) {
            return fail(&format!("dropped: {broken}"));
        }
        unwatch_all();
        return Ok(stats);
    }

    let outcome = sub.await;
    let q = match outcome {
        Outcome::Quiesced(q) => q,
        Outcome::CompletionUnknown(t) => {
            stats.unknown = true;
            // Bounded waits hand the ticket back (still holding the buffers)
            // until the batch drains.
            let mut t = t;
            loop {
                if t.is_quiesced() && sim.log().in_flight > 0 {
                    return fail("ticket quiesced with transfers in flight");
                }
                match t.wait_for(std::time::Duration::from_micros(100)).await {
                    Ok(q) => break q,
                    Err(back) => t = back,
                }
            }
        }
    };
    // When the quiescent result (and its claims about the targets) exists;
    // a `CompletionUnknown` claims nothing about them.
    let outcome_at = sim.now();
    // Back with the caller from here: the simulated DMA must never touch
    // them again (checked after more turns, below, on its own).
    flags.iter().for_each(|f| f.set(true));
    if sim.log().in_flight != 0 {
        return fail("outcome before every transfer ended");
    }
    let mut ids: Vec<usize> = q.buffers().iter().map(|b| b.id).collect();
    ids.sort_unstable();
    if ids != (0..n).collect::<Vec<_>>() {
        return fail(&format!("buffers not returned exactly once: {ids:?}"));
    }
    if q.tasks().len() != n {
        return fail("a report per task");
    }
    // Remote confirmation: a task whose last attempt left residue at its peer
    // must not claim the peer confirmed it, unless a fence of that wire batch
    // was acknowledged there.
    {
        let log = sim.log();
        for (i, (report, buf)) in q.tasks().iter().zip(q.buffers()).enumerate() {
            let addr = buf.stable_ptr() as usize;
            let Some(&(wire, _)) = log.starts.iter().rev().find(|(_, a)| *a == addr) else {
                continue;
            };
            let peer = peers[buf.id];
            if log.residue.contains(&(peer, wire, addr))
                && !sim.fence_confirmed(peer, wire)
                && report.remote != crate::RemoteState::Unconfirmed
            {
                return fail(&format!(
                    "task {i} claims {:?} without an acknowledged fence",
                    report.remote
                ));
            }
        }
        if log.retry_over_residue > 0 {
            return fail("a retry started while an earlier attempt's bytes could still land");
        }
        // Truthful reports: what the target answered is what the task says.
        for (i, (report, buf)) in q.tasks().iter().zip(q.buffers()).enumerate() {
            let addr = buf.stable_ptr() as usize;
            let Some(&(wire, _)) = log.starts.iter().rev().find(|(_, a)| *a == addr) else {
                continue;
            };
            if report.remote != crate::RemoteState::Answered {
                continue;
            }
            match log.answered.get(&(wire, addr)) {
                Some(&landed) if landed == report.bytes => {}
                said => {
                    return fail(&format!(
                        "task {i} reports {} bytes, its target answered {said:?}",
                        report.bytes
                    ))
                }
            }
        }
    }
    stats.revoked = q.tasks().iter().any(|t| {
        matches!(
            t.status,
            crate::TaskStatus::Failed(TransferError::Revoked { .. })
        )
    });
    stats.completed = q.all_completed();
    stats.fenced = q.fence_time().is_some();
    stats.retried = q.tasks().iter().any(|t| t.attempts > 1);
    if q.tasks()
        .iter()
        .any(|t| t.attempts > opts.retry.attempts + 1)
    {
        return fail("more attempts than allowed");
    }
    for _ in 0..cfg.max_turns * 2 {
        yield_now().await;
    }
    // Let every residue land (or be refused) at the targets.
    while sim.residue_pending() > 0 {
        sim.tick();
    }
    let log = sim.log();
    // A task that claims its target confirmed (answered, or fenced) has no
    // byte landing there after the outcome.
    for (i, (report, buf)) in q.tasks().iter().zip(q.buffers()).enumerate() {
        let addr = buf.stable_ptr() as usize;
        let peer = peers[buf.id];
        if report.remote == crate::RemoteState::Unconfirmed {
            continue;
        }
        if let Some(l) = log
            .landings
            .iter()
            .find(|l| l.peer == peer && l.addr == addr && l.at > outcome_at)
        {
            return fail(&format!(
                "task {i} claims {:?}, yet its bytes landed after the outcome: {l:?}",
                report.remote
            ));
        }
    }
    if let Some(broken) = broken_rule(&log) {
        return fail(broken);
    }
    drop(log);
    drop(q);
    unwatch_all();
    Ok(stats)
}

/// The first rule the schedule's log shows broken, of those every batch
/// keeps — handed back or dropped.
fn broken_rule(log: &SimLog) -> Option<&'static str> {
    [
        (
            log.retry_over_residue,
            "a retry started while an earlier attempt's bytes could still land",
        ),
        (
            log.retry_before_quiescence,
            "a retry started before the batch quiesced",
        ),
        (
            log.retired_before_fence_answered,
            "a wire batch was retired while its fence was on its way",
        ),
        (
            log.landed_after_revoke,
            "bytes landed under a revoked grant after the revoke resolved",
        ),
        (
            log.access_after_return,
            "a buffer was accessed after it was handed back",
        ),
    ]
    .into_iter()
    .find(|&(n, _)| n > 0)
    .map(|(_, what)| what)
}
