//! Which of this node's keys are this process's to write back or delete:
//! another process may write the same key after it (a newer incarnation of
//! the node, or a duplicate name), and the newest writer owns it. Every
//! write back and every delete is a transaction whose condition says the
//! key is still this process's.

use std::collections::{BTreeMap, BTreeSet};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

/// What this process knows of its keys in etcd.
#[derive(Default)]
pub(super) struct Ownership {
    /// The entries this process wrote, with the revision and the lease of
    /// its last write: what it owns. (The lease too: a wiped etcd numbers
    /// revisions from 1 again, and another process's write may get this
    /// one's number; lease ids are not reused.)
    pub(super) written: BTreeMap<String, Written>,
    /// Published since its last write (while away): this process's to
    /// write whoever wrote it meanwhile, as a publication with a session is.
    pub(super) fresh: BTreeSet<String>,
    /// Written back under this lease in a transaction whose answer never
    /// came: this process's while it holds that lease (the transaction
    /// committed), not otherwise.
    uncertain: BTreeMap<String, i64>,
}

/// This process's last write of a key.
#[derive(Clone, Copy)]
pub(super) struct Written {
    revision: i64,
    lease: i64,
}

impl Written {
    /// The comparisons that hold while the key is still that write.
    fn holds(&self, key: &str) -> [Compare; 2] {
        [
            Compare::mod_revision(key, CompareOp::Equal, self.revision),
            Compare::lease(key, CompareOp::Equal, self.lease),
        ]
    }
}

impl Ownership {
    /// `key` was written at `revision` under `lease`: this process's now.
    pub(super) fn wrote(&mut self, key: &str, revision: i64, lease: i64) {
        self.fresh.remove(key);
        self.uncertain.remove(key);
        self.written
            .insert(key.to_string(), Written { revision, lease });
    }

    /// `keys` are about to be written back under `lease`, in a transaction
    /// whose answer may be lost (a timeout) after it committed.
    /// Until its answer is in, a key is also this process's if it holds
    /// `lease` (the write committed); never whoever holds it, as a fresh
    /// publication is: a key another process wrote since, this write back
    /// did not take.
    pub(super) fn writing_back<'a>(&mut self, keys: impl Iterator<Item = &'a str>, lease: i64) {
        for k in keys.filter(|k| !self.fresh.contains(*k)) {
            self.uncertain.insert(k.to_string(), lease);
        }
    }

    /// This process gives `key` up (another wrote it, or it was deleted).
    pub(super) fn forget(&mut self, key: &str) {
        self.written.remove(key);
        self.uncertain.remove(key);
    }

    /// Deletes `key` if it still holds this process's last write of it;
    /// `None` if this process never wrote it.
    pub(super) fn delete_own(&self, key: &str) -> Option<Txn> {
        let w = self.written.get(key)?;
        Some(
            Txn::new()
                .when(w.holds(key))
                .and_then([TxnOp::delete(key, None)]),
        )
    }

    /// Writes `key = value` under `lease`: published since its last write,
    /// whoever holds it; else if nobody holds the key, or it still holds
    /// this process's last write, or the lease of a write back whose answer
    /// was lost (each tried in turn, nested: see [`wrote`]).
    pub(super) fn put_own(&self, key: &str, value: &[u8], lease: i64) -> Txn {
        let put = || TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)));
        if self.fresh.contains(key) {
            return Txn::new().and_then([put()]);
        }
        let uncertain = self.uncertain.get(key).map(|&l| {
            Txn::new()
                .when([Compare::lease(key, CompareOp::Equal, l)])
                .and_then([put()])
        });
        let ours = match self.written.get(key) {
            Some(w) => Some(
                Txn::new()
                    .when(w.holds(key))
                    .and_then([put()])
                    .or_else(uncertain.map(TxnOp::txn).into_iter().collect::<Vec<_>>()),
            ),
            None => uncertain,
        };
        Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([put()])
            .or_else(ours.map(TxnOp::txn).into_iter().collect::<Vec<_>>())
    }
}

/// Whether the answer to one [`Ownership::put_own`] says it wrote: the key
/// was free, or (a nested transaction, at any depth) still this process's.
pub(super) fn wrote(r: &TxnOpResponse) -> bool {
    let TxnOpResponse::Txn(r) = r else {
        return false;
    };
    r.succeeded() || r.op_responses().first().is_some_and(wrote)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalEtcd;
    use etcd_client::Client;

    /// `put_own(key, value, lease)` run as the helper runs it (nested in a
    /// transaction of its own): whether it wrote, and the key's value.
    async fn put(c: &mut Client, own: &Ownership, key: &str, value: &[u8], lease: i64) -> bool {
        let r = c
            .txn(Txn::new().and_then([TxnOp::txn(own.put_own(key, value, lease))]))
            .await
            .unwrap();
        wrote(&r.op_responses()[0])
    }

    async fn value(c: &mut Client, key: &str) -> Vec<u8> {
        let r = c.get(key, None).await.unwrap();
        r.kvs()
            .first()
            .map(|kv| kv.value().to_vec())
            .unwrap_or_default()
    }

    /// A write back whose answer was lost (the session's setup failed or
    /// timed out there) leaves the key this process's only if that write
    /// committed: it made the key "fresh", and the next session wrote it
    /// whoever held it — over the entry of a newer incarnation of the node,
    /// which then gave the name up to the stale one for good.
    #[test]
    fn a_write_back_whose_answer_was_lost_does_not_overwrite_a_newer_writer() {
        if !LocalEtcd::available() {
            assert!(std::env::var("CI").is_err(), "CI=true but no etcd binary");
            eprintln!("skipped: no etcd binary (apt-get install etcd-server)");
            return;
        }
        let etcd = LocalEtcd::start().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
            let grant = async || c.clone().lease_grant(60, None).await.unwrap().id();
            let (l1, l2, l3, theirs) = (grant().await, grant().await, grant().await, grant().await);
            for committed in [false, true] {
                let key = format!("q/nodes/n{committed}");
                let mut own = Ownership::default();
                // Session 1 wrote the key.
                assert!(put(&mut c, &own, &key, b"mine", l1).await);
                let rev = c.get(key.as_str(), None).await.unwrap().kvs()[0].mod_revision();
                own.wrote(&key, rev, l1);
                // Session 2's write back, its answer lost.
                own.writing_back([key.as_str()].into_iter(), l2);
                if committed {
                    let opts = PutOptions::new().with_lease(l2);
                    c.put(key.as_str(), "mine", Some(opts)).await.unwrap();
                } else {
                    // Session 1's entry expired; a newer incarnation wrote.
                    c.delete(key.as_str(), None).await.unwrap();
                    let opts = PutOptions::new().with_lease(theirs);
                    c.put(key.as_str(), "theirs", Some(opts)).await.unwrap();
                }
                // Session 3 writes back.
                let wrote_it = put(&mut c, &own, &key, b"mine again", l3).await;
                let now = value(&mut c, &key).await;
                if committed {
                    assert!(wrote_it, "its own write of session 2 is not this process's");
                    assert_eq!(now, b"mine again");
                } else {
                    assert!(!wrote_it, "written over a newer writer's entry");
                    assert_eq!(now, b"theirs");
                }
            }
        });
    }
}
