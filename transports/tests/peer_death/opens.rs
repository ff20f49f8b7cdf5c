//! What bounds an open's `Auth` on a peer that stops answering: the
//! control connection's deadline, and a data connection's silence (no
//! answer to any of its requests), which slow bulk does not break.

use super::*;

/// An open whose control connection is answered but whose data
/// connection's `Auth` never is (a target frozen between the two, or a
/// hostile one) fails within the connect timeout once that connection
/// shows no progress. It waited for good: a data connection's auth had no
/// deadline at all, so the open — and a Python call's first touch of the
/// segment — never returned.
#[test]
fn an_open_whose_data_connection_never_answers_fails_within_the_connect_timeout() {
    Runtime::new().unwrap().block_on(async {
        let (e, peer, _kv) = opened_then_data_muted(false).await;
        open_fails_within_a_second(&peer, "a data connection's silence").await;
        e.shutdown();
    });
}

/// A fake target whose control connection (the peer's first) answers every
/// `Auth`, and whose data connections answer them until `mute` is set and
/// then nothing. With `stray`, a muted data connection also gets a
/// `Status` for a request never sent every 100 ms.
fn muting_data_target(mute: Arc<AtomicBool>, stray: bool) -> SocketAddr {
    let seen = Arc::new(AtomicUsize::new(0));
    fake_target("muting-data", move |mut s, addr| {
        let control = seen.fetch_add(1, Ordering::SeqCst) == 0;
        if stray && !control {
            let (mut w, mute) = (s.try_clone().unwrap(), mute.clone());
            std::thread::spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100));
                if mute.load(Ordering::SeqCst) {
                    let h = Header {
                        task: 999_999,
                        ..Header::new(Opcode::Status)
                    };
                    if w.write_all(&h.encode()).is_err() {
                        return;
                    }
                }
            });
        }
        while let Some(h) = recv_header(&mut s) {
            let Some(p) = payload(&mut s, &h) else { return };
            if h.op == Opcode::Auth && (control || !mute.load(Ordering::SeqCst)) {
                accept_auth(&mut s, &p, addr, |_| {});
            }
        }
    })
}

/// An engine (connect timeout 300 ms, one data connection) with segment
/// "kv" of a [`muting_data_target`] opened, and its data connections muted
/// since.
async fn opened_then_data_muted(stray: bool) -> (Engine, quiesce_transports::Peer, RemoteSegment) {
    let mute = Arc::new(AtomicBool::new(false));
    let addr = muting_data_target(mute.clone(), stray);
    let cfg = EngineConfig {
        connect_timeout: Duration::from_millis(300),
        connections_per_peer: 2,
        ..tcp()
    };
    let e = Engine::bind(cfg).unwrap();
    let peer = e.connect(addr).await.unwrap();
    let kv = peer.open("kv", Token::random()).await.unwrap();
    mute.store(true, Ordering::SeqCst);
    (e, peer, kv)
}

/// What bounds an open's `Auth` is the target's answers, not the
/// connection's other traffic: requests this initiator sends meanwhile
/// (fences on the control connection, writes on a data connection) and
/// frames for requests never sent (a hostile target's) kept it waiting
/// for as long as they came, once at least every connect timeout.
#[test]
fn an_open_is_not_kept_waiting_by_its_own_sends_or_stray_frames() {
    // The control connection: fences sent (never answered) every 100 ms.
    Runtime::new().unwrap().block_on(async {
        let (_e, peer, _kv) = opened_then_muted().await;
        let fencing = peer.clone();
        let fences = spawn_local(async move {
            for b in 1..40 {
                let f = fencing.clone();
                spawn_local(async move {
                    let _ = f.fence(b).await;
                });
                time::sleep(Duration::from_millis(100)).await;
            }
        });
        open_fails_within_a_second(&peer, "its own fences").await;
        peer.abort();
        let _ = fences.await;
    });
    // A data connection: writes sent (never answered) and stray statuses
    // heard every 100 ms.
    Runtime::new().unwrap().block_on(async {
        let (e, peer, kv) = opened_then_data_muted(true).await;
        let writes = spawn_local(async move {
            for b in 1..40u64 {
                let kv = kv.clone();
                spawn_local(async move {
                    let _ = kv.write(0, vec![0u8; 4096], b).await;
                });
                time::sleep(Duration::from_millis(100)).await;
            }
        });
        open_fails_within_a_second(&peer, "its own writes and stray statuses").await;
        peer.abort();
        let _ = writes.await;
        e.shutdown();
    });
}

/// The other side of that bound: a data connection's `Auth` queued behind
/// writes that the target answers slowly (100 ms each: eight slices
/// striped over two connections put about 400 ms ahead of it, against a
/// 300 ms connect timeout) is waited for, since the connection keeps
/// moving: the open succeeds and so does every write.
#[test]
fn an_open_behind_slow_but_moving_writes_is_waited_for() {
    let addr = fake_target("slow", move |mut s, addr| {
        while let Some(h) = recv_header(&mut s) {
            let Some(p) = payload(&mut s, &h) else { return };
            match h.op {
                Opcode::Auth => accept_auth(&mut s, &p, addr, |_| {}),
                Opcode::Write => {
                    std::thread::sleep(Duration::from_millis(100));
                    answer(&mut s, &h, Status::Ok);
                }
                _ => {}
            }
        }
    });
    Runtime::new().unwrap().block_on(async {
        let cfg = EngineConfig {
            connect_timeout: Duration::from_millis(300),
            connections_per_peer: 2,
            slice_size: 4096,
            ..tcp()
        };
        let e = Engine::bind(cfg).unwrap();
        let peer = e.connect(addr).await.unwrap();
        let kv = peer.open("kv", Token::random()).await.unwrap();
        let write = spawn_local(async move { kv.write(0, vec![1u8; 8 * 4096], 1).await.0 });
        time::sleep(Duration::from_millis(20)).await;
        let opened = peer.open("lv", Token::random()).await;
        assert!(opened.is_ok(), "{:?}", opened.err());
        assert_eq!(write.await.unwrap().unwrap(), 8 * 4096);
        e.shutdown();
    });
}
