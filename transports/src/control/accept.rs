//! The target's accept loop and its admission rules: which connections it
//! keeps when there are too many, and how it rides out running short of
//! file descriptors.
//!
//! A connection is *pending* until it proves a token (the whole handshake
//! has the engine's handshake deadline), then *served*. At most
//! `max_unauthenticated` connections are pending: a new one evicts the
//! oldest, so a flood of peers that never authenticate cannot keep an
//! honest one (which authenticates in a round trip) out. At most
//! `max_connections` are open in all: at the cap a new connection evicts
//! the oldest pending one, or is closed at once if none is pending.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::rc::{Rc, Weak};
use std::time::Duration;

use quiesce_runtime::net::TcpListener;
use quiesce_runtime::{spawn_local, time, JoinHandle};

use crate::control::target::Target;

/// The target's connections, by stage.
#[derive(Default)]
pub(crate) struct Admission {
    /// Not authenticated yet, oldest first, with the flag the connection
    /// sets once it proved a token.
    pending: VecDeque<(JoinHandle<()>, Rc<Cell<bool>>)>,
    /// Authenticated.
    served: Vec<JoinHandle<()>>,
}

impl Admission {
    /// Moves connections that authenticated to `served` and forgets those
    /// that ended.
    fn sort(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let (t, authed) = &self.pending[i];
            if t.is_finished() {
                self.pending.remove(i);
            } else if authed.get() {
                let (t, _) = self.pending.remove(i).expect("in range");
                self.served.push(t);
            } else {
                i += 1;
            }
        }
        self.served.retain(|t| !t.is_finished());
    }

    /// Makes room for one more connection; false if there is none.
    fn make_room(&mut self, max_pending: usize, max_total: usize) -> bool {
        self.sort();
        let evict = |p: &mut VecDeque<(JoinHandle<()>, Rc<Cell<bool>>)>| {
            if let Some((t, _)) = p.pop_front() {
                tracing::debug!("evicting the oldest unauthenticated connection");
                t.abort();
                true
            } else {
                false
            }
        };
        while self.pending.len() >= max_pending.max(1) {
            evict(&mut self.pending);
        }
        while self.pending.len() + self.served.len() >= max_total.max(1) {
            if !evict(&mut self.pending) {
                return false;
            }
        }
        true
    }

    /// Drops every connection (engine shutdown).
    pub(crate) fn abort_all(&mut self) {
        for (t, _) in self.pending.drain(..) {
            t.abort();
        }
        for t in self.served.drain(..) {
            t.abort();
        }
    }
}

/// Accepts connections on `listener` for the engine behind `weak` until it
/// is gone or the listener fails.
pub(crate) fn accept_loop(
    listener: TcpListener,
    weak: Weak<Target>,
    admission: Rc<RefCell<Admission>>,
) -> JoinHandle<()> {
    spawn_local(async move {
        let mut backoff = AcceptBackoff::default();
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => {
                    backoff.reset();
                    stream
                }
                Err(e) => match backoff.after(&e) {
                    Some(pause) => {
                        time::sleep(pause).await;
                        continue;
                    }
                    None => {
                        tracing::error!(error = %e, "the listener failed; no more connections are accepted");
                        break;
                    }
                },
            };
            let Some(engine) = weak.upgrade() else { break };
            let c = &engine.counters;
            c.accepted.set(c.accepted.get() + 1);
            let cfg = &engine.config;
            let mut adm = admission.borrow_mut();
            if !adm.make_room(cfg.max_unauthenticated, cfg.max_connections) {
                let limit = &engine.peer_logs.no_slot;
                if let Some(suppressed) = limit.admit() {
                    tracing::warn!(max = cfg.max_connections, suppressed, "{}", limit.what());
                }
                c.refused.set(c.refused.get() + 1);
                continue;
            }
            if stream.set_nodelay(true).is_err()
                || stream.set_user_timeout(cfg.stall_timeout).is_err()
            {
                continue;
            }
            let authed = Rc::new(Cell::new(false));
            let task = spawn_local(crate::control::server::serve(
                engine.clone(),
                stream,
                authed.clone(),
            ));
            adm.pending.push_back((task, authed));
        }
    })
}

/// What the accept loop does after a failed `accept`: errors of the moment
/// (out of file descriptors, buffers or memory; a connection that aborted
/// before it was accepted; a signal) are waited out — longer each time, up
/// to a second, so a target at its fd limit neither spins nor gives up —
/// and only an error of the listener itself ends the loop.
#[derive(Default)]
struct AcceptBackoff {
    pause: Duration,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_secs(1);

    fn reset(&mut self) {
        self.pause = Duration::ZERO;
    }

    /// The pause before accepting again, or `None` to stop.
    fn after(&mut self, e: &io::Error) -> Option<Duration> {
        match e.raw_os_error() {
            Some(libc::ECONNABORTED | libc::EINTR | libc::EAGAIN | libc::EPROTO | libc::EPERM) => {
                tracing::debug!(error = %e, "accept failed for one connection");
                Some(Duration::ZERO)
            }
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                self.pause = (self.pause * 2).clamp(Self::FIRST, Self::MAX);
                tracing::warn!(error = %e, pause_ms = self.pause.as_millis() as u64, "cannot accept: out of resources; pausing");
                Some(self.pause)
            }
            _ => None,
        }
    }
}
