//! What the directory holds, and how it is laid out under a prefix.
//!
//! Keys (`docs/PROTOCOL.md` §8):
//!
//! * `<prefix>/nodes/<node>` → a [`NodeRecord`]
//! * `<prefix>/segments/<node>/<segment>` → a [`SegmentRecord`]
//!
//! Values are `key=value` lines, UTF-8, in any order; unknown keys are
//! ignored (so later versions can add fields), missing or malformed known
//! ones make the entry [`Malformed`](crate::DirectoryError::Malformed). No
//! value ever carries a token or a secret: access is still proven to the
//! target itself, over the session.

use std::fmt::Write as _;
use std::net::SocketAddr;

use crate::DirectoryError;

/// The longest node or segment name the directory accepts, in bytes.
pub const MAX_NAME: usize = 255;

/// How to reach a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRecord {
    /// The node's name (unique under the prefix).
    pub node: String,
    /// The address its engine listens on (the TCP control plane).
    pub addr: SocketAddr,
    /// The transport its segments are served over: `"tcp"` or `"rdma"`.
    pub fabric: String,
}

/// A segment a node serves: what an initiator needs to address it, never
/// what opens it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentRecord {
    /// The serving node.
    pub node: String,
    /// The segment's name on that node.
    pub name: String,
    /// The segment's id on that node (it changes when the name is
    /// registered again).
    pub id: u64,
    /// The address of its first byte in the node's memory (what Mooncake's
    /// callers address remote memory by).
    pub base: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Peers may read it.
    pub read: bool,
    /// Peers may write it.
    pub write: bool,
}

/// Checks a node or segment name: 1 to [`MAX_NAME`] bytes, no `/`, no
/// whitespace or control characters (they would make keys ambiguous).
pub fn check_name(name: &str) -> Result<(), DirectoryError> {
    let bad = name.is_empty()
        || name.len() > MAX_NAME
        || name
            .chars()
            .any(|c| c == '/' || c.is_whitespace() || c.is_control());
    match bad {
        true => Err(DirectoryError::BadName(name.to_string())),
        false => Ok(()),
    }
}

/// One parsed key under the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Key {
    Node(String),
    Segment(String, String),
}

/// The key layout under one prefix.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// The prefix with its trailing `/`.
    root: String,
}

impl Layout {
    pub(crate) fn new(prefix: &str) -> Layout {
        Layout {
            root: format!("{}/", prefix.trim_end_matches('/')),
        }
    }

    /// Everything the directory owns.
    pub(crate) fn root(&self) -> &str {
        &self.root
    }

    pub(crate) fn node(&self, node: &str) -> String {
        format!("{}nodes/{node}", self.root)
    }

    pub(crate) fn segment(&self, node: &str, name: &str) -> String {
        format!("{}segments/{node}/{name}", self.root)
    }

    /// The prefix of every segment of `node`.
    pub(crate) fn segments_of(&self, node: &str) -> String {
        format!("{}segments/{node}/", self.root)
    }

    /// What `key` names, if it is one of ours.
    pub(crate) fn parse(&self, key: &[u8]) -> Option<Key> {
        let key = std::str::from_utf8(key).ok()?.strip_prefix(&self.root)?;
        let parts: Vec<&str> = key.split('/').collect();
        let ok = |s: &str| check_name(s).is_ok();
        match parts.as_slice() {
            ["nodes", n] if ok(n) => Some(Key::Node(n.to_string())),
            ["segments", n, s] if ok(n) && ok(s) => {
                Some(Key::Segment(n.to_string(), s.to_string()))
            }
            _ => None,
        }
    }
}

fn fields(value: &[u8]) -> Option<Vec<(&str, &str)>> {
    let text = std::str::from_utf8(value).ok()?;
    Some(
        text.lines()
            .filter(|l| !l.is_empty())
            .filter_map(|l| l.split_once('='))
            .collect(),
    )
}

fn field<'a>(f: &[(&'a str, &'a str)], name: &str) -> Option<&'a str> {
    f.iter().find(|(k, _)| *k == name).map(|(_, v)| *v)
}

impl NodeRecord {
    pub(crate) fn encode(&self) -> Vec<u8> {
        format!("addr={}\nfabric={}\n", self.addr, self.fabric).into_bytes()
    }

    pub(crate) fn decode(node: &str, value: &[u8]) -> Option<NodeRecord> {
        let f = fields(value)?;
        let fabric = field(&f, "fabric")?;
        if fabric != "tcp" && fabric != "rdma" {
            return None;
        }
        Some(NodeRecord {
            node: node.to_string(),
            addr: field(&f, "addr")?.parse().ok()?,
            fabric: fabric.to_string(),
        })
    }
}

impl SegmentRecord {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut rights = String::new();
        if self.read {
            rights.push('r');
        }
        if self.write {
            rights.push('w');
        }
        let mut s = String::new();
        let _ = write!(
            s,
            "id={}\nbase={}\nlen={}\nrights={rights}\n",
            self.id, self.base, self.len
        );
        s.into_bytes()
    }

    pub(crate) fn decode(node: &str, name: &str, value: &[u8]) -> Option<SegmentRecord> {
        let f = fields(value)?;
        // What `encode` writes, nothing else ("" for neither).
        let rights = field(&f, "rights")?;
        if !matches!(rights, "" | "r" | "w" | "rw") {
            return None;
        }
        let base: u64 = field(&f, "base")?.parse().ok()?;
        let len: u64 = field(&f, "len")?.parse().ok()?;
        base.checked_add(len)?;
        Some(SegmentRecord {
            node: node.to_string(),
            name: name.to_string(),
            id: field(&f, "id")?.parse().ok()?,
            base,
            len,
            read: rights.contains('r'),
            write: rights.contains('w'),
        })
    }

    /// Whether `addr..addr + len` lies inside this segment.
    pub fn holds(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && (addr - self.base)
                .checked_add(len)
                .is_some_and(|end| end <= self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let n = NodeRecord {
            node: "a".into(),
            addr: "10.0.0.1:7000".parse().unwrap(),
            fabric: "tcp".into(),
        };
        assert_eq!(NodeRecord::decode("a", &n.encode()), Some(n));
        let s = SegmentRecord {
            node: "a".into(),
            name: "kv".into(),
            id: 3,
            base: 1 << 40,
            len: 4096,
            read: true,
            write: false,
        };
        assert_eq!(
            SegmentRecord::decode("a", "kv", &s.encode()),
            Some(s.clone())
        );
        assert!(s.holds(1 << 40, 4096) && !s.holds((1 << 40) + 1, 4096));
        assert!(!s.holds(u64::MAX, 2));
        for bad in [
            &b"addr=nonsense\nfabric=tcp\n"[..],
            b"addr=1.2.3.4:5\nfabric=carrier-pigeon\n",
            b"\xff\xfe",
            b"",
        ] {
            assert_eq!(NodeRecord::decode("a", bad), None, "{bad:?}");
        }
        let overflow = format!("id=1\nbase={}\nlen=2\nrights=rw\n", u64::MAX);
        assert_eq!(SegmentRecord::decode("a", "kv", overflow.as_bytes()), None);
        for rights in ["rwx", "wr", "rrw", "R"] {
            let bad = format!("id=1\nbase=0\nlen=2\nrights={rights}\n");
            assert_eq!(SegmentRecord::decode("a", "kv", bad.as_bytes()), None);
        }
    }

    #[test]
    fn keys_parse_only_under_the_prefix_and_with_good_names() {
        let l = Layout::new("quiesce/");
        assert_eq!(l.node("a"), "quiesce/nodes/a");
        assert_eq!(l.parse(b"quiesce/nodes/a"), Some(Key::Node("a".into())));
        assert_eq!(
            l.parse(l.segment("a", "kv").as_bytes()),
            Some(Key::Segment("a".into(), "kv".into()))
        );
        for k in [
            &b"other/nodes/a"[..],
            b"quiesce/nodes/",
            b"quiesce/nodes/a/b",
            b"quiesce/segments/a",
            b"quiesce/segments/a/k v",
            b"quiesce/mooncake/ram/a",
        ] {
            assert_eq!(l.parse(k), None, "{k:?}");
        }
        assert!(check_name("host:1234").is_ok());
        assert!(check_name("").is_err() && check_name("a/b").is_err());
        assert!(check_name(&"x".repeat(MAX_NAME + 1)).is_err());
    }
}
