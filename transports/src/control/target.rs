//! The target side of an engine: its registered segments, its sessions
//! (bound by the target: ids and keys it chose, the connections in each),
//! the fence table, admission, and counters.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Instant;

use quiesce_runtime::net::TcpStream;
use quiesce_runtime::JoinHandle;

use crate::config::EngineConfig;
use crate::control::auth::{random_u64, GrantKey, SessionKey};
use crate::control::fence::FenceTable;
use crate::control::log_limit::PeerLogs;
use crate::control::registered::Registered;
use crate::control::wire::{Descriptor, GrantReceipt};
use crate::control::{ServedLink, ServedSlot};
use crate::segment::Segment;

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) bytes_landed: Cell<u64>,
    pub(crate) rejected: Cell<u64>,
    pub(crate) accepted: Cell<u64>,
    pub(crate) connections: Cell<u64>,
    pub(crate) unauthenticated: Cell<u64>,
    pub(crate) refused: Cell<u64>,
    pub(crate) mailbox_requests: Cell<u64>,
    pub(crate) proof_checks: Cell<u64>,
}

/// The target side of an engine: what the control server and the TCP data
/// path serve from. Its tasks hold it; the [`Engine`](crate::Engine)
/// handles hold it and shut it down when the last one goes.
pub(crate) struct Target {
    pub(crate) config: EngineConfig,
    pub(crate) local_addr: SocketAddr,
    pub(crate) segments: RefCell<Registered>,
    /// Every segment peers may still reach, deregistered ones too.
    pub(crate) exposed: Rc<crate::segment::ExposedSegments>,
    pub(crate) next_segment: Cell<u64>,
    pub(crate) fences: FenceTable,
    /// Live target-side connections per initiator session.
    /// Live sessions (those with an authenticated connection, or that had
    /// one within a handshake timeout).
    pub(crate) sessions: RefCell<HashMap<u64, Session>>,
    /// Sessions whose last connection closed, with when they expire.
    pub(crate) lingering: RefCell<std::collections::VecDeque<(Instant, u64)>>,
    pub(crate) next_conn: Cell<usize>,
    pub(crate) tasks: RefCell<Vec<JoinHandle<()>>>,
    pub(crate) admission: Rc<RefCell<crate::control::accept::Admission>>,
    pub(crate) counters: Counters,
    /// The queue-pair plane an `RdmaEngine` wrapping this engine registers.
    pub(crate) qp_plane: RefCell<Option<Rc<dyn crate::control::QpPlane>>>,
    /// What peers can make the target log, limited (`log_limit.rs`).
    pub(crate) peer_logs: PeerLogs,
    /// Tags the grant receipts peers name in their proofs.
    pub(crate) grant_key: GrantKey,
    /// HMACs spent on refused proofs over every connection: past
    /// [`TARGET_REFUSED_BUDGETS`](crate::control::prove::TARGET_REFUSED_BUDGETS)
    /// connections' `First` budgets, `First` proofs are refused unchecked
    /// until it refills (no connection is closed for it).
    pub(crate) refused_proofs: RefCell<crate::control::prove::RefusedWork>,
}

impl Target {
    /// Stops accepting and drops every served connection (their in-flight
    /// ops park until reaped).
    pub(crate) fn shutdown(&self) {
        // Taken out first: aborting drops futures, which may touch the target.
        let tasks: Vec<JoinHandle<()>> = self.tasks.borrow_mut().drain(..).collect();
        tasks.iter().for_each(JoinHandle::abort);
        self.admission.borrow_mut().abort_all();
    }

    pub(crate) fn segment(&self, id: u64) -> Option<Segment> {
        self.segments.borrow().get(id).cloned()
    }

    /// The segment registered as `name`.
    pub(crate) fn segment_named(&self, name: &str) -> Option<Segment> {
        self.segments.borrow().named(name).cloned()
    }

    /// The segment whose `rank` is least among the live ones holding
    /// address `holding` (every one if `None`) whose token `proves`
    /// accepts, and how many were tried. Every such segment's token is
    /// tried, so the work — and a refusal — says nothing about the segments
    /// the proof does not open; a caller that found none to try does a
    /// refusal's work all the same.
    pub(crate) fn proven_segment<K: Ord>(
        &self,
        holding: Option<u64>,
        proves: impl Fn(&crate::control::auth::Token) -> bool,
        rank: impl Fn(&Segment) -> K,
    ) -> (Option<Segment>, usize) {
        let segments = self.segments.borrow();
        let candidates: Box<dyn Iterator<Item = &Segment>> = match holding {
            Some(a) => Box::new(segments.holding(a)),
            None => Box::new(segments.all()),
        };
        let (mut best, mut tried) = (None::<&Segment>, 0);
        for s in candidates {
            tried += 1;
            if proves(&s.token()) && best.is_none_or(|b| rank(s) < rank(b)) {
                best = Some(s);
            }
        }
        (best.cloned(), tried)
    }

    /// What a peer that proved `s`'s token learns about it, with `grant`,
    /// the receipt for the segment's current epoch.
    pub(crate) fn descriptor(&self, s: &Segment, grant: GrantReceipt) -> Descriptor {
        Descriptor {
            id: s.id(),
            name: s.name().into(),
            len: s.len(),
            base: s.base(),
            rights: s.rights(),
            endpoints: vec![self.local_addr],
            grant,
        }
    }

    /// Sessions with a connection now.
    pub(crate) fn live_sessions(&self) -> usize {
        self.sessions
            .borrow()
            .values()
            .filter(|s| !s.conns.is_empty())
            .count()
    }

    /// The key of `session` if it is live here.
    pub(crate) fn session_key(&self, session: u64) -> Option<SessionKey> {
        self.expire_sessions();
        self.sessions.borrow().get(&session).map(|s| s.key)
    }

    /// Forgets sessions that have had no connection for a handshake timeout.
    fn expire_sessions(&self) {
        let now = Instant::now();
        let mut lingering = self.lingering.borrow_mut();
        let mut sessions = self.sessions.borrow_mut();
        while let Some(&(until, id)) = lingering.front() {
            if until > now {
                break;
            }
            lingering.pop_front();
            // (Left again since, it lingers from then: a later entry.)
            let over =
                |s: &Session| s.conns.is_empty() && s.lingers_until.is_some_and(|u| u <= now);
            if sessions.get(&id).is_some_and(over) {
                sessions.remove(&id);
            }
        }
        // A burst of short sessions (connection churn) must not keep its
        // tables' memory once it has passed.
        if sessions.capacity() > 4 * sessions.len() + 64 {
            sessions.shrink_to_fit();
        }
        if lingering.capacity() > 4 * lingering.len() + 64 {
            lingering.shrink_to_fit();
        }
    }

    /// A fresh session id: random, never 0, not live.
    pub(crate) fn new_session_id(&self) -> u64 {
        self.expire_sessions();
        loop {
            let id = random_u64();
            if id != 0 && !self.sessions.borrow().contains_key(&id) {
                return id;
            }
        }
    }

    /// Registers connection `s` in `session` until the guard drops: creating
    /// the session with `key`, or joining it (`None`). Refused (`Err`, with
    /// why) if the session to join ended meanwhile, or already has
    /// `max_connections_per_session` connections (each may also hold a
    /// served queue pair: this caps those too).
    pub(crate) fn session_guard(
        &self,
        session: u64,
        key: Option<SessionKey>,
        s: &Rc<TcpStream>,
        served: &ServedSlot,
    ) -> Result<SessionGuard<'_>, &'static str> {
        let conn = self.next_conn.get();
        self.next_conn.set(conn + 1);
        let mut sessions = self.sessions.borrow_mut();
        let entry = match key {
            Some(key) => sessions.entry(session).or_insert_with(|| Session {
                key,
                conns: HashMap::new(),
                lingers_until: None,
            }),
            None => sessions
                .get_mut(&session)
                .ok_or("the session it joined ended during its handshake")?,
        };
        if entry.conns.len() >= self.config.max_connections_per_session.max(1) {
            return Err("its session has as many connections as a session may");
        }
        let member = SessionConn {
            stream: Rc::downgrade(s),
            served: Rc::downgrade(served),
        };
        entry.conns.insert(conn, member);
        Ok(SessionGuard {
            engine: self,
            session,
            conn,
        })
    }

    /// The open connections of `session`.
    pub(crate) fn session_conns(&self, session: u64) -> Vec<usize> {
        self.sessions
            .borrow()
            .get(&session)
            .map_or_else(Vec::new, |s| s.conns.keys().copied().collect())
    }

    /// What `pick` takes from each open connection of `session` (taken out
    /// first: acting on it may end a connection, which changes the table).
    fn members<T>(&self, session: u64, pick: impl Fn(&SessionConn) -> Option<T>) -> Vec<T> {
        self.sessions
            .borrow()
            .get(&session)
            .map_or_else(Vec::new, |c| c.conns.values().filter_map(pick).collect())
    }

    /// Closes every connection of `session` (it holds too much state): once
    /// they are gone nothing of it can arrive, and its entries go.
    pub(crate) fn close_session(&self, session: u64) {
        for s in self.members(session, |m| m.stream.upgrade()) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Shuts every connection whose served link is poisoned (a key a revoke
    /// had to kill lives on in its domain, or a queue pair a fence could
    /// not stop lives on): its initiator sees the
    /// connection end, fails what it had on the queue pair, and gets a new
    /// link (and domain) on its next connection.
    pub(crate) fn close_poisoned(&self) {
        let poisoned = |m: &SessionConn| {
            let slot = m.served.upgrade()?;
            let link = slot.try_borrow().ok()?;
            link.as_ref()?.poisoned().then(|| m.stream.upgrade())?
        };
        let streams: Vec<Rc<TcpStream>> = self
            .sessions
            .borrow()
            .values()
            .flat_map(|s| s.conns.values())
            .filter_map(poisoned)
            .collect();
        for s in streams {
            tracing::warn!(
                "closing a connection whose RDMA domain may accept requests no revoke or fence could stop"
            );
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Resets the RDMA queue pair served on every connection of `session`
    /// (a fence): nothing more of any batch lands through one, also through
    /// a connection the initiator gave up on that is still open here (its
    /// reset lost in a partition), whose queue pair would accept the
    /// requests still in the network.
    ///
    /// `Err` names a queue pair that could be neither reset nor destroyed:
    /// requests may still land through it, so the fence is not confirmed.
    pub(crate) fn reset_served(&self, session: u64) -> Result<(), String> {
        // A target without an RDMA plane serves no queue pair: a TCP fence
        // walks nothing.
        if self.qp_plane.borrow().is_none() {
            return Ok(());
        }
        let slots: Vec<ServedSlot> = self.members(session, |m| m.served.upgrade());
        let mut stopped = Ok(());
        for slot in slots {
            // (Borrowed only in synchronous steps: never busy here.)
            if let Some(link) = slot.borrow_mut().as_mut() {
                // Every one is reset, whichever failed.
                stopped = stopped.and(link.reset().map(drop));
            }
        }
        stopped
    }
}

/// A session the target bound: its key and its open connections, by id.
pub(crate) struct Session {
    key: SessionKey,
    conns: HashMap<usize, SessionConn>,
    /// With no connection: until when it lingers (from its last close).
    lingers_until: Option<Instant>,
}

/// An open connection of a session.
struct SessionConn {
    /// To close them all when the session holds too much state.
    stream: std::rc::Weak<TcpStream>,
    /// To reset every queue pair of the session on a fence.
    served: std::rc::Weak<std::cell::RefCell<Option<Box<dyn ServedLink>>>>,
}

/// A served connection's place in its session.
pub(crate) struct SessionGuard<'a> {
    engine: &'a Target,
    session: u64,
    /// The connection's id (a carrier in the fence table).
    pub(crate) conn: usize,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.engine.sessions.borrow_mut();
        let Some(entry) = s.get_mut(&self.session) else {
            return;
        };
        entry.conns.remove(&self.conn);
        let last = entry.conns.is_empty();
        // The session's fence state goes now; its id and key linger for
        // a handshake timeout, so a peer reconnecting after a teardown
        // (its last connection closing here just before) still joins.
        let until = Instant::now() + self.engine.config.handshake_timeout;
        if last {
            entry.lingers_until = Some(until);
        }
        drop(s);
        self.engine.fences.closed(self.session, self.conn);
        if last {
            self.engine.fences.end_session(self.session);
            self.engine
                .lingering
                .borrow_mut()
                .push_back((until, self.session));
        }
    }
}

#[cfg(test)]
impl Target {
    /// Every session's open connections (tests).
    pub(crate) fn session_streams(&self) -> Vec<Rc<TcpStream>> {
        let sessions = self.sessions.borrow();
        let conns = sessions.values().flat_map(|s| s.conns.values());
        conns.filter_map(|m| m.stream.upgrade()).collect()
    }
}
