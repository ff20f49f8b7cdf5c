//! quiesce's segment directory: how an initiator finds a node's endpoint
//! and the segments it serves, by name.
//!
//! Two backends behind one [`Directory`]:
//!
//! * **P2P** — no metadata server. A node's name is its `host:port`; its
//!   segments are learned from the hello exchange when a session opens
//!   (what `P2PHANDSHAKE` means in Mooncake's terms).
//! * **etcd** — [`EtcdDirectory`]: each node publishes its endpoint and its
//!   segment descriptors (never a token or a secret) under a prefix, **under
//!   a lease with keep-alive**, so a dead node's entries vanish within the
//!   TTL. Initiators keep a mirror of the prefix current with a **watch**,
//!   serve lookups from it (and keep serving them while etcd is away), and
//!   ask etcd only on a miss. The etcd client runs on its own helper thread
//!   and tokio runtime: publishing only queues, so a reactor never blocks.
//!
//! [`LocalEtcd`] starts a private etcd server (tests, demos, a dev cluster).
//!
//! ```no_run
//! use quiesce_directory::{Directory, NodeRecord};
//! let dir = Directory::open("etcd://127.0.0.1:2379/quiesce").unwrap();
//! dir.publish_node(&NodeRecord {
//!     node: "prefill-0".into(),
//!     addr: "10.0.0.1:7000".parse().unwrap(),
//!     fabric: "tcp".into(),
//! }).unwrap();
//! let peer = dir.resolve("decode-3").unwrap();
//! println!("decode-3 listens on {}", peer.addr);
//! let kv = dir.locate("decode-3/kv").unwrap(); // node/segment
//! println!("its kv segment: {:?}", kv.record);
//! ```
#![deny(missing_docs)]

mod etcd;
mod mirror;
mod record;
mod server;

use std::net::ToSocketAddrs;
use std::time::Duration;

pub use etcd::{EtcdDirectory, EtcdOptions};
pub use mirror::Change;
pub use record::{check_name, NodeRecord, SegmentRecord, MAX_NAME};
pub use server::LocalEtcd;

/// What went wrong with a lookup or a publication.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DirectoryError {
    /// The directory URL cannot be used.
    #[error("directory {url:?}: {why} (expected \"P2PHANDSHAKE\" or etcd://host:port[,host:port][/prefix])")]
    BadUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// A node or segment name is empty, too long, or holds `/`, whitespace
    /// or control characters.
    #[error("bad name {0:?}: 1 to 255 bytes, no '/', whitespace or control characters")]
    BadName(String),
    /// The directory has no entry by that name (the node never published
    /// it, withdrew it, or died and its lease expired).
    #[error("{0:?} is not in the directory")]
    NotFound(String),
    /// etcd cannot be reached and the name is not cached.
    #[error("the directory is unavailable: {0}")]
    Unavailable(String),
    /// An entry under the prefix is not one quiesce wrote.
    #[error("malformed directory entry {0:?}")]
    Malformed(String),
    /// The backend cannot answer this kind of question.
    #[error("{0}")]
    Unsupported(&'static str),
    /// The directory was closed.
    #[error("the directory is closed")]
    Closed,
}

/// A `node/segment` path, resolved ([`Directory::locate`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    /// How to reach the node.
    pub node: NodeRecord,
    /// The segment's name on it.
    pub segment: String,
    /// On etcd, the segment's published descriptor (its id, base and
    /// length: an initiator checks the segment it opens against it). P2P:
    /// `None` — the peer's hello brings the descriptor.
    pub record: Option<SegmentRecord>,
}

/// A directory of nodes and segments: P2P or etcd.
pub enum Directory {
    /// Names are `host:port`; segments come with the hello exchange.
    P2p,
    /// Published under a lease in etcd and watched.
    Etcd(EtcdDirectory),
}

impl Directory {
    /// `"P2PHANDSHAKE"` (or `"p2p"`) for [`Directory::P2p`];
    /// `etcd://host:port[,host:port…][/prefix]` for etcd with default
    /// [`EtcdOptions`] (TTL 10 s; `QUIESCE_DIRECTORY_TTL` overrides it, in
    /// seconds).
    pub fn open(url: &str) -> Result<Directory, DirectoryError> {
        if url == "P2PHANDSHAKE" || url.eq_ignore_ascii_case("p2p") {
            return Ok(Directory::P2p);
        }
        let mut o = EtcdOptions::from_url(url)?;
        if let Some(ttl) = std::env::var("QUIESCE_DIRECTORY_TTL")
            .ok()
            .and_then(|t| t.parse::<i64>().ok())
        {
            o.ttl_secs = ttl.clamp(1, 3600);
        }
        EtcdDirectory::start(o).map(Directory::Etcd)
    }

    /// Publishes this node's endpoint (P2P: nothing to do, the hello
    /// carries it). Never blocks.
    pub fn publish_node(&self, rec: &NodeRecord) -> Result<(), DirectoryError> {
        match self {
            Directory::P2p => check_name(&rec.node),
            Directory::Etcd(e) => e.publish_node(rec),
        }
    }

    /// Publishes a segment descriptor (P2P: nothing to do). Never blocks.
    pub fn publish_segment(&self, rec: &SegmentRecord) -> Result<(), DirectoryError> {
        match self {
            Directory::P2p => check_name(&rec.name),
            Directory::Etcd(e) => e.publish_segment(rec),
        }
    }

    /// Withdraws a segment descriptor (P2P: nothing to do) — with `id`,
    /// only while the name's record is that registration's. Never blocks.
    pub fn withdraw_segment(
        &self,
        node: &str,
        name: &str,
        id: Option<u64>,
    ) -> Result<(), DirectoryError> {
        match self {
            Directory::P2p => check_name(name),
            Directory::Etcd(e) => e.withdraw_segment(node, name, id),
        }
    }

    /// Waits until what was published is in the directory (P2P: at once).
    pub fn flush(&self, timeout: Duration) -> Result<(), DirectoryError> {
        match self {
            Directory::P2p => Ok(()),
            Directory::Etcd(e) => e.flush(timeout),
        }
    }

    /// How to reach `node`. P2P: `node` is `host:port` (resolved by the
    /// system resolver). etcd: the mirror, else etcd (blocking up to the
    /// op timeout).
    pub fn resolve(&self, node: &str) -> Result<NodeRecord, DirectoryError> {
        match self {
            Directory::P2p => {
                let addrs = node
                    .to_socket_addrs()
                    .map_err(|e| DirectoryError::NotFound(format!("{node} ({e})")))?;
                let addr =
                    prefer_ipv4(addrs).ok_or_else(|| DirectoryError::NotFound(node.to_string()))?;
                Ok(NodeRecord {
                    node: node.to_string(),
                    addr,
                    fabric: "tcp".into(),
                })
            }
            Directory::Etcd(e) => e.resolve(node),
        }
    }

    /// The segments `node` publishes (etcd only: P2P learns them from the
    /// hello exchange).
    pub fn segments(&self, node: &str) -> Result<Vec<SegmentRecord>, DirectoryError> {
        match self {
            Directory::P2p => Err(DirectoryError::Unsupported(
                "a P2P directory lists no segments: they come with the peer's hello",
            )),
            Directory::Etcd(e) => e.segments(node),
        }
    }

    /// Resolves a `node/segment` path: the node (as [`resolve`](Self::resolve)
    /// does) and, on etcd, the segment's descriptor — `NotFound` naming the
    /// path when the node publishes no segment by that name (it never did,
    /// withdrew it, or died). P2P: `host:port/segment`, the segment
    /// unchecked until it is opened.
    pub fn locate(&self, path: &str) -> Result<Located, DirectoryError> {
        let Some((node, segment)) = path.split_once('/') else {
            return Err(DirectoryError::BadName(format!(
                "{path} (a path is node/segment)"
            )));
        };
        check_name(segment)?;
        let rec = self.resolve(node)?;
        let record = match self {
            Directory::P2p => None,
            Directory::Etcd(e) => Some(e.segment(node, segment)?),
        };
        Ok(Located {
            node: rec,
            segment: segment.to_string(),
            record,
        })
    }

    /// Which backend: `"p2p"` or `"etcd"`.
    pub fn backend(&self) -> &'static str {
        match self {
            Directory::P2p => "p2p",
            Directory::Etcd(_) => "etcd",
        }
    }
}

/// The address to use of those a name resolves to: the first IPv4 one,
/// else the first. An engine given a host name listens on its IPv4
/// address when it has one, and resolvers often list IPv6 first
/// (`localhost` is `::1` then `127.0.0.1` on many hosts): the first answer
/// was refused there.
pub fn prefer_ipv4(
    addrs: impl IntoIterator<Item = std::net::SocketAddr>,
) -> Option<std::net::SocketAddr> {
    let mut first = None;
    for a in addrs {
        if a.is_ipv4() {
            return Some(a);
        }
        first.get_or_insert(a);
    }
    first
}

#[cfg(test)]
mod tests {
    use super::prefer_ipv4;

    #[test]
    fn the_first_ipv4_address_is_preferred_to_an_ipv6_one_listed_first() {
        let v6 = "[::1]:7000".parse().unwrap();
        let v4 = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(prefer_ipv4([v6, v4]), Some(v4));
        assert_eq!(prefer_ipv4([v6]), Some(v6));
        assert_eq!(prefer_ipv4([]), None);
    }
}
