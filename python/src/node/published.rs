//! This node's registered ranges in the directory (etcd; P2P publishes
//! nothing): each published under the id of its registration, and
//! withdrawn by that id, so that a withdraw never deletes the record of a
//! newer registration at the same address.

use quiesce_directory::SegmentRecord;

use super::{lock, Node};

impl Node {
    /// Publishes a registered range (etcd; nothing to do for P2P). Never
    /// blocks: the directory writes it from its helper thread.
    pub(crate) fn published(&self, id: u64, addr: u64, len: u64) {
        let rec = SegmentRecord {
            node: self.name.clone(),
            name: format!("{addr:#x}"),
            id,
            base: addr,
            len,
            read: true,
            write: true,
        };
        lock(&self.published_ids).insert(addr, id);
        if let Err(e) = self.directory.publish_segment(&rec) {
            tracing::warn!(error = %e, "register_memory: not published");
        }
    }

    /// The registration id published at `addr`, read before its range is
    /// taken back (a register of the address may follow at once).
    pub(crate) fn published_id(&self, addr: u64) -> Option<u64> {
        lock(&self.published_ids).get(&addr).copied()
    }

    /// Withdraws the range registration `id` (from [`published_id`]) had
    /// at `addr`, taken back (etcd; nothing to do for P2P): not a newer
    /// registration's record there.
    ///
    /// [`published_id`]: Self::published_id
    pub(crate) fn withdrawn(&self, addr: u64, id: Option<u64>) {
        {
            let mut ids = lock(&self.published_ids);
            if id.is_some() && ids.get(&addr).copied() == id {
                ids.remove(&addr);
            }
        }
        let _ = self
            .directory
            .withdraw_segment(&self.name, &format!("{addr:#x}"), id);
    }
}
