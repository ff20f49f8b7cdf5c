//! A deterministic simulated transport, for testing the batch layer's
//! promises under schedules no real network produces on demand.
//!
//! Given a seed, every transfer takes a random number of reactor turns,
//! touches its buffer on each turn (like DMA), and ends completed, failed
//! (retryable or not), fenced, revoked, or — if its peer is aborted — lost.
//! Fences are slow or stuck at random.
//!
//! The targets are modelled too. A write lands bytes at its peer on each
//! turn. A write that ends without the target's answer (a lost connection)
//! leaves **residue**: bytes already in the target's kernel that land some
//! turns later — after the outcome — unless a fence of that wire batch was
//! acknowledged there first, or the target revoked the segment since (the
//! landing is then refused). A target may **revoke** mid-schedule
//! ([`Sim::revoke`]): from then on writes under its old grant are refused
//! (reads are not), a write's chunk in progress still lands, the revoke
//! resolves once none is left, and from then on no byte written under
//! that grant may land there — a check that fails if the revoke resolved
//! early. A refused transfer (`Forbidden`) touches nothing; a fence over
//! a connection that was aborted fails, as a real one does.
//!
//! The simulator records what a checker ([`check_schedule`]) needs:
//! transfers in flight, accesses to buffers that had been handed back, the
//! order of attempts, every landing and what each answered transfer said
//! had landed.

mod check;
mod target;

pub use check::{check_schedule, ScheduleStats, Violation};
pub use target::Landing;
use target::{land, tick, Residue};

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
    /// Longest delay, in turns of the simulated clock, before a lost
    /// write's residue lands at its target.
    pub residue_delay: u64,
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
            residue_delay: 40,
        }
    }
}

impl SimConfig {
    /// One peer whose transfers all complete, each after 1 to `max_turns`
    /// reactor turns: no failure, no slow fence, no residue.
    pub fn reliable(max_turns: u64) -> Self {
        SimConfig {
            peers: 1,
            max_turns,
            retryable_fail: 0,
            refused: 0,
            stuck_fence: 0,
            deaf: 0,
            sticky: 0,
            residue_delay: 0,
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
    /// `(peer, wire batch, buffer address)` of writes that ended without
    /// the peer's answer (a lost connection): their bytes may still land
    /// there until a fence of that wire batch is confirmed at that peer.
    pub residue: HashSet<(usize, u64, usize)>,
    /// A transfer of a new wire batch started while an older wire batch
    /// still had unconfirmed residue at some peer (a retry over bytes that
    /// may still land).
    pub retry_over_residue: usize,
    /// Every write's bytes landing at its target, in clock order.
    pub landings: Vec<Landing>,
    /// Bytes that landed at a peer after its revoke had resolved, written
    /// under the grant it revoked.
    pub landed_after_revoke: usize,
    /// What the target said had landed (or been sent, for a read), for each
    /// `(wire batch, buffer address)` whose transfer it answered.
    pub answered: HashMap<(u64, usize), u64>,
    /// `(peer, clock)` of every revoke that resolved.
    pub revokes: Vec<(usize, u64)>,
    /// `(peer, wire batch)` of every fence sent and not yet answered.
    pub fences_out: HashSet<(usize, u64)>,
    /// Wire batches retired at a peer while a fence of theirs was still on
    /// its way there (the target's entry that fence makes is never
    /// forgotten).
    pub retired_before_fence_answered: usize,
}

struct Inner {
    cfg: SimConfig,
    rng: RefCell<Rng>,
    fenced: RefCell<HashSet<(usize, u64)>>,
    aborts: RefCell<Vec<u64>>,
    log: RefCell<SimLog>,
    /// Wire batches of each logical batch seen, to detect early retries.
    last_wire: Cell<Option<u64>>,
    /// The simulated clock: one tick per transfer or fence turn (and per
    /// [`Sim::tick`]).
    clock: Cell<u64>,
    /// Per peer: whether the target revoked the grant every transfer uses.
    revoked: RefCell<Vec<bool>>,
    /// Per peer: whether that revoke resolved.
    revoke_done: RefCell<Vec<bool>>,
    /// Per peer: writes in flight under the old grant.
    writing: RefCell<Vec<usize>>,
    residue: RefCell<Vec<Residue>>,
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
                clock: Cell::new(0),
                revoked: RefCell::new(vec![false; cfg.peers.max(1)]),
                revoke_done: RefCell::new(vec![false; cfg.peers.max(1)]),
                writing: RefCell::new(vec![0; cfg.peers.max(1)]),
                residue: RefCell::default(),
            }),
        }
    }

    /// The simulated clock.
    pub fn now(&self) -> u64 {
        self.inner.clock.get()
    }

    /// Advances the clock by one tick and lands the residue that is due.
    pub fn tick(&self) {
        tick(&self.inner);
    }

    /// Residue that has not landed (or been refused) yet.
    pub fn residue_pending(&self) -> usize {
        self.inner.residue.borrow().len()
    }

    /// [`revoke`](Self::revoke) after `turns` reactor turns.
    pub fn revoke_later(&self, peer: usize, turns: u64) -> impl Future<Output = ()> + 'static {
        let sim = Rc::downgrade(&self.inner);
        async move {
            for _ in 0..turns {
                yield_now().await;
            }
            // Only the weak reference is held across the wait.
            let Some(s) = sim.upgrade() else { return };
            let revoke = Sim { inner: s }.revoke(peer);
            revoke.await;
        }
    }

    /// The target at `peer` revokes the grant every transfer uses: later
    /// transfers are refused (`Revoked`), writes in flight end at their next
    /// turn, residue is refused when it arrives. Resolves once no write
    /// under the old grant is in flight there.
    pub fn revoke(&self, peer: usize) -> impl Future<Output = ()> + 'static {
        self.inner.revoked.borrow_mut()[peer] = true;
        let sim = Rc::downgrade(&self.inner);
        async move {
            loop {
                let Some(s) = sim.upgrade() else { return };
                if s.writing.borrow()[peer] == 0 {
                    s.revoke_done.borrow_mut()[peer] = true;
                    let at = s.clock.get();
                    s.log.borrow_mut().revokes.push((peer, at));
                    return;
                }
                drop(s);
                yield_now().await;
            }
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
        write: bool,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> {
        let sim = self.clone();
        let t = t.clone();
        let turns = 1 + self.roll(self.inner.cfg.max_turns);
        let deaf = self.chance(self.inner.cfg.deaf);
        let sticky = self.chance(self.inner.cfg.sticky);
        // Real time too: the driver's grace is real time, and a completion
        // the kernel holds back outlives it however fast the turns are.
        let sticky_for = std::time::Duration::from_micros(self.roll(3000));
        let outcome = self.roll(100);
        let delay = 1 + self.roll(self.inner.cfg.residue_delay);
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
            let addr = buf.stable_ptr() as usize;
            if write {
                inner.writing.borrow_mut()[t.peer] += 1;
            }
            let abort_epoch = inner.aborts.borrow()[t.peer];
            let c = &inner.cfg;
            // A refusal (`Forbidden`) leaves the segment untouched, as the
            // protocol says: the target checks before the first byte.
            let refused = (c.retryable_fail..c.retryable_fail + c.refused).contains(&outcome);
            let mut res = Ok(t.len);
            let mut turn = 0;
            let mut aborted_at = None;
            loop {
                // The target looks at its revokes before each chunk of a
                // write (reads are not revoked): the chunk in progress
                // when the revoke came still lands, and the revoke waits
                // for it (`writing`).
                if write && inner.revoked.borrow()[t.peer] {
                    res = Err(match turn {
                        0 => TransferError::Revoked { landed: 0 },
                        _ => TransferError::Revoked { landed: t.len / 2 },
                    });
                    break;
                }
                yield_now().await;
                tick(inner);
                turn += 1;
                // The "DMA" touches the buffer on every turn.
                if returned.as_ref().is_some_and(|r| r.get()) {
                    inner.log.borrow_mut().access_after_return += 1;
                }
                if inner.aborts.borrow()[t.peer] != abort_epoch {
                    let (at, since) =
                        *aborted_at.get_or_insert_with(|| (turn, std::time::Instant::now()));
                    // A sticky transfer's completion takes a while to come back.
                    if !sticky || (turn >= at + turns * 4 + 8 && since.elapsed() >= sticky_for) {
                        res = Err(TransferError::ConnectionLost("peer aborted".into()));
                        break;
                    }
                    continue;
                }
                if !deaf && inner.fenced.borrow().contains(&(t.peer, wire)) {
                    // A prefix landed (half, as the turns before said), or
                    // nothing: `Fenced`, as the target answers 0 bytes.
                    res = Err(match t.len / 2 {
                        landed if turn > 1 && landed > 0 => TransferError::FencedPartial { landed },
                        _ => TransferError::Fenced,
                    });
                    break;
                }
                if refused {
                    res = Err(TransferError::Forbidden(0));
                    break;
                }
                if write {
                    land(inner, t.peer, wire, addr, false);
                }
                if turn >= turns && !(deaf && turn < turns * 50) {
                    break;
                }
            }
            if write {
                inner.writing.borrow_mut()[t.peer] -= 1;
            }
            if res.is_ok() && outcome < c.retryable_fail {
                res = Err(TransferError::ConnectionLost("simulated".into()));
            }
            {
                let mut log = inner.log.borrow_mut();
                log.in_flight -= 1;
                *log.live.get_mut(&wire).expect("registered") -= 1;
                match &res {
                    // A read's bytes land in the caller's buffer, never
                    // at the target: it leaves no residue.
                    Err(e) if !e.settles_remote() => {
                        if write {
                            log.residue.insert((t.peer, wire, addr));
                            let due = inner.clock.get() + delay;
                            inner.residue.borrow_mut().push(Residue {
                                peer: t.peer,
                                wire,
                                addr,
                                due,
                            });
                        }
                    }
                    answered => {
                        let landed = match answered {
                            Ok(n) => *n,
                            Err(TransferError::FencedPartial { landed })
                            | Err(TransferError::Revoked { landed }) => *landed,
                            Err(_) => 0,
                        };
                        log.answered.insert((wire, addr), landed);
                    }
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
        self.transfer(t, src, wire, true)
    }

    fn read<B: IoBufMut>(
        &self,
        t: &SimTarget,
        dst: B,
        wire: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        self.transfer(t, dst, wire, false)
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
        self.inner.log.borrow_mut().fences_out.insert((peer, wire));
        let answer = async move {
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
                if let Some(s) = sim.upgrade() {
                    tick(&s);
                }
            }
            match sim.upgrade() {
                // A fence on a connection that died fails, as a real
                // one does: no confirmation comes over a dead link.
                Some(s) if s.aborts.borrow()[peer] == epoch => {
                    s.fenced.borrow_mut().insert((peer, wire));
                    Ok(())
                }
                _ => lost(),
            }
        };
        let sim = Rc::downgrade(&self.inner);
        async move {
            let r = answer.await;
            if let Some(s) = sim.upgrade() {
                s.log.borrow_mut().fences_out.remove(&(peer, wire));
            }
            r
        }
    }

    fn abort(&self, peer: &usize) {
        self.inner.aborts.borrow_mut()[*peer] += 1;
    }

    fn retire(&self, peer: &usize, wire: u64) {
        let mut log = self.inner.log.borrow_mut();
        if log.fences_out.contains(&(*peer, wire)) {
            log.retired_before_fence_answered += 1;
        }
    }
}
