//! The helper thread's loop: one session with etcd at a time (a lease kept
//! alive, this node's entries written under it, a watch on the prefix), and
//! a new one whenever the last is lost.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, ConnectOptions, EventType, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp,
    WatchOptions, WatchStream,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::{sleep_until, timeout, Instant};
use tracing::{debug, info, warn};

use super::ownership::{wrote, Ownership};
use super::pages::{read_prefix, REPLY_LIMIT};
use super::{Command, EtcdOptions};
use crate::mirror::{Link, Mirror};
use crate::record::{Key, Layout, NodeRecord, SegmentRecord};
use crate::DirectoryError;

/// A working session.
struct Session {
    client: Client,
    lease: i64,
    keeper: LeaseKeeper,
    alive: LeaseKeepAliveStream,
    watch: WatchStream,
    /// When etcd last confirmed the lease.
    confirmed: Instant,
}

/// The session's state: explicit, so each arm says what holds in it.
enum State {
    /// No session. Puts and deletes are only remembered; lookups that miss
    /// the mirror fail; flushes wait for a session or their deadline. The
    /// next attempt is at `retry_at`.
    Away { retry_at: Instant },
    /// A lease is held, every remembered entry is written under it, and the
    /// watch has applied every change up to now to the mirror.
    Live(Box<Session>),
}

type Flush = (oneshot::Sender<Result<(), DirectoryError>>, Instant);
type Lookup = (String, oneshot::Sender<Result<(), DirectoryError>>, Instant);

/// What the helper owns.
pub(crate) struct Helper {
    options: EtcdOptions,
    layout: Layout,
    mirror: Arc<Mirror>,
    commands: mpsc::UnboundedReceiver<Command>,
    /// This node's entries: written again under every new lease.
    published: BTreeMap<String, Vec<u8>>,
    /// Deleted while away: deleted from etcd once a session is up (an old
    /// lease may still hold them).
    withdrawn: BTreeSet<String>,
    /// Which keys are this process's to write back or delete.
    own: Ownership,
    flushes: Vec<Flush>,
    /// Lookups that missed the mirror while there was no session: answered
    /// by the next attempt (from etcd if it succeeds), or at their deadline.
    lookups: Vec<Lookup>,
    /// The last lease, revoked at close if its session is gone.
    last_lease: Option<i64>,
}

/// Operations in one etcd transaction at most (etcd's default
/// `--max-txn-ops`).
const TXN_OPS: usize = 128;

/// Entries written back (or deleted) in one transaction: each is a
/// conditional transaction of up to three operations within it.
const TXN_ENTRIES: usize = TXN_OPS / 4;

fn unavailable(what: &str, e: impl std::fmt::Display) -> DirectoryError {
    DirectoryError::Unavailable(format!("{what}: {e}"))
}

impl Helper {
    pub(crate) fn new(
        options: EtcdOptions,
        layout: Layout,
        mirror: Arc<Mirror>,
        commands: mpsc::UnboundedReceiver<Command>,
    ) -> Helper {
        Helper {
            options,
            layout,
            mirror,
            commands,
            published: BTreeMap::new(),
            withdrawn: BTreeSet::new(),
            own: Ownership::default(),
            flushes: Vec::new(),
            lookups: Vec::new(),
            last_lease: None,
        }
    }

    /// Runs until the directory's handle is dropped; then revokes the lease.
    pub(crate) async fn run(mut self) {
        let mut state = State::Away {
            retry_at: Instant::now(),
        };
        loop {
            state = match state {
                State::Away { retry_at } => match self.away(retry_at).await {
                    Some(s) => s,
                    None => break,
                },
                State::Live(session) => match self.live(session).await {
                    Some(s) => s,
                    None => break,
                },
            };
        }
        self.close().await;
    }

    /// Fails the flushes and lookups waiting for a session whose deadline
    /// passed (all of them with `all`).
    fn fail_waiting(&mut self, now: Instant, all: bool) {
        let (due, keep): (Vec<Flush>, Vec<Flush>) = std::mem::take(&mut self.flushes)
            .into_iter()
            .partition(|(_, at)| all || *at <= now);
        self.flushes = keep;
        for (tx, _) in due {
            let _ = tx.send(Err(DirectoryError::Unavailable(
                "no session with etcd".into(),
            )));
        }
        let (due, keep): (Vec<Lookup>, Vec<Lookup>) = std::mem::take(&mut self.lookups)
            .into_iter()
            .partition(|(_, _, at)| all || *at <= now);
        self.lookups = keep;
        for (node, tx, _) in due {
            let _ = tx.send(Err(DirectoryError::Unavailable(format!(
                "etcd is unreachable and {node:?} is not cached"
            ))));
        }
    }

    /// Without a session: serve commands until `retry_at`, then try once.
    async fn away(&mut self, retry_at: Instant) -> Option<State> {
        loop {
            let wake = self
                .flushes
                .iter()
                .map(|(_, at)| *at)
                .chain(self.lookups.iter().map(|(_, _, at)| *at))
                .fold(retry_at, Instant::min);
            tokio::select! {
                c = self.commands.recv() => match c? {
                    Command::Put(k, v) => {
                        self.withdrawn.remove(&k);
                        self.own.fresh.insert(k.clone());
                        self.published.insert(k, v);
                    }
                    Command::Delete(k, id) => {
                        if self.published_as(&k, id) {
                            self.published.remove(&k);
                            self.own.fresh.remove(&k);
                            self.withdrawn.insert(k);
                        }
                    }
                    Command::Lookup(node, tx) => {
                        let at = Instant::now() + self.options.op_timeout;
                        self.lookups.push((node, tx, at));
                    }
                    Command::Flush(tx, at) => self.flushes.push((tx, at)),
                },
                _ = sleep_until(wake) => {
                    self.fail_waiting(Instant::now(), false);
                    if Instant::now() >= retry_at {
                        break;
                    }
                }
            }
        }
        // Connect, grant and read, then a round trip per transaction.
        let txns = (self.published.len() + self.withdrawn.len()).div_ceil(TXN_ENTRIES) as u32;
        let bound = self.options.op_timeout * (2 + txns);
        let attempt = timeout(bound, self.establish()).await;
        match attempt.unwrap_or_else(|_| Err(unavailable("session setup", "timed out"))) {
            Ok(s) => {
                self.own.established();
                info!(
                    lease = s.lease,
                    entries = self.published.len(),
                    "etcd session up"
                );
                self.mirror.set_link(Link::Up);
                for (tx, _) in self.flushes.drain(..) {
                    let _ = tx.send(Ok(()));
                }
                let mut s = Box::new(s);
                for (node, tx, _) in std::mem::take(&mut self.lookups) {
                    let r = self.lookup(&mut s, &node).await;
                    let _ = tx.send(r);
                }
                Some(State::Live(s))
            }
            Err(e) => {
                self.own.setup_failed();
                debug!(error = %e, "etcd unreachable");
                self.mirror.set_link(Link::Down(e.to_string()));
                let waiting = std::mem::take(&mut self.lookups);
                for (node, tx, _) in waiting {
                    let _ = tx.send(Err(DirectoryError::Unavailable(format!(
                        "{e}; {node:?} is not cached"
                    ))));
                }
                Some(State::Away {
                    retry_at: Instant::now() + self.options.retry,
                })
            }
        }
    }

    /// Connects, takes a new lease, writes every entry under it, reloads
    /// the mirror and watches from the revision it read.
    async fn establish(&mut self) -> Result<Session, DirectoryError> {
        let o = &self.options;
        let connect = ConnectOptions::new()
            .with_connect_timeout(o.op_timeout)
            .with_timeout(o.op_timeout)
            .with_keep_alive(Duration::from_secs(1), o.op_timeout);
        let mut client = Client::connect(&o.endpoints, Some(connect))
            .await
            .map_err(|e| unavailable("connect", e))?;
        // A key the last failed setups wrote back with the answer lost is
        // under a lease nothing here knows: revoked first, it is free again.
        self.own
            .revoke_abandoned(&mut client)
            .await
            .map_err(|e| unavailable("revoke a failed setup's lease", e))?;
        let grant = client
            .lease_grant(o.ttl_secs, None)
            .await
            .map_err(|e| unavailable("lease grant", e))?;
        let lease = grant.id();
        self.last_lease = Some(lease);
        self.own.granted(lease);
        let (mut keeper, alive) = client
            .lease_keep_alive(lease)
            .await
            .map_err(|e| unavailable("lease keep-alive", e))?;
        // The lease is kept alive while the rest runs: the setup may take
        // longer than its TTL (thousands of entries written back, a large
        // directory read, over a slow link), and a lease that expired
        // meanwhile took what the setup had written with it.
        let ttl = Duration::from_secs(o.ttl_secs.max(1) as u64);
        let mut tick = tokio::time::interval((ttl / 3).max(Duration::from_millis(200)));
        tick.tick().await; // (the first is at once: the stream just sent one)
        let fill = self.fill(client.clone(), lease);
        tokio::pin!(fill);
        let watch = loop {
            tokio::select! {
                w = &mut fill => break w?,
                _ = tick.tick() => keeper
                    .keep_alive()
                    .await
                    .map_err(|e| unavailable("lease keep-alive", e))?,
            }
        };
        Ok(Session {
            client,
            lease,
            keeper,
            alive,
            watch,
            confirmed: Instant::now(),
        })
    }

    /// The rest of a session's setup under `lease`: this process's entries
    /// written back (and those it withdrew meanwhile deleted), the mirror
    /// reloaded, and a watch from the revision it read.
    async fn fill(
        &mut self,
        mut client: Client,
        lease: i64,
    ) -> Result<WatchStream, DirectoryError> {
        // In transactions of TXN_ENTRIES: one round trip each, not one per
        // entry (a node with thousands of segments took longer than the
        // setup's bound one put at a time, and never came back).
        let withdrawn: Vec<String> = self.withdrawn.iter().cloned().collect();
        for chunk in withdrawn.chunks(TXN_ENTRIES) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .filter_map(|k| Some(TxnOp::txn(self.own.delete_own(k)?)))
                .collect();
            client
                .txn(Txn::new().and_then(ops))
                .await
                .map_err(|e| unavailable("delete", e))?;
            for k in chunk {
                self.withdrawn.remove(k);
                self.own.forget(k);
            }
        }
        // Each written back only where it is still this process's, or
        // nobody's (its lease expired): not over a newer writer's.
        let entries: Vec<(String, Vec<u8>)> = self
            .published
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for chunk in entries.chunks(TXN_ENTRIES) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|(k, v)| TxnOp::txn(self.own.put_own(k, v, lease)))
                .collect();
            let r = client
                .txn(Txn::new().and_then(ops))
                .await
                .map_err(|e| unavailable("put", e))?;
            let revision = r.header().map_or(0, |h| h.revision());
            for ((k, _), put) in chunk.iter().zip(r.op_responses()) {
                if wrote(&put) {
                    self.own.fresh.remove(k);
                    self.own.wrote(k, revision, lease);
                } else {
                    warn!(
                        key = k.as_str(),
                        "another process published this entry since; leaving it to it"
                    );
                    self.published.remove(k);
                    self.own.forget(k);
                }
            }
        }
        let root = self.layout.root().to_string();
        let (all, revision) = read_prefix(&client, &root)
            .await
            .map_err(|e| unavailable("read the directory", e))?;
        let (mut nodes, mut segments) = (Vec::new(), Vec::new());
        for kv in &all {
            match self.decode(kv.key(), kv.value()) {
                Some(Entry::Node(n)) => nodes.push(n),
                Some(Entry::Segment(s)) => segments.push(s),
                None => {}
            }
        }
        self.mirror.reload(nodes, segments);
        let watch = client
            .watch_client()
            .max_decoding_message_size(REPLY_LIMIT)
            .watch(
                root,
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision + 1),
                ),
            )
            .await
            .map_err(|e| unavailable("watch", e))?;
        Ok(watch)
    }

    /// Whether a delete of `key` for registration `id` is this node's to
    /// make: any delete without an id; with one, only while what this node
    /// published there is that registration's record (not a later one's).
    fn published_as(&self, key: &str, id: Option<u64>) -> bool {
        let Some(id) = id else { return true };
        self.published
            .get(key)
            .and_then(|v| SegmentRecord::decode("", "", v))
            .is_some_and(|r| r.id == id)
    }

    fn decode(&self, key: &[u8], value: &[u8]) -> Option<Entry> {
        let entry = match self.layout.parse(key)? {
            Key::Node(n) => NodeRecord::decode(&n, value).map(Entry::Node),
            Key::Segment(n, s) => SegmentRecord::decode(&n, &s, value).map(Entry::Segment),
        };
        if entry.is_none() {
            warn!(key = %String::from_utf8_lossy(key), "malformed directory entry ignored");
        }
        entry
    }

    /// With a session: serve commands, keep the lease alive, apply the
    /// watch. Any failure drops the session (the mirror stays).
    async fn live(&mut self, mut s: Box<Session>) -> Option<State> {
        let ttl = Duration::from_secs(self.options.ttl_secs.max(1) as u64);
        let mut tick = tokio::time::interval((ttl / 3).max(Duration::from_millis(200)));
        let lost = loop {
            tokio::select! {
                c = self.commands.recv() => match c {
                    None => {
                        // Closed: revoke over this session, so this node's
                        // entries vanish now rather than after the TTL.
                        let op = self.options.op_timeout;
                        if timeout(op, s.client.lease_revoke(s.lease)).await.is_ok_and(|r| r.is_ok()) {
                            self.last_lease = None;
                        }
                        return None;
                    }
                    Some(c) => if let Err(e) = self.apply(&mut s, c).await {
                        break e;
                    },
                },
                _ = tick.tick() => {
                    if s.confirmed.elapsed() > ttl {
                        break unavailable("lease", "etcd stopped confirming it");
                    }
                    if let Err(e) = s.keeper.keep_alive().await {
                        break unavailable("keep-alive", e);
                    }
                }
                m = s.alive.message() => match m {
                    Ok(Some(r)) if r.ttl() > 0 => s.confirmed = Instant::now(),
                    Ok(Some(_)) => break unavailable("lease", "expired"),
                    Ok(None) => break unavailable("keep-alive", "stream ended"),
                    Err(e) => break unavailable("keep-alive", e),
                },
                m = s.watch.message() => match m {
                    Ok(Some(r)) if r.canceled() => {
                        break unavailable("watch", format!("cancelled: {}", r.cancel_reason()));
                    }
                    Ok(Some(r)) => self.apply_events(&r),
                    Ok(None) => break unavailable("watch", "stream ended"),
                    Err(e) => break unavailable("watch", e),
                },
            }
        };
        warn!(error = %lost, "etcd session lost; serving the cached directory");
        self.mirror.set_link(Link::Down(lost.to_string()));
        Some(State::Away {
            retry_at: Instant::now() + self.options.retry,
        })
    }

    async fn apply(&mut self, s: &mut Session, c: Command) -> Result<(), DirectoryError> {
        match c {
            // A publication now is this process's: the newest writer.
            Command::Put(k, v) => {
                self.withdrawn.remove(&k);
                self.published.insert(k.clone(), v.clone());
                let put = PutOptions::new().with_lease(s.lease);
                match s.client.put(k.clone(), v, Some(put)).await {
                    Ok(r) => {
                        self.own.fresh.remove(&k);
                        let revision = r.header().map_or(0, |h| h.revision());
                        let lease = s.lease;
                        self.own.wrote(&k, revision, lease);
                    }
                    Err(e) => {
                        // Written (or not) by the next session, as fresh.
                        self.own.fresh.insert(k);
                        return Err(unavailable("put", e));
                    }
                }
            }
            Command::Delete(k, id) => {
                if !self.published_as(&k, id) {
                    return Ok(());
                }
                self.published.remove(&k);
                self.own.fresh.remove(&k);
                let Some(txn) = self.own.delete_own(&k) else {
                    return Ok(());
                };
                if let Err(e) = s.client.txn(txn).await {
                    self.withdrawn.insert(k);
                    return Err(unavailable("delete", e));
                }
                self.own.forget(&k);
            }
            Command::Lookup(node, tx) => {
                let r = self.lookup(s, &node).await;
                let lost = matches!(r, Err(DirectoryError::Unavailable(_)));
                let _ = tx.send(r.clone());
                if lost {
                    return r;
                }
            }
            Command::Flush(tx, _) => {
                let _ = tx.send(Ok(()));
            }
        }
        Ok(())
    }

    /// Reads one node and its segments straight from etcd (the watch may
    /// not have delivered an entry written a moment ago).
    async fn lookup(&self, s: &mut Session, node: &str) -> Result<(), DirectoryError> {
        let key = self.layout.node(node);
        let n = s
            .client
            .get(key, None)
            .await
            .map_err(|e| unavailable("get", e))?;
        let Some(kv) = n.kvs().first() else {
            return Err(DirectoryError::NotFound(node.to_string()));
        };
        let Some(Entry::Node(rec)) = self.decode(kv.key(), kv.value()) else {
            return Err(DirectoryError::Malformed(
                kv.key_str().unwrap_or("?").to_string(),
            ));
        };
        let (segs, _) = read_prefix(&s.client, &self.layout.segments_of(node))
            .await
            .map_err(|e| unavailable("get", e))?;
        for kv in &segs {
            if let Some(Entry::Segment(seg)) = self.decode(kv.key(), kv.value()) {
                self.mirror.put_segment(seg);
            }
        }
        self.mirror.put_node(rec);
        Ok(())
    }

    fn apply_events(&self, r: &etcd_client::WatchResponse) {
        for ev in r.events() {
            let Some(kv) = ev.kv() else { continue };
            let put = match ev.event_type() {
                EventType::Put => self.decode(kv.key(), kv.value()),
                EventType::Delete => None,
            };
            match put {
                Some(Entry::Node(n)) => self.mirror.put_node(n),
                Some(Entry::Segment(s)) => self.mirror.put_segment(s),
                // Deleted, or replaced by a value that does not decode
                // (never served, PROTOCOL.md §8): the old entry goes rather
                // than staying the answer.
                None => match self.layout.parse(kv.key()) {
                    Some(Key::Node(n)) => self.mirror.remove_node(&n),
                    Some(Key::Segment(n, s)) => self.mirror.remove_segment(&n, &s),
                    None => {}
                },
            }
        }
    }

    /// The handle is gone: revoke the last lease if no session did, so this
    /// node's entries vanish now rather than after the TTL.
    async fn close(&mut self) {
        self.mirror.set_link(Link::Closed);
        self.fail_waiting(Instant::now(), true);
        let Some(lease) = self.last_lease.take() else {
            return;
        };
        let o = &self.options;
        let revoke = async {
            let connect = ConnectOptions::new()
                .with_connect_timeout(o.op_timeout)
                .with_timeout(o.op_timeout);
            let mut c = Client::connect(&o.endpoints, Some(connect)).await.ok()?;
            c.lease_revoke(lease).await.ok()
        };
        if timeout(o.op_timeout, revoke).await.ok().flatten().is_none() {
            debug!(lease, "lease not revoked at close; it expires with its TTL");
        }
    }
}

enum Entry {
    Node(NodeRecord),
    Segment(SegmentRecord),
}
