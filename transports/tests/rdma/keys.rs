//! Remote keys: which queue pair an rkey works on, and how revokes,
//! deregistrations and new control connections kill the old ones.

use super::*;

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn revoke_rekeys_the_segment_so_the_nic_refuses_the_old_key_until_open_regrants() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, l) = p.remote.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        p.kv.revoke(0..4096).await.expect("revoke resolves");
        // The old handle carries the old rkey: the target's NIC refuses it.
        let mut l = l;
        fill(&mut l, 2);
        let (r, l) = p.remote.write(0, l, 2).await;
        assert!(matches!(r, Err(TransferError::RemoteAccess(_))), "{r:?}");
        let mut snap = vec![0u8; 4096];
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 1), "a write under the old key landed");
        // Proving the token again fetches the new key; writes land again.
        let fresh = p.remote.peer().open("kv", p.kv.token()).await.unwrap();
        let (r, _l) = fresh.write(0, l, 3).await;
        assert_eq!(r.unwrap(), 4096);
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 2));
        let s = p.initiator.stats();
        assert_eq!((s.in_flight, s.posted), (0, s.completed));
        drop(p.target);
    });
}

/// An rkey is a right only on the queue pair of a peer that proved the
/// segment's token: peer B, which proved only "other", posts with the key of
/// "kv" that peer A was given. The target's NIC refuses it (B's queue pair
/// is in a protection domain without that region) and nothing lands; A's
/// own writes with it still do.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn an_rkey_works_only_on_the_queue_pair_of_a_peer_that_proved_its_token() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let other = p
            .target
            .register(
                "other",
                AlignedBuf::new(1 << 20),
                Rights::READ | Rights::WRITE,
            )
            .unwrap();
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, l) = p.remote.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        drop(l);
        let learned = p.remote.remote_key().expect("A holds kv's key");

        let b = RdmaEngine::bind(RdmaConfig::default()).expect("engine B");
        let region_b = Region::new(1 << 20);
        let _local_b = b.register_region(&region_b).unwrap();
        let peer_b = b.connect(p.target.local_addr()).await.unwrap();
        let other_b = peer_b.open("other", other.token()).await.unwrap();
        let mut lb = region_b.lease(0..4096).unwrap();
        fill(&mut lb, 7);
        let (r, lb) = other_b.write(0, lb, 1).await;
        assert_eq!(r.unwrap(), 4096, "B's own segment works");
        let hostile = other_b.with_remote_key(learned);
        let (r, lb) = hostile.write(0, lb, 2).await;
        assert!(
            matches!(r, Err(TransferError::RemoteAccess(_))),
            "B wrote with A's rkey: {r:?}"
        );
        let (r, _lb) = hostile.read(0, 4096, lb, 3).await;
        assert!(
            matches!(r, Err(TransferError::RemoteAccess(_))),
            "B read with A's rkey: {r:?}"
        );
        let mut snap = vec![0u8; 4096];
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 1), "B's write landed in kv");

        // A's key still works on A's queue pair.
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 2);
        let (r, _l) = p.remote.write(0, l, 4).await;
        assert_eq!(r.unwrap(), 4096);
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 2));
        for s in [p.initiator.stats(), b.stats()] {
            assert_eq!((s.in_flight, s.posted), (0, s.completed));
        }
    });
}

/// Keys belong to the control connection's protection domain: when it is
/// replaced (here `abort` resets it; the next transfer reconnects, proves the
/// tokens again and builds a new queue pair), the peer's keys are replaced
/// with the new connection's. Transfers go on with the new key; the old one
/// is refused at the NIC and lands nothing.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_new_control_connection_brings_new_keys_and_the_old_ones_die() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, l) = p.remote.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        drop(l);
        let old = p
            .remote
            .remote_key()
            .expect("a key on the first connection");

        p.remote.peer().abort();
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 2);
        let (r, l) = p.remote.write(4096, l, 2).await;
        assert_eq!(r.unwrap(), 4096, "the write after a reconnect");
        let new = p.remote.remote_key().expect("a key on the new connection");
        assert_ne!(new, old, "the new connection kept the old domain's key");

        let stale = p.remote.with_remote_key(old);
        let mut l = l;
        fill(&mut l, 3);
        let (r, l) = stale.write(8192, l, 3).await;
        assert!(
            matches!(r, Err(TransferError::RemoteAccess(_))),
            "a write with the old connection's key: {r:?}"
        );
        drop(l);
        let mut snap = vec![0u8; 12288];
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(&snap[..4096], &pattern(4096, 1)[..]);
        assert_eq!(&snap[4096..8192], &pattern(4096, 2)[..]);
        assert!(
            snap[8192..].iter().all(|&b| b == 0),
            "the old key's write landed"
        );

        // The refused write put the queue pair in error; the next one
        // rebuilds it with the current key.
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 4);
        let (r, _l) = p.remote.write(0, l, 4).await;
        assert_eq!(r.unwrap(), 4096);
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(&snap[..4096], &pattern(4096, 4)[..]);
        let s = p.initiator.stats();
        assert_eq!((s.in_flight, s.posted), (0, s.completed));
    });
}

/// Deregistering through the TCP engine underneath (`control()`) withdraws
/// the segment from the NIC too: its keys die as with
/// `RdmaEngine::deregister`, and no write lands in it any more.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn deregistering_through_the_control_engine_kills_the_keys_too() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let (r, l) = p.remote.write(0, p.region.lease(0..64).unwrap(), 1).await;
        assert_eq!(r.unwrap(), 64);
        drop(l);
        assert!(p.target.control().deregister(p.kv.id()));
        let (r, _) = p.remote.write(0, p.region.lease(0..64).unwrap(), 2).await;
        assert!(matches!(r, Err(TransferError::RemoteAccess(_))), "{r:?}");
    });
}

/// A revoke whose memory region the device will not deregister still kills
/// the old key: the queue pair it was served on is reset, and no queue pair
/// is connected in that connection's domain again (its control connection
/// is closed; the next one gets a new domain, and a new key once the token
/// is proven again). The revoke resolved while the old key still worked,
/// and a write with it landed after.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_revoke_whose_region_stays_registered_still_kills_the_old_key() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, mut l) = p.remote.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        quiesce_transports::rdma::fail_next_deregistrations(1);
        p.kv.revoke(0..4096)
            .await
            .expect("the reset queue pair kills the key");
        fill(&mut l, 2);
        // Its queue pair at the target gone, the write fails once the
        // control connection the target closed is seen gone (it waited for
        // the idle timeout, 10 minutes, with the connection left open).
        let t = Instant::now();
        let (r, l) = p.remote.write(0, l, 2).await;
        assert!(r.is_err(), "a write under the old key: {r:?}");
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "an outcome after {:?}",
            t.elapsed()
        );
        let mut snap = vec![0u8; 4096];
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 1), "a write under the old key landed");
        // The token proven again, the peer gets through (on a new control
        // connection, after the old one is closed).
        served_again(&p, l, 3).await;
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 3));
    });
}

/// A revoke that could kill neither the region (it will not deregister) nor
/// the queue pair serving it (it will neither reset nor destroy) says so
/// (`KeysLive`) — and so does every later revoke, after the target closed
/// that poisoned connection: the queue pair stays connected with the old
/// key. The record of it went with the connection's domain, and the next
/// revoke of the range resolved as if every key were dead.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_key_left_live_is_reported_after_its_connection_closed() {
    use quiesce_transports::RevokeError;
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, _l) = p.remote.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        quiesce_transports::rdma::fail_next_deregistrations(1);
        quiesce_transports::rdma::fail_next_served_resets(1);
        let first = p.kv.revoke(0..4096).await;
        assert!(
            matches!(first, Err(RevokeError::KeysLive { .. })),
            "{first:?}"
        );
        // The target closes the poisoned connection meanwhile.
        sleep(Duration::from_millis(300)).await;
        let again = p.kv.revoke(0..4096).await;
        assert!(
            matches!(again, Err(RevokeError::KeysLive { .. })),
            "a later revoke resolved while the old key still works: {again:?}"
        );
    });
}

/// A handle opened before a revoke never posts with a key the revoke's
/// grant brought: after a reconnect (the new control connection proves the
/// grant the segment was opened under, so the target hands it no key of
/// the re-keyed segment) and after the segment is opened again (the new
/// key is the new handle's). Nothing of the old handle's writes lands.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_handle_opened_before_a_revoke_never_posts_with_a_key_of_the_newer_grant() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, mut l) = p.remote.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        p.kv.revoke(0..4096).await.expect("revoke resolves");
        p.remote.peer().abort();
        fill(&mut l, 2);
        let (r, mut l) = p.remote.write(0, l, 2).await;
        assert!(
            matches!(r, Err(TransferError::RemoteAccess(_))),
            "a write of the old handle after a reconnect: {r:?}"
        );
        let fresh = p.remote.peer().open("kv", p.kv.token()).await.unwrap();
        fill(&mut l, 3);
        let (r, mut l) = p.remote.write(0, l, 3).await;
        assert_eq!(r.unwrap_err(), TransferError::Revoked { landed: 0 });
        let mut snap = vec![0u8; 4096];
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 1), "an old handle's write landed");
        fill(&mut l, 4);
        let (r, _l) = fresh.write(0, l, 4).await;
        assert_eq!(r.unwrap(), 4096);
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 4));
        let s = p.initiator.stats();
        assert_eq!((s.in_flight, s.posted), (0, s.completed));
    });
}

/// A target that proves the token, then never answers the keys-only
/// `QpConnect` that follows (a frozen process, whose kernel still acks):
/// the open waited for good — it runs outside any batch, so no deadline
/// ends it. It now fails within the stall limit, and so does a link's
/// set-up stalled the same way, which every transfer to the peer waits
/// behind; the next ones reconnect and work.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn an_unanswered_queue_pair_exchange_fails_within_the_stall_limit() {
    use quiesce_runtime::time::timeout;
    use quiesce_transports::rdma::stall_next_qp_accepts;
    use quiesce_transports::EngineConfig;

    Runtime::new().unwrap().block_on(async {
        let (target, kv) = kv_target(1 << 20);
        let init = RdmaEngine::bind(RdmaConfig {
            control: EngineConfig {
                stall_timeout: Some(Duration::from_secs(1)),
                ..EngineConfig::default()
            },
            ..RdmaConfig::default()
        })
        .unwrap();
        let region = Region::new(1 << 20);
        let _local = init.register_region(&region).unwrap();
        let peer = init.connect(target.local_addr()).await.unwrap();
        let wait = Duration::from_secs(20);

        stall_next_qp_accepts(1);
        let t0 = Instant::now();
        let r = timeout(wait, peer.open("kv", kv.token()))
            .await
            .expect("the open waited for an answer for good");
        assert!(
            matches!(r, Err(TransferError::ConnectionLost(_))),
            "{:?}",
            r.err()
        );
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());

        let remote = peer.open("kv", kv.token()).await.unwrap();
        stall_next_qp_accepts(1);
        let (r, l) = timeout(wait, remote.write(0, region.lease(0..4096).unwrap(), 1))
            .await
            .expect("the write waited for its link for good");
        assert!(r.is_err(), "{r:?}");
        let remote = peer.open("kv", kv.token()).await.unwrap();
        let (r, _l) = remote.write(0, l, 2).await;
        assert_eq!(r.unwrap(), 4096);
    });
}
