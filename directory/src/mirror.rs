//! The initiator's copy of the directory: every node and segment under the
//! prefix, kept current by a watch, readable from any thread without a
//! round trip, and kept (stale but useful) while etcd is unreachable.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard};

use crate::record::{NodeRecord, SegmentRecord};

/// A change the watch saw (or the link's state changing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A node appeared or changed its endpoint.
    Node(NodeRecord),
    /// A node's entry went away (withdrawn, or its lease expired: the node
    /// died or lost etcd for longer than the TTL).
    NodeGone(String),
    /// A segment appeared or was registered again (its id changed).
    Segment(SegmentRecord),
    /// A segment's entry went away.
    SegmentGone {
        /// The serving node.
        node: String,
        /// The segment's name.
        name: String,
    },
    /// etcd stopped answering: lookups are served from the cache, new names
    /// fail with [`Unavailable`](crate::DirectoryError::Unavailable).
    Unavailable(String),
    /// etcd answers again; this node's entries were published again.
    Available,
}

/// Whether the helper thread has a working session with etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Link {
    /// Not yet connected.
    Connecting,
    /// Lease held, entries published, watch running.
    Up,
    /// Lost; the reason.
    Down(String),
    /// The directory was closed.
    Closed,
}

#[derive(Default)]
struct State {
    nodes: HashMap<String, NodeRecord>,
    segments: HashMap<(String, String), SegmentRecord>,
    subscribers: Vec<mpsc::Sender<Change>>,
    link: Option<Link>,
}

/// The shared copy.
#[derive(Default)]
pub(crate) struct Mirror {
    state: Mutex<State>,
}

impl Mirror {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn link(&self) -> Link {
        self.lock().link.clone().unwrap_or(Link::Connecting)
    }

    pub(crate) fn node(&self, node: &str) -> Option<NodeRecord> {
        self.lock().nodes.get(node).cloned()
    }

    pub(crate) fn segment(&self, node: &str, name: &str) -> Option<SegmentRecord> {
        self.lock()
            .segments
            .get(&(node.to_string(), name.to_string()))
            .cloned()
    }

    pub(crate) fn segments_of(&self, node: &str) -> Vec<SegmentRecord> {
        let mut v: Vec<SegmentRecord> = self
            .lock()
            .segments
            .values()
            .filter(|s| s.node == node)
            .cloned()
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub(crate) fn subscribe(&self) -> mpsc::Receiver<Change> {
        let (tx, rx) = mpsc::channel();
        self.lock().subscribers.push(tx);
        rx
    }

    fn tell(state: &mut State, change: Change) {
        state.subscribers.retain(|s| s.send(change.clone()).is_ok());
    }

    pub(crate) fn set_link(&self, link: Link) {
        let mut s = self.lock();
        if s.link.as_ref() == Some(&link) {
            return;
        }
        let change = match &link {
            Link::Up => Some(Change::Available),
            Link::Down(why) if !matches!(s.link, Some(Link::Down(_))) => {
                Some(Change::Unavailable(why.clone()))
            }
            _ => None,
        };
        s.link = Some(link);
        if let Some(c) = change {
            Self::tell(&mut s, c);
        }
    }

    pub(crate) fn put_node(&self, rec: NodeRecord) {
        let mut s = self.lock();
        if s.nodes.get(&rec.node) != Some(&rec) {
            s.nodes.insert(rec.node.clone(), rec.clone());
            Self::tell(&mut s, Change::Node(rec));
        }
    }

    pub(crate) fn put_segment(&self, rec: SegmentRecord) {
        let mut s = self.lock();
        let key = (rec.node.clone(), rec.name.clone());
        if s.segments.get(&key) != Some(&rec) {
            s.segments.insert(key, rec.clone());
            Self::tell(&mut s, Change::Segment(rec));
        }
    }

    pub(crate) fn remove_node(&self, node: &str) {
        let mut s = self.lock();
        if s.nodes.remove(node).is_some() {
            Self::tell(&mut s, Change::NodeGone(node.to_string()));
        }
    }

    pub(crate) fn remove_segment(&self, node: &str, name: &str) {
        let mut s = self.lock();
        if s.segments
            .remove(&(node.to_string(), name.to_string()))
            .is_some()
        {
            Self::tell(
                &mut s,
                Change::SegmentGone {
                    node: node.to_string(),
                    name: name.to_string(),
                },
            );
        }
    }

    /// Replaces everything with a fresh read of the whole prefix, telling
    /// subscribers what differs (what went away while the watch was down).
    pub(crate) fn reload(&self, nodes: Vec<NodeRecord>, segments: Vec<SegmentRecord>) {
        // Sets of what was read: linear in the entries (a scan per cached
        // entry took seconds at tens of thousands of segments).
        let read_nodes: HashSet<&str> = nodes.iter().map(|n| n.node.as_str()).collect();
        let read_segments: HashSet<(&str, &str)> = segments
            .iter()
            .map(|r| (r.node.as_str(), r.name.as_str()))
            .collect();
        let gone_nodes: Vec<String> = {
            let s = self.lock();
            s.nodes
                .keys()
                .filter(|k| !read_nodes.contains(k.as_str()))
                .cloned()
                .collect()
        };
        let gone_segments: Vec<(String, String)> = {
            let s = self.lock();
            s.segments
                .keys()
                .filter(|(n, name)| !read_segments.contains(&(n.as_str(), name.as_str())))
                .cloned()
                .collect()
        };
        for (n, name) in gone_segments {
            self.remove_segment(&n, &name);
        }
        for n in gone_nodes {
            self.remove_node(&n);
        }
        for n in nodes {
            self.put_node(n);
        }
        for s in segments {
            self.put_segment(s);
        }
    }
}
