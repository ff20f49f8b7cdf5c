//! Which of this node's keys are this process's to write back or delete:
//! another process may write the same key after it (a newer incarnation of
//! the node, or a duplicate name), and the newest writer owns it. Every
//! write back and every delete is a transaction whose condition says the
//! key is still this process's.

use std::collections::{BTreeMap, BTreeSet};

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

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
    /// The lease of the session being set up, until it is up.
    granted: Option<i64>,
    /// Leases of session setups that failed after their grant: a write
    /// back under one may have committed with its answer lost, leaving a
    /// key under a lease `written` does not know. Revoked (their keys
    /// deleted) before the next write back, so that every key is free,
    /// this process's last known write, or another process's.
    abandoned: Vec<i64>,
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
        self.written
            .insert(key.to_string(), Written { revision, lease });
    }

    /// A session's setup was granted `lease`.
    pub(super) fn granted(&mut self, lease: i64) {
        self.granted = Some(lease);
    }

    /// The session being set up is up: its lease is the session's.
    pub(super) fn established(&mut self) {
        self.granted = None;
    }

    /// The session being set up failed (or timed out) after its grant.
    pub(super) fn setup_failed(&mut self) {
        if let Some(lease) = self.granted.take() {
            self.abandoned.push(lease);
        }
    }

    /// Revokes the leases of failed setups (one that expired already
    /// counts as revoked); `Err` leaves the rest for the next attempt.
    pub(super) async fn revoke_abandoned(&mut self, client: &mut Client) -> Result<(), String> {
        while let Some(&lease) = self.abandoned.last() {
            match client.lease_revoke(lease).await {
                Ok(_) => {}
                Err(e) if e.to_string().contains("lease not found") => {}
                Err(e) => return Err(e.to_string()),
            }
            self.abandoned.pop();
        }
        Ok(())
    }

    /// This process gives `key` up (another wrote it, or it was deleted).
    pub(super) fn forget(&mut self, key: &str) {
        self.written.remove(key);
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
    /// this process's last write (a nested transaction: see [`wrote`]).
    /// Run after [`revoke_abandoned`](Self::revoke_abandoned).
    pub(super) fn put_own(&self, key: &str, value: &[u8], lease: i64) -> Txn {
        let put = || TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)));
        if self.fresh.contains(key) {
            return Txn::new().and_then([put()]);
        }
        let ours = self
            .written
            .get(key)
            .map(|w| Txn::new().when(w.holds(key)).and_then([put()]));
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
    /// timed out there) may have committed, under a lease `written` does
    /// not know. It made the key "fresh", and the next session wrote it
    /// whoever held it — over the entry of a newer incarnation of the node,
    /// which then gave the name up to the stale one for good. Now the lost
    /// setups' leases are revoked first: a key they wrote is deleted, and
    /// free again; one a newer writer holds stays its.
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
            let granter = c.clone();
            let grant = async || granter.clone().lease_grant(60, None).await.unwrap().id();
            let theirs = grant().await;
            // How many setups in a row wrote the key back with their answer
            // lost (0: the one lost write did not commit; a newer
            // incarnation wrote the key instead).
            for committed in [0, 1, 2] {
                let key = format!("q/nodes/n{committed}");
                let mut own = Ownership::default();
                // Session 1 wrote the key.
                let l1 = grant().await;
                assert!(put(&mut c, &own, &key, b"mine", l1).await);
                let rev = c.get(key.as_str(), None).await.unwrap().kvs()[0].mod_revision();
                own.wrote(&key, rev, l1);
                // Setups whose write back's answer was lost.
                for _ in 0..committed.max(1) {
                    let lease = grant().await;
                    own.granted(lease);
                    if committed > 0 {
                        let opts = PutOptions::new().with_lease(lease);
                        c.put(key.as_str(), "mine", Some(opts)).await.unwrap();
                    }
                    own.setup_failed();
                }
                if committed == 0 {
                    // Session 1's entry expired; a newer incarnation wrote.
                    c.delete(key.as_str(), None).await.unwrap();
                    let opts = PutOptions::new().with_lease(theirs);
                    c.put(key.as_str(), "theirs", Some(opts)).await.unwrap();
                }
                // The next setup writes back.
                own.revoke_abandoned(&mut c).await.unwrap();
                let lease = grant().await;
                let wrote_it = put(&mut c, &own, &key, b"mine again", lease).await;
                let now = value(&mut c, &key).await;
                if committed > 0 {
                    assert!(
                        wrote_it,
                        "{committed}: its own lost write is not this process's"
                    );
                    assert_eq!(now, b"mine again");
                } else {
                    assert!(!wrote_it, "written over a newer writer's entry");
                    assert_eq!(now, b"theirs");
                }
            }
        });
    }
}
