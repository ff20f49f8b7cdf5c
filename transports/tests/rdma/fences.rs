//! Fences, resets and peer loss: what a queue pair in the error state
//! means for the transfers on it, and for the target's confirmation.

use quiesce_transports::rdma::{after_next_qp_accept, AfterAccept};

use super::*;

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn the_nic_enforces_rights_then_the_queue_pair_is_rebuilt() {
    Runtime::new().unwrap().block_on(async {
        // (Bound whole: a pattern with `..` would drop the target and the
        // local registration at once.)
        let p = ro_and_kv().await;
        let (ro, init, region, ro_r, kv_r) = (&p.ro, &p.init, &p.region, &p.ro_r, &p.kv_r);
        let mut l = region.lease(0..4096).unwrap();
        fill(&mut l, 9);
        let (r, l) = ro_r.write(0, l, 1).await;
        assert!(matches!(r, Err(TransferError::RemoteAccess(_))), "{r:?}");
        let mut snap = vec![1u8; 4096];
        assert!(ro.read_at(0, &mut snap));
        assert!(snap.iter().all(|&b| b == 0), "a refused write landed");
        // Reads are allowed, and the next transfer gets a new queue pair.
        let (r, l) = ro_r.read(0, 4096, l, 2).await;
        assert_eq!(r.unwrap(), 4096);
        let (r, _l) = kv_r.write(0, l, 3).await;
        assert_eq!(r.unwrap(), 4096);
        let s = init.stats();
        assert_eq!((s.in_flight, s.posted), (0, s.completed));
    });
}

/// Each fence retires the queue pair; the next transfer builds one on the
/// same control connection. What resets a link when that connection ends
/// is registered once per peer and connection, not once per queue pair: a
/// peer that fences often on a long-lived connection does not pile hooks
/// up.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn queue_pairs_rebuilt_on_one_connection_register_one_close_hook() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        for round in 0..20u64 {
            let mut l = p.region.lease(0..4096).unwrap();
            fill(&mut l, round as u8);
            let (r, _l) = p.remote.write(0, l, 100 + round).await;
            assert_eq!(r.unwrap(), 4096, "round {round}");
            p.remote.peer().fence(100 + round).await.unwrap();
        }
        let hooks = p.remote.peer().control_close_hooks();
        assert!(hooks <= 1, "{hooks} close hooks after 20 queue pairs");
    });
}

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn fence_stops_a_write_mid_flight() {
    Runtime::new().unwrap().block_on(async {
        let size = 32 << 20;
        let p = pair(size, size).await;
        let mut src = p.region.lease(0..size).unwrap();
        fill(&mut src, 3);
        let remote = p.remote.clone();
        let t = spawn_local(async move { remote.write(0, src, 7).await });
        sleep(Duration::from_millis(30)).await;
        let t0 = Instant::now();
        p.remote.peer().fence(7).await.unwrap();
        let (r, src) = t.await.unwrap();
        drop(src);
        eprintln!(
            "fence after 30 ms: {r:?}, transfer resolved {:?} after the fence",
            t0.elapsed()
        );
        // Posted and flushed by the local reset (the fence above confirmed
        // the target's side), or done before it.
        assert!(matches!(r, Err(TransferError::Flushed) | Ok(_)), "{r:?}");
        assert!(
            quiet(&p.kv, size, Duration::from_millis(300)).await,
            "bytes landed after the fence"
        );
        // The batch stays fenced; another batch gets a new queue pair.
        let l = p.region.lease(0..4096).unwrap();
        let (r, l) = p.remote.write(0, l, 7).await;
        assert_eq!(r, Err(TransferError::Fenced));
        let (r, _l) = p.remote.write(0, l, 8).await;
        assert_eq!(r.unwrap(), 4096);
    });
}

/// A fence resets every queue pair the target serves the session, not only
/// the one on the connection it arrived on. A control connection the
/// initiator gave up on (its reset lost in a partition, so the target
/// still holds it open) keeps its queue pair ready to accept the requests
/// still in the network; a fence confirmed over the new connection must
/// have reset it too, or writes of the fenced batch may land after it.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_fence_resets_the_queue_pairs_of_every_connection_of_its_session() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, l) = p.remote.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        assert_eq!(p.target.stats().served_queue_pairs, 1);

        p.remote.peer().strand_control();
        let (r, _l) = p.remote.write(4096, l, 2).await;
        assert_eq!(r.unwrap(), 4096, "the write on a new control connection");
        assert_eq!(p.target.stats().served_queue_pairs, 2);

        p.remote.peer().fence(2).await.unwrap();
        assert_eq!(
            p.target.stats().served_queue_pairs,
            0,
            "a queue pair of the fenced session still accepts requests"
        );
    });
}

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn memory_is_deregistered_only_after_quiescence() {
    Runtime::new().unwrap().block_on(async {
        let size = 32 << 20;
        let target = RdmaEngine::bind(RdmaConfig::default()).unwrap();
        let kv = target
            .register("kv", AlignedBuf::new(size), Rights::READ | Rights::WRITE)
            .unwrap();
        let init = RdmaEngine::bind(RdmaConfig::default()).unwrap();
        let region = Region::new(size);
        let local = init.register_region(&region).unwrap();
        let peer = init.connect(target.local_addr()).await.unwrap();
        let remote = peer.open("kv", kv.token()).await.unwrap();
        assert_eq!(init.stats().memory_regions, 1);
        // Set the queue pair up, so that the write below posts at once.
        let (r, l) = remote.write(0, region.lease(0..64).unwrap(), 1).await;
        assert_eq!(r.unwrap(), 64);
        drop(l);
        let mut src = region.lease(0..size).unwrap();
        fill(&mut src, 4);
        // Start the write, then drop its future and the registration.
        let mut fut = Box::pin(remote.write(0, src, 1));
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        // The first poll queues the requests; they are posted at the next
        // reactor tick, after the drop, however fast the device is.
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        drop(fut);
        drop(local);
        let s = init.stats();
        assert_eq!(s.in_flight, 1, "the dropped transfer is parked: {s:?}");
        assert_eq!(
            s.memory_regions, 1,
            "deregistered while the NIC may still read it"
        );
        let t0 = Instant::now();
        while init.stats().in_flight > 0 {
            assert!(t0.elapsed() < Duration::from_secs(60), "never drained");
            sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(
            init.stats().memory_regions,
            0,
            "not deregistered after quiescence"
        );
        let mut landed = vec![0u8; size];
        kv.read_at(0, &mut landed);
        assert!(
            landed == pattern(size, 4),
            "the parked write did not complete"
        );
        // A lease of the region is now refused as unregistered.
        let l = region.lease(0..64).unwrap();
        let (r, _) = remote.write(0, l, 2).await;
        assert!(
            matches!(r, Err(TransferError::Unregistered { .. })),
            "{r:?}"
        );
        // Target-side: deregistering the segment makes the NIC refuse its key.
        let local = init.register_region(&region).unwrap();
        assert!(target.deregister(kv.id()));
        let l = region.lease(0..64).unwrap();
        let (r, _) = remote.write(0, l, 3).await;
        assert!(matches!(r, Err(TransferError::RemoteAccess(_))), "{r:?}");
        drop(local);
        assert!(init.shutdown(Duration::from_secs(5)));
        assert_eq!(init.stats().memory_regions, 0);
    });
}

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_killed_peer_fails_the_transfer_after_its_requests_are_reaped() {
    let target = TargetProcess::spawn(&["--rdma", "--segment", "kv:67108864:rw"]);
    Runtime::new().unwrap().block_on(async {
        let size = 64 << 20;
        let init = RdmaEngine::bind(RdmaConfig::default()).unwrap();
        let region = Region::new(size);
        let _local = init.register_region(&region).unwrap();
        let peer = init.connect(target.addr).await.unwrap();
        let remote = peer.open("kv", target.seg("kv").token).await.unwrap();
        let mut src = region.lease(0..size).unwrap();
        fill(&mut src, 6);
        let t = spawn_local(async move { remote.write(0, src, 1).await });
        sleep(Duration::from_millis(50)).await;
        target.signal(libc::SIGKILL);
        let t0 = Instant::now();

        let (r, src) = t.await.unwrap();
        eprintln!("after kill: {r:?} in {:?}", t0.elapsed());
        match r {
            Err(e) => assert!(e.is_retryable(), "{e:?}"),
            Ok(n) => assert_eq!(n, size as u64), // finished before the kill
        }
        assert_eq!(init.stats().in_flight, 0);
        assert!(src[..] == pattern(size, 6)[..], "the source changed");
    });
}

/// Requests an abort fails before they were posted sent nothing: their
/// error settles the remote side (nothing of them can land), so the batch
/// reports the target answered and may retry. They were `ConnectionLost`,
/// which says bytes may still land, for a transfer that never reached the
/// NIC.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn requests_failed_before_they_were_posted_settle_the_remote() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let (r, l) = p.remote.write(0, p.region.lease(0..4096).unwrap(), 1).await;
        assert_eq!(r.unwrap(), 4096);
        drop(l);
        let posted = p.initiator.stats().posted;
        // Not small: queued for the next doorbell, which comes after the
        // abort.
        let write = p.remote.write(0, p.region.lease(0..256 << 10).unwrap(), 2);
        let mut write = std::pin::pin!(write);
        std::future::poll_fn(|cx| {
            assert!(write.as_mut().poll(cx).is_pending());
            std::task::Poll::Ready(())
        })
        .await;
        p.remote.peer().abort();
        let (r, _l) = write.await;
        let e = r.expect_err("the write was cut by the abort");
        assert_eq!(p.initiator.stats().posted, posted, "it was never posted");
        assert!(e.settles_remote(), "nothing was sent, yet: {e:?}");
        let mut snap = vec![0u8; 256 << 10];
        assert!(p.kv.read_at(0, &mut snap));
        assert!(snap[4096..].iter().all(|&b| b == 0), "it landed");
    });
}

/// A fence whose queue pair at the target the device will neither reset nor
/// destroy is not confirmed: that queue pair may still accept the batch's
/// requests, so the target closes the connection instead of acking (which
/// deregisters the connection's regions: the keys die), and the initiator
/// learns nothing landed-or-not from it. The fence was acked as if the queue
/// pair were gone. The peer gets through again on a new connection.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_fence_whose_queue_pair_cannot_be_stopped_is_not_confirmed() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, l) = p.remote.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        assert_eq!(p.target.stats().served_queue_pairs, 1);
        quiesce_transports::rdma::fail_next_served_resets(1);
        let t = Instant::now();
        let r = p.remote.peer().fence(1).await;
        assert!(
            r.is_err(),
            "the fence was confirmed while the target's queue pair stayed connected"
        );
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
        assert_eq!(
            p.target.stats().served_queue_pairs,
            1,
            "the queue pair that would not go is still served"
        );
        served_again(&p, l, 2).await;
        let mut snap = vec![0u8; 4096];
        assert!(p.kv.read_at(0, &mut snap));
        assert_eq!(snap, pattern(4096, 2));
    });
}

/// A queue pair the device would neither reset nor destroy when a
/// `QpConnect` came to replace it leaves every later fence of its session
/// unconfirmed. The refused `QpConnect` left the connection open with that
/// queue pair connected, and the next fence, finding no queue pair to
/// reset, was acked.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_queue_pair_stuck_when_replaced_leaves_later_fences_unconfirmed() {
    Runtime::new().unwrap().block_on(async {
        let p = ro_and_kv().await;
        let (region, peer, ro_r, kv_r) = (&p.region, &p.peer, &p.ro_r, &p.kv_r);
        let (r, l) = kv_r.write(0, region.lease(0..4096).unwrap(), 1).await;
        assert_eq!(r.unwrap(), 4096);
        // The NIC refuses it: this side's queue pair fails, and the next
        // transfer asks for a new one, which replaces the target's.
        let (r, l) = ro_r.write(0, l, 2).await;
        assert!(matches!(r, Err(TransferError::RemoteAccess(_))), "{r:?}");
        quiesce_transports::rdma::fail_next_served_resets(1);
        let (r, _l) = kv_r.write(0, l, 3).await;
        assert!(r.is_err(), "a new queue pair beside a stuck one: {r:?}");
        let t = Instant::now();
        let f = peer.fence(3).await;
        assert!(
            f.is_err(),
            "a fence was confirmed while a stuck queue pair stayed connected"
        );
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    });
}

/// The link a write builds after the one before failed (a refused write),
/// when the network delivers the target's `QpAccept` and then something
/// that resets the target's queue pair before the link is installed: the
/// link must come up retired, and the write end (here `ConnectionLost`),
/// not wait for a responder that is gone — on Soft-RoCE for ever, with no
/// deadline. `what` is that something (a test fault injects the order).
async fn a_link_reset_before_it_was_installed(what: AfterAccept) {
    let p = ro_and_kv().await;
    let mut l = p.region.lease(0..4096).unwrap();
    fill(&mut l, 1);
    let (r, l) = p.kv_r.write(0, l, 1).await;
    assert_eq!(r.unwrap(), 4096, "{what:?}");
    // The link fails; its control connection stays.
    let (r, l) = p.ro_r.write(0, l, 2).await;
    assert!(matches!(r, Err(TransferError::RemoteAccess(_))), "{r:?}");
    after_next_qp_accept(what);
    let t0 = Instant::now();
    let (r, l) = quiesce_runtime::time::timeout(Duration::from_secs(5), p.kv_r.write(0, l, 3))
        .await
        .unwrap_or_else(|_| panic!("{what:?}: the write waited on a reset queue pair"));
    assert!(r.is_err(), "{what:?}: {r:?}");
    eprintln!("{what:?}: {r:?} after {:?}", t0.elapsed());
    // And the next write builds a link that works.
    let (r, _l) = p.kv_r.write(0, l, 4).await;
    assert_eq!(r.unwrap(), 4096, "{what:?}");
    let s = p.init.stats();
    assert_eq!((s.in_flight, s.posted), (0, s.completed), "{what:?}");
}

/// The control connection closed with its `QpAccept` (read in one piece,
/// its close hooks run first): the hook, registered once per connection,
/// had reset the link before, and the new one came up `Ready` with no hook.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_link_whose_control_connection_closed_with_its_accept_is_retired() {
    Runtime::new()
        .unwrap()
        .block_on(a_link_reset_before_it_was_installed(
            AfterAccept::CloseControl,
        ));
}

/// A fence's ack handled before the `QpAccept` it followed: the target
/// reset the new queue pair, and the ack named it while the link before was
/// still current.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_link_whose_queue_pair_a_fence_reset_first_is_retired() {
    Runtime::new()
        .unwrap()
        .block_on(a_link_reset_before_it_was_installed(AfterAccept::Fence(99)));
}

/// A transfer cut across doorbells: its first requests were posted and
/// finished on the NIC, the rest were still queued when the batch was
/// fenced (or the peer aborted) and are failed unposted. It says what
/// landed: never `Fenced` or `NotSent` — nothing of it landed — while its
/// posted part did (it reported so: the success of the posted group did not
/// count against the error of the unposted rest).
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_transfer_cut_between_doorbells_reports_what_landed() {
    for abort in [false, true] {
        Runtime::new().unwrap().block_on(async {
            let (target, kv) = kv_target(1 << 20);
            let cfg = RdmaConfig {
                queue_depth: 2,
                slice_size: 4096,
                ..Default::default()
            };
            let Sliced {
                init,
                region,
                _reg,
                peer,
                remote,
            } = Sliced::connect_with(&target, &kv, cfg).await;
            let mut src = region.lease(0..16 << 10).unwrap();
            fill(&mut src, 31);
            let w = spawn_local(async move { remote.write(0, src, 7).await });
            let t0 = Instant::now();
            while init.stats().posted < 2 {
                assert!(t0.elapsed() < Duration::from_secs(10), "nothing was posted");
                quiesce_runtime::yield_now().await;
            }
            // The reactor held: the NIC finishes the two posted requests,
            // nothing is reaped, the other two stay queued.
            std::thread::sleep(Duration::from_millis(200));
            if abort {
                peer.abort();
            } else {
                peer.fence(7).await.unwrap();
            }
            let (r, src) = w.await.unwrap();
            let mut landed = vec![0u8; 16 << 10];
            assert!(kv.read_at(0, &mut landed));
            let same = landed.iter().zip(&src[..]).filter(|(a, b)| a == b).count();
            match &r {
                Err(TransferError::Fenced | TransferError::NotSent(_)) => assert!(
                    same < 4096,
                    "abort {abort}: {r:?}, nothing landed — yet {same} bytes had"
                ),
                Err(TransferError::FencedPartial { landed }) => {
                    assert!(*landed as usize <= same, "abort {abort}: {landed} > {same}")
                }
                // An abort confirms nothing: no count is claimed.
                Err(TransferError::ConnectionLost(_)) if abort => {}
                // Two requests stayed queued behind the held reactor: the
                // write cannot have completed, nor failed another way.
                other => panic!("abort {abort}: {other:?}"),
            }
            let s = init.stats();
            assert_eq!((s.in_flight, s.posted), (0, s.completed), "{s:?}");
        });
    }
}

/// A queue pair moved to the error state by something other than this
/// side's fence or a failed completion (the device's asynchronous fatal
/// error, say) returns every request posted on it flushed, none with an
/// error of its own. Each transfer on it must fail, and the next one build
/// a new queue pair: the link stayed `Ready` on flushes alone, and every
/// later transfer to the peer was posted on the dead queue pair and failed.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_queue_pair_that_only_flushes_is_rebuilt() {
    Runtime::new().unwrap().block_on(async {
        let p = ro_and_kv().await;
        let mut l = p.region.lease(0..4096).unwrap();
        fill(&mut l, 1);
        let (r, l) = p.kv_r.write(0, l, 1).await;
        assert_eq!(r.unwrap(), 4096);
        p.peer.break_queue_pair();
        let (r, l) = p.kv_r.write(0, l, 2).await;
        assert!(
            r.is_err(),
            "a write on a queue pair in the error state: {r:?}"
        );
        let (r, l) = p.kv_r.write(0, l, 3).await;
        assert_eq!(r.unwrap(), 4096, "the next write builds a new queue pair");
        let (r, _l) = p.kv_r.read(0, 4096, l, 4).await;
        assert_eq!(r.unwrap(), 4096);
        let s = p.init.stats();
        assert_eq!((s.in_flight, s.posted), (0, s.completed));
    });
}

/// A control connection whose initiator's traffic is all on its queue pair
/// sends the target no frame: that is no idleness. The target closed it at
/// its idle limit (600 s by default), took the queue pair down with it, and
/// the writes in flight failed `ConnectionLost` on a healthy link. Writes
/// that run past several idle limits now all succeed on one queue pair.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_connection_whose_traffic_is_on_its_queue_pair_is_not_idle() {
    use quiesce_transports::EngineConfig;

    Runtime::new().unwrap().block_on(async {
        let limit = Duration::from_millis(300);
        let p = ro_and_kv_with(RdmaConfig {
            control: EngineConfig {
                idle_timeout: Some(limit),
                ..EngineConfig::default()
            },
            ..RdmaConfig::default()
        })
        .await;
        let mut l = p.region.lease(0..4096).unwrap();
        let t0 = Instant::now();
        let mut writes = 0u64;
        while t0.elapsed() < 5 * limit {
            fill(&mut l, writes as u8);
            let (r, back) = p.kv_r.write(0, l, writes).await;
            l = back;
            assert_eq!(r.unwrap(), 4096, "write {writes} after {:?}", t0.elapsed());
            writes += 1;
            sleep(Duration::from_millis(5)).await;
        }
        let accepted = p.target.control().stats().accepted;
        assert_eq!(accepted, 1, "{writes} writes needed {accepted} connections");
    });
}
