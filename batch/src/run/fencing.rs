//! The driver's fencing: remote fences of a wire batch at its peers, the
//! grace's timers, and after local quiescence the confirmation, by an
//! acknowledged fence, of the tasks that ended without their target's
//! answer (the diagram in the parent module).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use quiesce_runtime::spawn_local;
use quiesce_runtime::time::sleep_until;
use quiesce_runtime::timeline::{self, Step};
use smallvec::SmallVec;

use super::{Driver, Task, TaskState};
use crate::outcome::RemoteState;
use crate::transport::Transport;

/// The first pause before a failed confirming fence goes again; it doubles
/// up to [`REFENCE_MAX`] while the grace lasts.
const REFENCE_FIRST: Duration = Duration::from_millis(50);
const REFENCE_MAX: Duration = Duration::from_secs(1);

/// A remote fence of the current wire batch at one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FenceState {
    /// Sent; no answer yet.
    Pending,
    /// The peer acknowledged it: nothing more of the wire batch lands there.
    Acked,
    /// It failed (the peer is unreachable): nothing is confirmed.
    Failed,
    /// Sent, no answer yet, and the wire batch is over: the fence's task
    /// retires it at the peer once the answer comes (a `Forget` sent
    /// before the `Fence` lands would leave the entry the fence makes at
    /// the target for good).
    Retiring,
}

pub(super) type Fences<P> = Rc<RefCell<HashMap<P, FenceState>>>;

impl<T: Transport, B: 'static> Driver<T, B> {
    pub(super) fn inflight_peers(&self) -> HashSet<T::Peer> {
        self.tasks
            .iter()
            .filter(|t| matches!(t.state, TaskState::InFlight(_)))
            .map(|t| self.transport.peer(&t.target))
            .collect()
    }

    pub(super) fn start_fence(&mut self, wire: u64, hard: Instant, why: &'static str) {
        let now = Instant::now();
        tracing::info!(why, "fencing the batch");
        timeline::mark(Step::FenceStarted);
        self.fence_started = Some(now);
        let soft = now + hard.saturating_duration_since(now) / 2;
        self.soft = Some(sleep_until(soft));
        self.hard = Some(sleep_until(hard));
        self.hard_at = Some(hard);
        for p in self.inflight_peers() {
            self.fence_peer(p, wire, false);
        }
    }

    /// Sends a remote fence of `wire` to `peer` (once per wire batch, or
    /// again after a failed one with `again`); its answer is recorded in
    /// `fences` and wakes the driver.
    fn fence_peer(&mut self, peer: T::Peer, wire: u64, again: bool) {
        let fences = self.fences.get_or_insert_with(Rc::default).clone();
        match fences.borrow().get(&peer) {
            None => {}
            Some(FenceState::Failed) if again => {}
            Some(_) => return,
        }
        fences
            .borrow_mut()
            .insert(peer.clone(), FenceState::Pending);
        let f = self.transport.fence(&peer, wire);
        let shared = self.shared.clone();
        let transport = self.transport.clone();
        spawn_local(async move {
            let state = match f.await {
                Ok(()) => FenceState::Acked,
                Err(e) => {
                    tracing::debug!(error = %e, "remote fence failed");
                    FenceState::Failed
                }
            };
            let retiring = {
                let mut f = fences.borrow_mut();
                let retiring = f.get(&peer) == Some(&FenceState::Retiring);
                f.insert(peer.clone(), state);
                retiring
            };
            match retiring {
                true => transport.retire(&peer, wire),
                false => shared.wake_driver(),
            }
        });
    }

    /// The wire batch is over: each peer it fenced may forget it — now, or
    /// (a fence still on its way) once that fence is answered.
    pub(super) fn retire(&self, fences: &Fences<T::Peer>, wire: u64) {
        let now: SmallVec<[T::Peer; 2]> = {
            let mut f = fences.borrow_mut();
            let mut now = SmallVec::new();
            for (p, state) in f.iter_mut() {
                match state {
                    FenceState::Pending => *state = FenceState::Retiring,
                    _ => now.push(p.clone()),
                }
            }
            now
        };
        for p in &now {
            self.transport.retire(p, wire);
        }
    }

    /// The tasks that ended without their target's answer. Their peers
    /// are fenced (a read's too: its peer may keep state for the wire
    /// batch, which the retire then lets go, and its report says what the
    /// target confirmed); only a write of them holds back a retry.
    pub(super) fn unconfirmed(&self) -> impl Iterator<Item = &Task<T, B>> {
        self.tasks
            .iter()
            .filter(|t| t.remote == RemoteState::Unconfirmed)
    }

    /// After local quiescence: every task that ended without its target's
    /// answer (a lost or torn-down connection) is confirmed only by an
    /// acknowledged fence of this wire batch at its peer. Fences those peers
    /// (if not already) and waits for their answers until the fence's grace
    /// ends (a fresh grace if the batch never fenced), then records each
    /// task's [`RemoteState`].
    pub(super) async fn confirm_remote(&mut self, wire: u64) {
        let lost: HashSet<T::Peer> = self
            .unconfirmed()
            .map(|t| self.transport.peer(&t.target))
            .collect();
        // A fence that failed (its control connection went down with the
        // teardown at half grace, or the peer is unreachable) goes again on
        // a fresh connection — and again, backing off, while the grace
        // lasts: a partition that heals in time gets its confirmation (and
        // the batch its retry).
        let limit = self
            .hard_at
            .unwrap_or_else(|| Instant::now() + self.opts.fence_grace);
        let mut backoff = REFENCE_FIRST;
        let fences = loop {
            for p in &lost {
                self.fence_peer(p.clone(), wire, true);
            }
            let fences = self.fences.clone().expect("fenced just above");
            let mut until = sleep_until(limit);
            std::future::poll_fn(|cx| {
                let answered = {
                    let f = fences.borrow();
                    lost.iter().all(|p| f.get(p) != Some(&FenceState::Pending))
                };
                if answered || Pin::new(&mut until).poll(cx).is_ready() {
                    return Poll::Ready(());
                }
                *self.shared.driver.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
            let failed = {
                let f = fences.borrow();
                lost.iter().any(|p| f.get(p) == Some(&FenceState::Failed))
            };
            let now = Instant::now();
            if !failed || now >= limit {
                break fences;
            }
            sleep_until((now + backoff).min(limit)).await;
            backoff = (backoff * 2).min(REFENCE_MAX);
            if Instant::now() >= limit {
                break fences;
            }
        };
        let fences = fences.borrow();
        for t in &mut self.tasks {
            let peer = self.transport.peer(&t.target);
            if t.remote == RemoteState::Unconfirmed && fences.get(&peer) == Some(&FenceState::Acked)
            {
                t.remote = RemoteState::Fenced;
            }
        }
        let unconfirmed = self.unconfirmed().count();
        if unconfirmed > 0 {
            tracing::warn!(
                batch = self.id,
                unconfirmed,
                "tasks ended without their target's answer and no fence was acknowledged"
            );
        }
    }
}
