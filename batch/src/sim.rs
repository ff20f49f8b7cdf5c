//! A deterministic simulated transport, for testing the batch layer's
//! promises under schedules no real network produces on demand.
//!
//! Given a seed, every transfer takes a random number of reactor turns,
//! touches its buffer on each turn (like DMA), and ends completed, failed
//! (retryable or not), fenced, or — if its peer is aborted — lost. Fences are
//! slow or stuck at random. The simulator records what a checker needs:
//! transfers in flight, accesses to buffers that had been handed back, and
//! the order of attempts.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::rc::Rc;

use quiesce_runtime::{yield_now, IoBuf, IoBufMut};
use quiesce_transports::TransferError;

use crate::transport::Transport;

/// A small, fast, seedable generator (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// True with probability `p_percent`/100.
    pub fn chance(&mut self, p_percent: u64) -> bool {
        self.below(100) < p_percent
    }
}

/// How hostile the simulated world is.
#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    /// Peers the targets are spread over.
    pub peers: usize,
    /// Longest transfer, in reactor turns.
    pub max_turns: u64,
    /// Percent of transfers that fail with a retryable error.
    pub retryable_fail: u64,
    /// Percent of transfers that fail with a refusal.
    pub refused: u64,
    /// Percent of fences that never finish (only an abort ends their transfers).
    pub stuck_fence: u64,
    /// Percent of transfers that ignore fences (a peer that does not listen).
    pub deaf: u64,
    /// Percent of transfers that take many more turns to end after an abort
    /// (completions the kernel is slow to hand back).
    pub sticky: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            peers: 2,
            max_turns: 8,
            retryable_fail: 10,
            refused: 5,
            stuck_fence: 10,
            deaf: 10,
            sticky: 10,
        }
    }
}

/// Where a simulated task goes.
#[derive(Debug, Clone)]
pub struct SimTarget {
    /// The peer.
    pub peer: usize,
    /// Bytes.
    pub len: u64,
}

/// A buffer the simulator can watch.
#[derive(Debug)]
pub struct SimBuf {
    /// Which buffer (the test's index).
    pub id: usize,
    data: Vec<u8>,
    /// Set by the checker once the buffer is back with the caller.
    pub returned: Rc<Cell<bool>>,
}

impl SimBuf {
    /// A buffer of `len` bytes with id `id`.
    pub fn new(id: usize, len: usize) -> SimBuf {
        SimBuf {
            id,
            data: vec![0; len],
            returned: Rc::default(),
        }
    }
}

// SAFETY: delegates to a Vec, whose heap storage never moves.
unsafe impl IoBuf for SimBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.data.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.data.len()
    }
    fn bytes_total(&self) -> usize {
        self.data.len()
    }
}

// SAFETY: as above; the Vec is fully initialised.
unsafe impl IoBufMut for SimBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.data.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// What the simulator saw.
#[derive(Debug, Default)]
pub struct SimLog {
    /// Transfers in flight now.
    pub in_flight: usize,
    /// Accesses to a buffer already handed back to the caller.
    pub access_after_return: usize,
    /// `(wire batch, buffer address)` of every transfer started, in order.
    pub starts: Vec<(u64, usize)>,
    /// Wire batches with a transfer in flight now, and how many.
    pub live: HashMap<u64, usize>,
    /// A transfer of a new wire batch started while an older one of the
    /// same batch had transfers in flight (a retry before quiescence).
    pub retry_before_quiescence: usize,
    /// `(peer, wire batch, buffer address)` of transfers that ended without
    /// the peer's answer (a lost connection): their bytes may still land
    /// there until a fence of that wire batch is confirmed at that peer.
    pub residue: HashSet<(usize, u64, usize)>,
    /// A transfer of a new wire batch started while an older wire batch
    /// still had unconfirmed residue at some peer (a retry over bytes that
    /// may still land).
    pub retry_over_residue: usize,
}

struct Inner {
    cfg: SimConfig,
    rng: RefCell<Rng>,
    fenced: RefCell<HashSet<(usize, u64)>>,
    aborts: RefCell<Vec<u64>>,
    log: RefCell<SimLog>,
    /// Wire batches of each logical batch seen, to detect early retries.
    last_wire: Cell<Option<u64>>,
}

/// The simulated transport (one per schedule).
#[derive(Clone)]
pub struct Sim {
    inner: Rc<Inner>,
}

impl Sim {
    /// A simulator seeded with `seed`.
    pub fn new(seed: u64, cfg: SimConfig) -> Sim {
        Sim {
            inner: Rc::new(Inner {
                cfg,
                rng: RefCell::new(Rng::new(seed)),
                fenced: RefCell::default(),
                aborts: RefCell::new(vec![0; cfg.peers.max(1)]),
                log: RefCell::default(),
                last_wire: Cell::new(None),
            }),
        }
    }

    /// The log so far.
    pub fn log(&self) -> std::cell::Ref<'_, SimLog> {
        self.inner.log.borrow()
    }

    /// True if `peer` acknowledged a fence of wire batch `wire`.
    pub fn fence_confirmed(&self, peer: usize, wire: u64) -> bool {
        self.inner.fenced.borrow().contains(&(peer, wire))
    }

    fn roll(&self, n: u64) -> u64 {
        self.inner.rng.borrow_mut().below(n)
    }

    fn chance(&self, p: u64) -> bool {
        self.inner.rng.borrow_mut().chance(p)
    }

    fn transfer<B: IoBuf>(
        &self,
        t: &SimTarget,
        buf: B,
        wire: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> {
        let sim = self.clone();
        let t = t.clone();
        let turns = 1 + self.roll(self.inner.cfg.max_turns);
        let deaf = self.chance(self.inner.cfg.deaf);
        let sticky = self.chance(self.inner.cfg.sticky);
        let outcome = self.roll(100);
        async move {
            let inner = &sim.inner;
            // A buffer's identity: the simulator only sees IoBuf, so it keys
            // accesses on the address of its bytes, which SimBuf never moves.
            let returned = probe_returned(&buf);
            {
                let mut log = inner.log.borrow_mut();
                if let Some(prev) = inner.last_wire.get() {
                    if prev != wire && log.live.get(&prev).copied().unwrap_or(0) > 0 {
                        log.retry_before_quiescence += 1;
                    }
                }
                inner.last_wire.set(Some(wire));
                let fenced = inner.fenced.borrow();
                if log
                    .residue
                    .iter()
                    .any(|&(p, w, _)| w != wire && !fenced.contains(&(p, w)))
                {
                    log.retry_over_residue += 1;
                }
                drop(fenced);
                log.in_flight += 1;
                *log.live.entry(wire).or_default() += 1;
                log.starts.push((wire, buf.stable_ptr() as usize));
            }
            let abort_epoch = inner.aborts.borrow()[t.peer];
            let mut res = Ok(t.len);
            let mut turn = 0;
            let mut aborted_at = None;
            loop {
                yield_now().await;
                turn += 1;
                // The "DMA" touches the buffer on every turn.
                if returned.as_ref().is_some_and(|r| r.get()) {
                    inner.log.borrow_mut().access_after_return += 1;
                }
                if inner.aborts.borrow()[t.peer] != abort_epoch {
                    let at = *aborted_at.get_or_insert(turn);
                    // A sticky transfer's completion takes a while to come back.
                    if !sticky || turn >= at + turns * 4 + 8 {
                        res = Err(TransferError::ConnectionLost("peer aborted".into()));
                        break;
                    }
                    continue;
                }
                if !deaf && inner.fenced.borrow().contains(&(t.peer, wire)) {
                    res = Err(if turn > 1 {
                        TransferError::FencedPartial { landed: t.len / 2 }
                    } else {
                        TransferError::Fenced
                    });
                    break;
                }
                if turn >= turns && !(deaf && turn < turns * 50) {
                    break;
                }
            }
            if res.is_ok() {
                let c = &inner.cfg;
                if outcome < c.retryable_fail {
                    res = Err(TransferError::ConnectionLost("simulated".into()));
                } else if outcome < c.retryable_fail + c.refused {
                    res = Err(TransferError::Forbidden(0));
                }
            }
            {
                let mut log = inner.log.borrow_mut();
                log.in_flight -= 1;
                *log.live.get_mut(&wire).expect("registered") -= 1;
                if res.as_ref().is_err_and(|e| !e.settles_remote()) {
                    log.residue
                        .insert((t.peer, wire, buf.stable_ptr() as usize));
                }
            }
            (res, buf)
        }
    }
}

thread_local! {
    /// Buffers the checker watches, by the address of their bytes.
    static WATCHED: RefCell<HashMap<usize, Rc<Cell<bool>>>> = RefCell::new(HashMap::new());
}

/// Lets the simulator see `buf`'s "returned" flag (call before submitting).
pub fn watch(buf: &SimBuf) {
    WATCHED.with(|w| {
        w.borrow_mut()
            .insert(buf.data.as_ptr() as usize, buf.returned.clone())
    });
}

/// Forgets every watched buffer.
pub fn unwatch_all() {
    WATCHED.with(|w| w.borrow_mut().clear());
}

fn probe_returned<B: IoBuf>(buf: &B) -> Option<Rc<Cell<bool>>> {
    WATCHED.with(|w| w.borrow().get(&(buf.stable_ptr() as usize)).cloned())
}

impl Transport for Sim {
    type Target = SimTarget;
    type Peer = usize;

    fn peer(&self, t: &SimTarget) -> usize {
        t.peer
    }

    fn len(&self, t: &SimTarget) -> u64 {
        t.len
    }

    fn write<B: IoBuf>(
        &self,
        t: &SimTarget,
        src: B,
        wire: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        self.transfer(t, src, wire)
    }

    fn read<B: IoBufMut>(
        &self,
        t: &SimTarget,
        dst: B,
        wire: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        self.transfer(t, dst, wire)
    }

    fn fence(
        &self,
        peer: &usize,
        wire: u64,
    ) -> impl Future<Output = Result<(), TransferError>> + 'static {
        // Weak: a fence that outlives its schedule (a stuck one whose batch
        // quiesced without an abort) must end with it, not spin forever.
        let sim = Rc::downgrade(&self.inner);
        let peer = *peer;
        let stuck = self.chance(self.inner.cfg.stuck_fence);
        let turns = self.roll(self.inner.cfg.max_turns);
        let epoch = self.inner.aborts.borrow()[peer];
        let lost = || Err(TransferError::ConnectionLost("aborted".into()));
        async move {
            if stuck {
                // Never confirms; only an abort (which also ends the peer's
                // transfers) or the end of the schedule ends it.
                loop {
                    match sim.upgrade() {
                        Some(s) if s.aborts.borrow()[peer] == epoch => yield_now().await,
                        _ => return lost(),
                    }
                }
            }
            for _ in 0..turns {
                yield_now().await;
            }
            match sim.upgrade() {
                Some(s) => {
                    s.fenced.borrow_mut().insert((peer, wire));
                    Ok(())
                }
                None => lost(),
            }
        }
    }

    fn abort(&self, peer: &usize) {
        self.inner.aborts.borrow_mut()[*peer] += 1;
    }
}

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
}

/// Builds a random batch from `seed`, runs it on the simulator, and checks
/// the batch layer's promises: no outcome before every transfer ended; every
/// buffer back exactly once; no access to a buffer after it was handed back;
/// retries only after quiescence and only once every earlier attempt's
/// residue is confirmed fenced; no task claims remote confirmation that no
/// fence gave. Call inside a runtime.
pub async fn check_schedule(seed: u64) -> Result<ScheduleStats, Violation> {
    use std::time::Duration;

    use crate::{Batch, BatchOptions, FailurePolicy, Outcome};

    let mut rng = Rng::new(seed ^ 0x5eed);
    let cfg = SimConfig {
        peers: 1 + rng.below(3) as usize,
        max_turns: 1 + rng.below(12),
        retryable_fail: rng.below(25),
        refused: rng.below(10),
        stuck_fence: rng.below(30),
        deaf: rng.below(20),
        sticky: rng.below(30),
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
    }
    stats.completed = q.all_completed();
    stats.fenced = q.fence_time().is_some();
    stats.retried = q.tasks().iter().any(|t| t.attempts > 1);
    if q.tasks()
        .iter()
        .any(|t| t.attempts > opts.retry.attempts + 1)
    {
        return fail("more attempts than allowed");
    }
    // Back with the caller: the simulated DMA must never touch them again.
    flags.iter().for_each(|f| f.set(true));
    for _ in 0..cfg.max_turns * 2 {
        yield_now().await;
    }
    let log = sim.log();
    if log.access_after_return > 0 {
        return fail("a buffer was accessed after it was handed back");
    }
    if log.retry_before_quiescence > 0 {
        return fail("a retry started before the batch quiesced");
    }
    drop(log);
    drop(q);
    unwatch_all();
    Ok(stats)
}
