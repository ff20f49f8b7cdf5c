//! The etcd backend: a helper thread runs one current-thread tokio runtime
//! with etcd's gRPC client; everything else talks to it through a queue.
//!
//! * Publishing never blocks: [`EtcdDirectory::publish_node`] and friends
//!   queue the entry and return. The helper writes it under this node's
//!   lease and remembers it, so that after etcd comes back (a new lease, or
//!   a wiped etcd) every entry is written again — where it is still this
//!   process's or nobody's: the newest writer of an entry owns it.
//! * Lookups hit the [`Mirror`](crate::mirror) first (no round trip, and it
//!   keeps serving while etcd is away). A miss asks etcd once, bounded by
//!   [`EtcdOptions::op_timeout`], and fails with
//!   [`Unavailable`](DirectoryError::Unavailable) while etcd is away.
//! * The lease is kept alive every TTL/3; a node that dies (or loses etcd
//!   for longer than the TTL) loses every entry within the TTL.

mod ownership;
mod pages;
mod session;

use std::future::Future;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::mirror::{Change, Link, Mirror};
use crate::record::{check_name, NodeRecord, SegmentRecord};
use crate::DirectoryError;

/// How the etcd backend runs.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// `host:port` of each etcd member.
    pub endpoints: Vec<String>,
    /// The key prefix everything lives under (default `quiesce`).
    pub prefix: String,
    /// The lease's time to live, in seconds: how long a dead node's entries
    /// outlive it (etcd raises values under its minimum, about 2 s).
    pub ttl_secs: i64,
    /// The bound on each etcd call, and on a lookup that misses the cache.
    pub op_timeout: Duration,
    /// How long to wait between attempts while etcd is away.
    pub retry: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            endpoints: vec!["127.0.0.1:2379".into()],
            prefix: "quiesce".into(),
            ttl_secs: 10,
            op_timeout: Duration::from_secs(2),
            retry: Duration::from_millis(500),
        }
    }
}

impl EtcdOptions {
    /// Parses `etcd://host:port[,host:port…][/prefix]`.
    pub fn from_url(url: &str) -> Result<EtcdOptions, DirectoryError> {
        let bad = |why: &str| DirectoryError::BadUrl {
            url: url.to_string(),
            why: why.to_string(),
        };
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| bad("it does not start with etcd://"))?;
        let (hosts, prefix) = match rest.split_once('/') {
            Some((h, p)) => (h, p.trim_matches('/')),
            None => (rest, ""),
        };
        let endpoints: Vec<String> = hosts.split(',').map(str::to_string).collect();
        for e in &endpoints {
            match e.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {}
                _ => return Err(bad(&format!("endpoint {e:?} is not host:port"))),
            }
        }
        let mut o = EtcdOptions {
            endpoints,
            ..Default::default()
        };
        if !prefix.is_empty() {
            o.prefix = prefix.to_string();
        }
        Ok(o)
    }
}

/// What the helper is asked to do.
pub(crate) enum Command {
    /// Write (and remember) `key = value` under the lease.
    Put(String, Vec<u8>),
    /// Delete (and forget) `key` — with an id, only while the segment
    /// record this node published there has that id.
    Delete(String, Option<u64>),
    /// Read one node and its segments into the mirror.
    Lookup(String, oneshot::Sender<Result<(), DirectoryError>>),
    /// Answer once every command before this one is applied (or, with no
    /// session, `Unavailable` at the deadline).
    Flush(
        oneshot::Sender<Result<(), DirectoryError>>,
        tokio::time::Instant,
    ),
}

/// The etcd directory of one process (publisher and resolver at once).
/// Dropping it revokes the lease: this node's entries vanish at once.
pub struct EtcdDirectory {
    options: EtcdOptions,
    layout: crate::record::Layout,
    mirror: Arc<Mirror>,
    commands: Option<tmpsc::UnboundedSender<Command>>,
    helper: Option<JoinHandle<()>>,
    /// The process it started in: a forked child's copy has no helper
    /// thread (and its mirror's lock may have been held at the fork).
    pid: u32,
}

impl EtcdDirectory {
    /// Starts the helper thread and returns at once; the first session with
    /// etcd is set up in the background ([`EtcdDirectory::flush`] waits for
    /// it).
    pub fn start(options: EtcdOptions) -> Result<EtcdDirectory, DirectoryError> {
        if options.endpoints.is_empty() {
            return Err(DirectoryError::BadUrl {
                url: String::new(),
                why: "no etcd endpoint".into(),
            });
        }
        let layout = crate::record::Layout::new(&options.prefix);
        let mirror = Arc::new(Mirror::default());
        let (tx, rx) = tmpsc::unbounded_channel();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| DirectoryError::Unavailable(format!("tokio runtime: {e}")))?;
        let run = session::Helper::new(options.clone(), layout.clone(), mirror.clone(), rx);
        let helper = std::thread::Builder::new()
            .name("quiesce-etcd".into())
            .spawn(move || rt.block_on(run.run()))
            .map_err(|e| DirectoryError::Unavailable(format!("helper thread: {e}")))?;
        Ok(EtcdDirectory {
            options,
            layout,
            mirror,
            commands: Some(tx),
            helper: Some(helper),
            pid: std::process::id(),
        })
    }

    /// `Unavailable` in a forked child (see [`EtcdDirectory::pid`]): asked
    /// first by everything that would wait for the helper or lock the
    /// mirror.
    fn here(&self) -> Result<(), DirectoryError> {
        match std::process::id() == self.pid {
            true => Ok(()),
            false => Err(DirectoryError::Unavailable(
                "a forked child's copy of the etcd directory (its helper thread is the parent's)"
                    .into(),
            )),
        }
    }

    fn send(&self, c: Command) -> Result<(), DirectoryError> {
        self.here()?;
        self.commands
            .as_ref()
            .and_then(|t| t.send(c).ok())
            .ok_or(DirectoryError::Closed)
    }

    /// Publishes this node's endpoint (queued; never blocks).
    pub fn publish_node(&self, rec: &NodeRecord) -> Result<(), DirectoryError> {
        check_name(&rec.node)?;
        self.send(Command::Put(self.layout.node(&rec.node), rec.encode()))
    }

    /// Publishes a segment descriptor (queued; never blocks).
    pub fn publish_segment(&self, rec: &SegmentRecord) -> Result<(), DirectoryError> {
        check_name(&rec.node)?;
        check_name(&rec.name)?;
        let key = self.layout.segment(&rec.node, &rec.name);
        self.send(Command::Put(key, rec.encode()))
    }

    /// Withdraws a segment descriptor (queued; never blocks). With `id`,
    /// only the one of that id: a later registration of the name (another
    /// id) published since stays.
    pub fn withdraw_segment(
        &self,
        node: &str,
        name: &str,
        id: Option<u64>,
    ) -> Result<(), DirectoryError> {
        check_name(node)?;
        check_name(name)?;
        self.send(Command::Delete(self.layout.segment(node, name), id))
    }

    /// Waits until everything queued so far is written to etcd; fails with
    /// [`Unavailable`](DirectoryError::Unavailable) if there is no session
    /// with etcd by `timeout` (the entries stay queued and are written once
    /// there is).
    pub fn flush(&self, timeout: Duration) -> Result<(), DirectoryError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Flush(tx, tokio::time::Instant::now() + timeout))?;
        wait(rx)
    }

    /// `node`'s endpoint: from the mirror, else asked of etcd (blocking up
    /// to the op timeout; not for a reactor thread: use
    /// [`EtcdDirectory::resolve_async`] there).
    pub fn resolve(&self, node: &str) -> Result<NodeRecord, DirectoryError> {
        check_name(node)?;
        self.here()?;
        if let Some(r) = self.mirror.node(node) {
            return Ok(r);
        }
        wait(self.ask(node)?)?;
        self.mirror
            .node(node)
            .ok_or_else(|| DirectoryError::NotFound(node.to_string()))
    }

    /// [`EtcdDirectory::resolve`] as a future any executor can await: the
    /// answer comes back over a oneshot channel, so the awaiting thread
    /// never blocks.
    pub fn resolve_async(
        &self,
        node: &str,
    ) -> impl Future<Output = Result<NodeRecord, DirectoryError>> + 'static {
        let node = node.to_string();
        let mirror = self.mirror.clone();
        let asked = match check_name(&node).and_then(|()| self.here()) {
            Err(e) => Err(e),
            Ok(()) if mirror.node(&node).is_some() => Ok(None),
            Ok(()) => self.ask(&node).map(Some),
        };
        async move {
            if let Some(rx) = asked? {
                rx.await.map_err(|_| DirectoryError::Closed)??;
            }
            mirror.node(&node).ok_or(DirectoryError::NotFound(node))
        }
    }

    fn ask(
        &self,
        node: &str,
    ) -> Result<oneshot::Receiver<Result<(), DirectoryError>>, DirectoryError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Lookup(node.to_string(), tx))?;
        Ok(rx)
    }

    /// The segment `name` of `node`, from the mirror or etcd.
    pub fn segment(&self, node: &str, name: &str) -> Result<SegmentRecord, DirectoryError> {
        check_name(name)?;
        self.here()?;
        if let Some(s) = self.mirror.segment(node, name) {
            return Ok(s);
        }
        // Asked of etcd even when the node is cached: the watch may not
        // have delivered a segment published a moment ago, and with etcd
        // away the answer is `Unavailable`, not a `NotFound` it cannot know.
        check_name(node)?;
        wait(self.ask(node)?)?;
        self.mirror
            .segment(node, name)
            .ok_or_else(|| DirectoryError::NotFound(format!("{node}/{name}")))
    }

    /// Every segment `node` publishes, as the mirror knows them now (after
    /// resolving `node`).
    pub fn segments(&self, node: &str) -> Result<Vec<SegmentRecord>, DirectoryError> {
        self.resolve(node)?;
        Ok(self.mirror.segments_of(node))
    }

    /// The mirror's copy of `node` without asking etcd (`None` if unknown).
    pub fn cached(&self, node: &str) -> Option<NodeRecord> {
        self.here().ok()?;
        self.mirror.node(node)
    }

    /// Changes the watch sees from now on, and the link going down or up.
    pub fn subscribe(&self) -> mpsc::Receiver<Change> {
        if self.here().is_err() {
            // A forked child's copy: nothing changes here.
            return mpsc::channel().1;
        }
        self.mirror.subscribe()
    }

    /// Whether a session with etcd is up now (lease held, watch running).
    pub fn is_available(&self) -> bool {
        self.here().is_ok() && self.mirror.link() == Link::Up
    }

    /// The options it runs with.
    pub fn options(&self) -> &EtcdOptions {
        &self.options
    }
}

/// Blocks on the helper's answer. Every etcd call the helper makes is
/// bounded by the op timeout, so the answer comes in bounded time; not for
/// a thread that runs a tokio runtime.
fn wait(rx: oneshot::Receiver<Result<(), DirectoryError>>) -> Result<(), DirectoryError> {
    rx.blocking_recv().unwrap_or(Err(DirectoryError::Closed))
}

impl Drop for EtcdDirectory {
    fn drop(&mut self) {
        if self.here().is_err() {
            // A forked child's copy: the helper, its queue and the lease
            // are the parent's, left alone (nothing to join here).
            std::mem::forget(self.commands.take());
            std::mem::forget(self.helper.take());
            return;
        }
        // Closing the queue tells the helper to revoke the lease and stop.
        self.commands.take();
        if let Some(h) = self.helper.take() {
            let _ = h.join();
        }
    }
}
