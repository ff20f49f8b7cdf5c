//! The target against hostile or broken peers: it keeps serving honest
//! clients whatever the others do.

#[path = "../common/mod.rs"]
mod common;
mod proofs;

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

/// A peer that asks for reads and then stops reading the answers (or
/// reads them too slowly to take one frame within the idle limit) is
/// closed like a silent one. The target's sends had no bound: the answer
/// to a read waited for the peer's window for good, holding the
/// connection — and the segment's memory, which a deregister waits for —
/// as long as the peer's kernel kept acking.
#[test]
fn a_peer_that_stops_reading_its_answers_is_closed_after_the_idle_limit() {
    use quiesce_transports::wire::{Header, Opcode};
    let (t, mut c) = idle_target();
    // 400 reads of 64 KiB: far more than the two sockets' buffers hold.
    for i in 0..400u64 {
        let h = Header {
            batch: 1,
            task: i,
            segment: t.seg("kv").id,
            offset: 0,
            length: 65536,
            ..Header::new(Opcode::Read)
        };
        c.send(&h, &[]);
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        t.stats().connections,
        0,
        "a connection whose peer stopped reading was still served 2 s later (idle limit 300 ms)"
    );
}
