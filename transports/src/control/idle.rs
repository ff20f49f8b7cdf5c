//! How long an authenticated connection may stay silent: between frames
//! (waiting for the next header) and inside one (a payload that stops
//! coming).

use std::future::Future;
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::{Duration, Instant};

use quiesce_runtime::time::{sleep_until, Sleep};

use crate::control::server::Closed;

/// The idle timeout of an authenticated connection: a wait for its next
/// frame that lasts the engine's idle timeout closes it, and so does a
/// receive inside a frame that waits that long. One timer serves the
/// connection's life — re-arming one per frame cost a timer insert and
/// removal and two clock reads on every request. Each wait for a frame
/// notes when it began; the timer, armed for an earlier wait, is pushed to
/// this wait's start + the limit when it fires early, so the limit is exact
/// and the timer fires at most about once per limit.
pub(crate) struct IdleLimit {
    limit: Option<Duration>,
    /// Silence between frames is no sign of idleness: the connection
    /// serves a queue pair, whose one-sided traffic the target never sees
    /// ([`lift_between_frames`](Self::lift_between_frames)).
    between_frames_lifted: bool,
    timer: Option<Sleep>,
}

impl IdleLimit {
    pub(crate) fn new(limit: Option<Duration>) -> IdleLimit {
        IdleLimit {
            limit,
            between_frames_lifted: false,
            timer: None,
        }
    }

    /// From now on a wait for the next frame has no limit; receives and
    /// sends inside a frame keep theirs. For a connection serving an RDMA
    /// queue pair: its initiator's transfers are all on the queue pair,
    /// and a control connection closed for its silence took that queue
    /// pair, and every transfer in flight on it, down. (TCP keep-alive,
    /// which the caller turns on, finds a peer gone without a FIN.)
    pub(crate) fn lift_between_frames(&mut self) {
        self.between_frames_lifted = true;
    }

    /// Reads the next frame with `f`, or closes the connection once the
    /// wait has lasted the limit.
    pub(crate) async fn wait<T>(
        &mut self,
        f: impl Future<Output = std::io::Result<T>>,
    ) -> Result<T, Closed> {
        let Some(d) = self.limit.filter(|_| !self.between_frames_lifted) else {
            return f.await.map_err(Closed::Io);
        };
        let due = Instant::now() + d;
        let timer = self.timer.get_or_insert_with(|| sleep_until(due));
        let mut f = pin!(f);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = f.as_mut().poll(cx) {
                return Poll::Ready(r.map_err(Closed::Io));
            }
            while Pin::new(&mut *timer).poll(cx).is_ready() {
                if Instant::now() >= due {
                    return Poll::Ready(Err(Closed::TimedOut(format!("idle for {d:?}"))));
                }
                // Armed for an earlier wait: this one began later.
                timer.reset(due);
            }
            Poll::Pending
        })
        .await
    }

    /// Awaits `f`, a receive inside a frame (keep it small: it is moved
    /// here), or closes the connection once it has waited about the limit:
    /// a peer stopped mid-frame, or whose host went without a FIN, holds
    /// the connection — and a landing write its hold on the segment — no
    /// longer than silence between frames would. No clock reading unless
    /// the timer fires: the receive has the limit from the first time the
    /// timer fires during it, so it is cut after one to two limits. A
    /// receive that is ready at once never looks at the timer. (Dropping a
    /// receive is safe: a parked one keeps its buffer, and a landing
    /// write's registrations, until it is reaped.)
    pub(crate) async fn within<T>(&mut self, f: impl Future<Output = T>) -> Result<T, Closed> {
        let Some(d) = self.limit else {
            return Ok(f.await);
        };
        // The same timer loop as `wait`'s, kept apart: folding the two into
        // one function cost the header's wait, on every frame, 82
        // instructions a 4 KiB write (`scripts/callgrind-target.sh`).
        let mut f = pin!(f);
        // When this receive is cut, once the timer fired during it.
        let mut until: Option<Instant> = None;
        let timer = &mut self.timer;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = f.as_mut().poll(cx) {
                return Poll::Ready(Ok(r));
            }
            let timer = timer.get_or_insert_with(|| sleep_until(Instant::now() + d));
            while Pin::new(&mut *timer).poll(cx).is_ready() {
                let now = Instant::now();
                match until {
                    Some(u) if now >= u => {
                        return Poll::Ready(Err(Closed::TimedOut(format!(
                            "no progress for {d:?} inside a frame"
                        ))))
                    }
                    Some(u) => timer.reset(u),
                    None => {
                        until = Some(now + d);
                        timer.reset(now + d);
                    }
                }
            }
            Poll::Pending
        })
        .await
    }
}
