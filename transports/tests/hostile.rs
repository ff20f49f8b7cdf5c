//! The target against hostile or broken peers: it keeps serving honest
//! clients whatever the others do.

mod common;

use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::{time, Runtime};
use quiesce_transports::{Engine, EngineConfig, Token};

/// An honest client: connects, proves the token, writes 4 KiB and reads it
/// back, within `limit`.
fn honest_round_trip(addr: std::net::SocketAddr, token: Token, limit: Duration) {
    Runtime::new().unwrap().block_on(async move {
        let work = async {
            let e = Engine::bind(EngineConfig {
                connect_timeout: limit,
                ..tcp()
            })
            .unwrap();
            let kv = e.connect(addr).await?.open("kv", token).await?;
            let (r, _) = kv.write(0, pattern(4096, 3), 1).await;
            r?;
            let (r, back) = kv.read(0, 4096, vec![0u8; 4096], 2).await;
            r?;
            assert_eq!(back, pattern(4096, 3));
            e.shutdown();
            Ok::<(), quiesce_transports::TransferError>(())
        };
        match time::timeout(limit, work).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("the honest client failed: {e}"),
            Err(_) => panic!("the honest client got no service in {limit:?}"),
        }
    });
}

/// After the target ran out of file descriptors once (more connections than
/// RLIMIT_NOFILE allows, all closed again) it accepts and serves again.
#[test]
fn after_fd_exhaustion_the_target_serves_again() {
    let t = TargetProcess::spawn_with(&["--segment", "kv:65536:rw"], Some(64));
    let flood: Vec<std::net::TcpStream> = (0..100)
        .map(|_| std::net::TcpStream::connect(t.addr).unwrap())
        .collect();
    // Let the target accept up to its limit and hit EMFILE.
    std::thread::sleep(Duration::from_millis(300));
    drop(flood);
    let t0 = Instant::now();
    honest_round_trip(t.addr, t.seg("kv").token, Duration::from_secs(5));
    eprintln!("served again {:?} after the flood closed", t0.elapsed());
}

/// Before it proved a token a peer can do nothing but the handshake: a
/// Fence or a QpConnect is refused, the connection closed, nothing stored.
#[test]
fn an_unauthenticated_fence_or_qp_connect_is_refused_and_stores_nothing() {
    use quiesce_transports::wire::{Header, Opcode, QpConnect, QpWire, Status};
    use quiesce_transports::Rights;
    let t = ShardTarget::start(tcp(), &[("kv", 4096, Rights::READ | Rights::WRITE)]);
    let before = t.stats();
    let mut c = RawClient::connect(t.addr);
    c.send(
        &Header {
            batch: 77,
            ..Header::new(Opcode::Fence)
        },
        &[],
    );
    let h = c.recv().expect("an answer before the close");
    assert_eq!(
        h.op,
        Opcode::Status,
        "an unauthenticated fence was served: {h:?}"
    );
    assert_eq!(h.status(), Ok(Status::Forbidden));
    assert!(c.recv().is_none(), "the connection is closed");
    let st = t.stats();
    assert_eq!(
        st.fence_entries, before.fence_entries,
        "nothing stored: {st:?}"
    );

    let mut c = RawClient::connect(t.addr);
    let p = QpConnect {
        qp: QpWire::default(),
    }
    .encode();
    c.send(
        &Header {
            length: p.len() as u64,
            ..Header::new(Opcode::QpConnect)
        },
        &p,
    );
    let h = c.recv().expect("an answer before the close");
    assert_eq!(
        h.op,
        Opcode::Status,
        "an unauthenticated QpConnect was served: {h:?}"
    );
    assert_eq!(h.status(), Ok(Status::Forbidden));
    assert!(c.recv().is_none(), "the connection is closed");
    // Both connections are gone, none of them counted as authenticated.
    std::thread::sleep(Duration::from_millis(50));
    let st = t.stats();
    assert_eq!((st.connections, st.unauthenticated), (0, 0), "{st:?}");
}

/// A flood of peers that never finish their handshake — a hello header
/// claiming a 256 KiB payload and nothing more, a bare TCP connection, a
/// hello and no auth — is closed by the handshake deadline, never holds more
/// than the cap of unauthenticated connections, and an honest client is
/// served meanwhile.
#[test]
fn a_thousand_stalled_handshakes_are_closed_and_an_honest_client_is_served() {
    use quiesce_transports::wire::{Header, Opcode};
    use quiesce_transports::Rights;
    use std::io::Write;
    let cfg = EngineConfig {
        handshake_timeout: Duration::from_millis(1500),
        max_unauthenticated: 128,
        ..tcp()
    };
    let t = ShardTarget::start(cfg, &[("kv", 65536, Rights::READ | Rights::WRITE)]);
    let mut flood = Vec::new();
    for i in 0..1000 {
        let mut s = std::net::TcpStream::connect(t.addr).unwrap();
        match i % 3 {
            0 => {
                let h = Header {
                    length: 256 << 10,
                    ..Header::new(Opcode::Hello)
                };
                s.write_all(&h.encode()).unwrap();
            }
            1 => {}
            _ => flood.push(RawClient::connect(t.addr).s),
        }
        flood.push(s);
    }
    let st = t.stats();
    assert!(
        st.unauthenticated <= 128,
        "the cap of unauthenticated connections does not hold: {st:?}"
    );
    let t0 = Instant::now();
    honest_round_trip(t.addr, t.seg("kv").token, Duration::from_secs(2));
    eprintln!("honest client served in {:?} under the flood", t0.elapsed());
    // By the deadline (plus slack) every stalled handshake is closed.
    std::thread::sleep(Duration::from_millis(2000));
    let st = t.stats();
    assert_eq!(
        st.unauthenticated, 0,
        "stalled handshakes still open: {st:?}"
    );
    drop(flood);
}

/// A target with a 300 ms idle timeout and a 64 KiB segment `kv`, and a
/// raw connection that proved its token.
fn idle_target() -> (ShardTarget, RawClient) {
    use quiesce_transports::Rights;
    let cfg = EngineConfig {
        idle_timeout: Some(Duration::from_millis(300)),
        ..tcp()
    };
    let t = ShardTarget::start(cfg, &[("kv", 65536, Rights::READ | Rights::WRITE)]);
    let mut c = RawClient::connect(t.addr);
    c.auth(t.seg("kv").id, t.seg("kv").token);
    (t, c)
}

/// An authenticated connection that stays silent past the idle timeout is
/// closed by the target; an initiator whose connections were closed that
/// way reconnects on its next transfer.
#[test]
fn idle_connections_are_closed_and_the_initiator_reconnects() {
    let (t, mut c) = idle_target();
    let t0 = Instant::now();
    assert!(c.recv().is_none(), "an idle connection is closed");
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
    let token = t.seg("kv").token;
    Runtime::new().unwrap().block_on(async {
        let (e, kv) = open_segment(t.addr, "kv", token).await;
        let (r, _) = kv.write(0, vec![5u8; 4096], 1).await;
        r.unwrap();
        time::sleep(Duration::from_millis(600)).await;
        assert_eq!(t.stats().connections, 0, "idle connections closed");
        let (r, _) = kv.write(0, vec![6u8; 4096], 2).await;
        r.expect("the initiator reconnects after an idle close");
        e.shutdown();
    });
    assert_eq!(t.snapshot("kv", 0, 4), vec![6u8; 4]);
}

/// A target serving segments "a" and "b" that closes connections idle for
/// 300 ms.
fn two_segments_idle_300ms() -> ShardTarget {
    use quiesce_transports::Rights;
    let cfg = EngineConfig {
        idle_timeout: Some(Duration::from_millis(300)),
        ..tcp()
    };
    let rw = Rights::READ | Rights::WRITE;
    ShardTarget::start(cfg, &[("a", 65536, rw), ("b", 65536, rw)])
}

/// Writes to `a`, has the target deregister it, and waits until the target
/// closed the idle connections (the next transfer reconnects).
async fn drop_and_go_idle(t: &ShardTarget, a: &quiesce_transports::RemoteSegment) {
    let (r, _) = a.write(0, vec![1u8; 4096], 1).await;
    r.unwrap();
    assert!(t.deregister("a"));
    time::sleep(Duration::from_millis(600)).await;
    assert_eq!(t.stats().connections, 0, "idle connections closed");
}

/// A connection that reopens proves every segment the peer opened; one the
/// target has since deregistered is refused. That refusal must not fail the
/// reconnect: the other segments are still served, and transfers to them
/// go on (before, every transfer to the target failed from then on).
#[test]
fn a_reconnect_survives_a_segment_the_target_dropped() {
    let t = two_segments_idle_300ms();
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(EngineConfig::default()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let a = peer.open("a", t.seg("a").token).await.unwrap();
        let b = peer.open("b", t.seg("b").token).await.unwrap();
        drop_and_go_idle(&t, &a).await;
        let (r, _) = b.write(0, vec![2u8; 4096], 2).await;
        r.expect("a write to a live segment after the reconnect");
        let (r, _) = a.write(0, vec![3u8; 4096], 3).await;
        assert!(r.is_err(), "a write to the dropped segment");
        let (r, _) = b.write(4096, vec![4u8; 4096], 4).await;
        r.expect("and the next one");
        e.shutdown();
    });
    assert_eq!(t.snapshot("b", 0, 4), vec![2u8; 4]);
    assert_eq!(t.snapshot("b", 4096, 4), vec![4u8; 4]);
}

/// A reconnect whose every proof is refused (all the peer opened is gone)
/// goes on unproven: the open that follows proves its own token on it. It
/// failed that open once, with an error naming the dropped segment.
#[test]
fn an_open_after_every_opened_segment_went_succeeds() {
    let t = two_segments_idle_300ms();
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(EngineConfig::default()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let a = peer.open("a", t.seg("a").token).await.unwrap();
        drop_and_go_idle(&t, &a).await;
        let b = peer
            .open("b", t.seg("b").token)
            .await
            .expect("an open after the only opened segment went");
        let (r, _) = b.write(0, vec![2u8; 4096], 2).await;
        r.unwrap();
        e.shutdown();
    });
    assert_eq!(t.snapshot("b", 0, 4), vec![2u8; 4]);
}

/// A reconnect proves what the peer opened in requests of a bounded size:
/// 1,000 segments with 250-byte names make an answer past the 256 KiB an
/// `AuthAck` may be, which the target refused to send, closing the
/// connection — so an initiator that had opened that many could never
/// reconnect.
#[test]
fn a_reconnect_proves_a_thousand_long_named_segments() {
    use quiesce_transports::Rights;
    let cfg = EngineConfig {
        idle_timeout: Some(Duration::from_millis(500)),
        ..tcp()
    };
    let names: Vec<String> = (0..1000).map(|i| format!("{i:0>250}")).collect();
    let segs: Vec<(&str, usize, Rights)> = names
        .iter()
        .map(|n| (n.as_str(), 64, Rights::READ | Rights::WRITE))
        .collect();
    let t = ShardTarget::start(cfg, &segs);
    Runtime::new().unwrap().block_on(async {
        let config = EngineConfig {
            connections_per_peer: 1,
            ..EngineConfig::default()
        };
        let e = Engine::bind(config).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let mut opened = Vec::new();
        for n in &names {
            opened.push(peer.open(n, t.seg(n).token).await.unwrap());
        }
        time::sleep(Duration::from_millis(900)).await;
        assert_eq!(t.stats().connections, 0, "idle connections closed");
        let (r, _) = opened[999].write(0, vec![7u8; 64], 1).await;
        r.expect("a write after reconnecting with 1,000 segments to prove");
        e.shutdown();
    });
    assert_eq!(t.snapshot(&names[999], 0, 4), vec![7u8; 4]);
}

/// The idle limit counts from the start of each wait for a frame, not from
/// the connection's first one: a connection that writes every 100 ms keeps
/// its 300 ms limit for 1.2 s (the target's one timer, armed for an earlier
/// wait, is pushed on, never taken for this wait's), and then, silent, is
/// closed after the limit.
#[test]
fn a_connection_that_keeps_sending_is_never_idle() {
    use quiesce_transports::wire::{Header, Opcode, Status};
    let (t, mut c) = idle_target();
    let id = t.seg("kv").id;
    for i in 0..12u64 {
        std::thread::sleep(Duration::from_millis(100));
        let h = Header {
            batch: 1 + i,
            task: i,
            segment: id,
            offset: 0,
            length: 8,
            ..Header::new(Opcode::Write)
        };
        c.send(&h, &[i as u8; 8]);
        let ans = c
            .recv()
            .unwrap_or_else(|| panic!("closed as idle after {} ms of writes", 100 * (i + 1)));
        assert_eq!(ans.op, Opcode::Status, "{ans:?}");
        assert_eq!(ans.status(), Ok(Status::Ok), "{ans:?}");
    }
    let t0 = Instant::now();
    assert!(c.recv().is_none(), "a silent connection is closed");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "closed {waited:?} after the last frame"
    );
}

/// The idle limit covers a frame until it is served, not only the wait for
/// its header: a peer that sends a write's header and part of its payload
/// and then goes silent (stopped, or its host gone without a FIN) is closed
/// after the limit like an idle one, instead of holding the connection (and
/// its landing write's hold on the segment) for good.
#[test]
fn a_connection_silent_mid_frame_is_closed_after_the_idle_limit() {
    use quiesce_transports::wire::{Header, Opcode};
    let (t, mut c) = idle_target();
    let h = Header {
        batch: 1,
        task: 1,
        segment: t.seg("kv").id,
        offset: 0,
        length: 4096,
        ..Header::new(Opcode::Write)
    };
    c.send(&h, &[7u8; 100]);
    let t0 = Instant::now();
    assert!(
        c.recv().is_none(),
        "a connection silent mid-frame is closed"
    );
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "closed after {waited:?}"
    );
    // The same for a proof's payload (up to 256 KiB read before it is
    // checked) on an authenticated connection.
    let mut c = RawClient::connect(t.addr);
    c.auth(t.seg("kv").id, t.seg("kv").token);
    let h = Header {
        length: 1000,
        ..Header::new(Opcode::Auth)
    };
    c.send(&h, &[1u8; 10]);
    let t0 = Instant::now();
    assert!(c.recv().is_none(), "a proof that stops coming is closed");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // And for the address a `WriteLocal` or `ReadLocal` carries (read
    // before the target looks whether the connection is attached).
    for op in [Opcode::WriteLocal, Opcode::ReadLocal] {
        let mut c = RawClient::connect(t.addr);
        c.auth(t.seg("kv").id, t.seg("kv").token);
        let h = Header {
            batch: 1,
            task: 1,
            segment: t.seg("kv").id,
            length: 4096,
            ..Header::new(op)
        };
        c.send(&h, &[1u8; 3]);
        let t0 = Instant::now();
        assert!(
            c.recv().is_none(),
            "{op:?}: an address that stops coming is closed"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "{op:?}: {:?}",
            t0.elapsed()
        );
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(t.stats().connections, 0);
}

/// A `First` proof is checked against every segment the target serves: a
/// request of many (4,096 fit one `Auth`) would make one frame from a peer
/// that proved nothing cost the target's thread thousands of HMACs per
/// segment. One per request is all an initiator sends (`open_first`); more
/// is a bad frame, and the connection is closed.
#[test]
fn an_auth_with_more_than_one_first_proof_is_a_bad_frame() {
    use quiesce_transports::wire::{Opcode, SegmentRef, Status};
    use quiesce_transports::Rights;
    let t = ShardTarget::start(tcp(), &[("kv", 4096, Rights::READ | Rights::WRITE)]);
    let token = t.seg("kv").token;
    let mut c = RawClient::connect(t.addr);
    c.send_auth(&[(SegmentRef::First, token)]);
    let h = c.recv().expect("an answer");
    assert_eq!(h.op, Opcode::AuthAck, "one First proof is served: {h:?}");
    let mut c = RawClient::connect(t.addr);
    c.send_auth(&[(SegmentRef::First, token), (SegmentRef::First, token)]);
    let h = c.recv().expect("an answer before the close");
    assert_eq!(h.op, Opcode::Status, "two First proofs were served: {h:?}");
    assert_eq!(h.status(), Ok(Status::BadFrame));
    assert!(c.recv().is_none(), "the connection is closed");
}

/// A target of 256 segments whose tokens are `token(i)`, on this thread's
/// runtime; `client` runs on a thread of its own against it, and the
/// target's proof checks (HMACs) during it come back with its answer.
fn against_256_segments<R: Send + 'static>(
    token: impl Fn(usize) -> Token,
    client: impl FnOnce(std::net::SocketAddr) -> R + Send + 'static,
) -> (R, u64) {
    use quiesce_transports::Rights;
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let _segs: Vec<_> = (0..256)
            .map(|i| {
                let name = format!("s{i}");
                e.register_with_token(&name, vec![0u8; 64], Rights::READ, token(i))
                    .unwrap()
            })
            .collect();
        let addr = e.local_addr();
        let before = e.stats().proof_checks;
        let c = std::thread::spawn(move || client(addr));
        while !c.is_finished() {
            time::sleep(Duration::from_millis(5)).await;
        }
        let r = c.join().unwrap();
        (r, e.stats().proof_checks - before)
    })
}

/// `First` proofs refused in a row, each answered: how many `AuthAck`s came
/// back for `n` sent back to back on one connection.
fn refused_firsts(addr: std::net::SocketAddr, n: usize) -> usize {
    use quiesce_transports::wire::{Opcode, SegmentRef};
    let mut c = RawClient::connect(addr);
    let frame = c.auth_frame(&[(SegmentRef::First, Token::random())]);
    // All at once, as a peer that never reads; the target may close the
    // connection before it took them all.
    let _ = std::io::Write::write_all(&mut c.s, &frame.repeat(n));
    let mut acks = 0;
    while let Some(h) = c.recv() {
        let mut payload = vec![0u8; h.length as usize];
        if std::io::Read::read_exact(&mut c.s, &mut payload).is_err() {
            break;
        }
        acks += usize::from(h.op == Opcode::AuthAck);
        if acks == n {
            break;
        }
    }
    acks
}

/// A `First` proof is tried against every segment, but a token several
/// segments share is checked once: a Mooncake-style target (one token
/// derived from the cluster's secret for all its segments) pays one HMAC
/// per `First` proof, not one per segment. A peer that proved nothing made
/// 100 frames of 115 bytes cost 25,700 HMACs of a target with 256 segments.
#[test]
fn a_first_proof_checks_a_token_its_segments_share_once() {
    let token = Token::random();
    let (acks, checks) = against_256_segments(move |_| token, |addr| refused_firsts(addr, 20));
    // Cheap refusals keep the connection (a Mooncake caller polling for the
    // target's first registration).
    assert_eq!(acks, 20, "First proofs answered");
    assert!(
        checks <= 40,
        "{checks} proof checks for 20 First proofs against 256 segments sharing one token"
    );
}

/// Against segments whose tokens all differ a `First` proof costs one HMAC
/// per segment, and nothing makes a wrong one cheaper: a connection gets
/// few of them refused (their HMACs are budgeted) before it is closed. It
/// was answered every one, 256 HMACs per 115-byte frame for as long as the
/// peer kept sending.
#[test]
fn a_connection_gets_few_first_proofs_refused_before_it_is_closed() {
    let (acks, checks) =
        against_256_segments(|_| Token::random(), |addr| refused_firsts(addr, 100));
    assert!(
        acks <= 8,
        "{acks} refused First proofs answered on one connection"
    );
    assert!(checks <= 8 * 260, "{checks} proof checks");
}

/// Sends `Fence(batch)` on `c`: whether a `FenceAck` came back.
fn fenced(c: &mut RawClient, batch: u64) -> bool {
    use quiesce_transports::wire::{Header, Opcode};
    c.send(
        &Header {
            batch,
            ..Header::new(Opcode::Fence)
        },
        &[],
    );
    c.recv().map(|h| h.op) == Some(Opcode::FenceAck)
}

/// A fenced batch's entry stays while a connection of its session that
/// could still carry a frame of it is open and has not said `Forget`, and
/// goes once the last one does (or closes); a session that piles up fenced
/// batches past the cap has its connections closed, which frees them all.
#[test]
fn fence_entries_go_when_no_connection_can_carry_the_batch() {
    use quiesce_transports::wire::{Header, Opcode};
    use quiesce_transports::Rights;
    let cfg = EngineConfig {
        max_fenced_per_session: 3,
        ..tcp()
    };
    let t = ShardTarget::start(cfg, &[("kv", 4096, Rights::READ | Rights::WRITE)]);
    let (id, token) = (t.seg("kv").id, t.seg("kv").token);
    // Two connections of one session: b joins the one a created.
    let mut a = RawClient::connect(t.addr);
    a.auth(id, token);
    let mut b = RawClient::connect_in(t.addr, Some(a.session()));
    assert_eq!(b.ack.session, a.ack.session);
    b.auth(id, token);
    assert_eq!(t.stats().sessions, 1);
    let fence = |c: &mut RawClient, batch| assert!(fenced(c, batch), "no FenceAck");
    let forget = |c: &mut RawClient, batch| {
        c.send(
            &Header {
                batch,
                ..Header::new(Opcode::Forget)
            },
            &[],
        )
    };
    let settle = || std::thread::sleep(Duration::from_millis(50));
    fence(&mut a, 5);
    assert_eq!(t.stats().fence_entries, 1);
    forget(&mut a, 5);
    settle();
    assert_eq!(t.stats().fence_entries, 1, "b could still carry batch 5");
    forget(&mut b, 5);
    settle();
    assert_eq!(
        t.stats().fence_entries,
        0,
        "no connection can carry batch 5"
    );
    fence(&mut a, 6);
    drop(b);
    settle();
    assert_eq!(t.stats().fence_entries, 1, "a has not said Forget");
    forget(&mut a, 6);
    settle();
    assert_eq!(t.stats().fence_entries, 0);
    // Past the cap of 3 fenced batches the session's connections close.
    for batch in 10..14 {
        fence(&mut a, batch);
    }
    assert!(a.recv().is_none(), "the session's connection was closed");
    settle();
    let st = t.stats();
    assert_eq!(
        (st.fence_entries, st.sessions, st.connections),
        (0, 0, 0),
        "{st:?}"
    );
}

/// A peer cannot act in another peer's session: asking to join it without
/// its key gets the connection closed at its first Auth, and a fence in the
/// peer's own session leaves the other session's batch alone.
#[test]
fn a_peer_cannot_join_or_fence_another_session() {
    use quiesce_transports::wire::{Header, Opcode, Status};
    use quiesce_transports::Rights;
    let t = ShardTarget::start(tcp(), &[("kv", 4096, Rights::READ | Rights::WRITE)]);
    let (id, token) = (t.seg("kv").id, t.seg("kv").token);
    let mut a = RawClient::connect(t.addr);
    assert_eq!(a.auth_status(id, token), Status::Ok);
    let (session, key) = a.session();
    // Another peer that learned the id (and holds the token) but not the key.
    let mut wrong = key;
    wrong[0] ^= 1;
    let mut m = RawClient::connect_in(t.addr, Some((session, wrong)));
    assert_eq!(
        m.ack.session, session,
        "the target offers to join a live session"
    );
    // Its first Auth carries a join proof made with the wrong key (and no
    // segment proof: the refusal comes before any).
    m.send(
        &Header {
            length: 34,
            ..Header::new(Opcode::Auth)
        },
        &{
            let mut b = vec![0u8; 34];
            b[..32].copy_from_slice(&join_proof(&wrong, &m.ack.nonce, &[9u8; 16], session));
            b
        },
    );
    let h = m.recv().expect("a refusal before the close");
    assert_eq!((h.op, h.status()), (Opcode::Status, Ok(Status::Forbidden)));
    assert!(m.recv().is_none(), "closed");
    // The same peer in its own session fences batch 5: a's batch 5 goes on.
    let mut b = RawClient::connect(t.addr);
    assert_ne!(b.ack.session, session);
    assert_eq!(b.auth_status(id, token), Status::Ok);
    b.send(
        &Header {
            batch: 5,
            ..Header::new(Opcode::Fence)
        },
        &[],
    );
    assert_eq!(b.recv().map(|h| h.op), Some(Opcode::FenceAck));
    a.send(
        &Header {
            batch: 5,
            segment: id,
            length: 4,
            ..Header::new(Opcode::Write)
        },
        &[1, 2, 3, 4],
    );
    assert_eq!(
        a.recv().unwrap().status(),
        Ok(Status::Ok),
        "a's batch was fenced by b"
    );
    assert_eq!(t.snapshot("kv", 0, 4), vec![1, 2, 3, 4]);
}

/// One session may hold at most `max_connections_per_session` connections
/// (each may hold a served queue pair): the next one to join is refused.
#[test]
fn a_session_has_at_most_its_cap_of_connections() {
    use quiesce_transports::wire::{Opcode, Status};
    use quiesce_transports::Rights;
    let cfg = EngineConfig {
        max_connections_per_session: 3,
        ..tcp()
    };
    let t = ShardTarget::start(cfg, &[("kv", 4096, Rights::READ | Rights::WRITE)]);
    let (id, token) = (t.seg("kv").id, t.seg("kv").token);
    let mut first = RawClient::connect(t.addr);
    assert_eq!(first.auth_status(id, token), Status::Ok);
    let session = first.session();
    let mut members = vec![first];
    for _ in 0..2 {
        let mut c = RawClient::connect_in(t.addr, Some(session));
        assert_eq!(c.auth_status(id, token), Status::Ok);
        members.push(c);
    }
    let mut extra = RawClient::connect_in(t.addr, Some(session));
    let ack = extra.auth(id, token);
    assert_eq!(ack.results[0].0, Status::Ok, "the proof itself is good");
    let h = extra.recv().expect("a refusal before the close");
    assert_eq!((h.op, h.status()), (Opcode::Status, Ok(Status::Forbidden)));
    assert!(extra.recv().is_none(), "the fourth connection is closed");
    assert_eq!(t.stats().connections, 3);
}

/// `Fence` and `Forget` carry no payload (PROTOCOL.md §5). One that claims
/// a length is a bad frame: its "payload" must never be read as the next
/// frames (here a `Read` a fence would otherwise smuggle past).
#[test]
fn a_fence_or_forget_with_a_payload_is_a_bad_frame() {
    use quiesce_transports::wire::{Header, Opcode, Status};
    use quiesce_transports::Rights;
    let t = ShardTarget::start(tcp(), &[("kv", 4096, Rights::READ | Rights::WRITE)]);
    let (id, token) = (t.seg("kv").id, t.seg("kv").token);
    for op in [Opcode::Fence, Opcode::Forget] {
        let mut c = RawClient::connect(t.addr);
        c.auth(id, token);
        let read = Header {
            task: 9,
            segment: id,
            length: 16,
            ..Header::new(Opcode::Read)
        }
        .encode();
        c.send(
            &Header {
                batch: 3,
                length: read.len() as u64,
                ..Header::new(op)
            },
            &read,
        );
        let h = c.recv().expect("an answer before the close");
        assert_eq!(
            (h.op, h.status()),
            (Opcode::Status, Ok(Status::BadFrame)),
            "{op:?} with a payload was served: {h:?}"
        );
        assert!(c.recv().is_none(), "the connection is closed");
    }
}

/// Each session may hold `max_fenced_per_session` fenced batches, but a
/// peer can open many sessions: the table as a whole is capped too
/// (`max_fenced_entries`); past it the session holding the most has its
/// connections closed, so the table never holds much more than the cap,
/// and a session with a few fenced batches is not the one closed.
#[test]
fn the_fence_table_is_capped_across_sessions() {
    use quiesce_transports::Rights;
    let cfg = EngineConfig {
        max_fenced_per_session: 16,
        max_fenced_entries: 64,
        ..tcp()
    };
    let t = ShardTarget::start(cfg, &[("kv", 4096, Rights::READ | Rights::WRITE)]);
    let (id, token) = (t.seg("kv").id, t.seg("kv").token);
    // A session with two fenced batches, then many with fifteen each.
    let mut small = RawClient::connect(t.addr);
    small.auth(id, token);
    assert!(fenced(&mut small, 1) && fenced(&mut small, 2));
    let mut many = Vec::new();
    for s in 1..12u64 {
        let mut c = RawClient::connect(t.addr);
        c.auth(id, token);
        for b in 0..15u64 {
            if !fenced(&mut c, s * 100 + b) {
                break;
            }
        }
        many.push(c);
        std::thread::sleep(Duration::from_millis(10));
        let held = t.stats().fence_entries;
        assert!(
            held <= 64 + 15,
            "{held} fence entries after {s} large sessions"
        );
    }
    assert!(t.stats().sessions < 12, "no session was closed");
    assert!(
        fenced(&mut small, 3),
        "the session with few fenced batches was closed"
    );
}
