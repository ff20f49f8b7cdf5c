//! A peer that dies, or a connection this initiator tears down, at any point
//! of a transfer: every request reaches an outcome promptly, the caller's
//! buffer comes back, and the teardown really drops what was queued.

mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fake::{accept_auth, ack_fence, answer, fake_target, open, payload};
use common::*;
use quiesce_runtime::{spawn_local, time, Runtime};
use quiesce_transports::wire::{Header, Opcode, Status};
use quiesce_transports::{Engine, EngineConfig, RemoteSegment, Rights, Token, TransferError};

#[path = "peer_death/opens.rs"]
mod opens;

const BIG: usize = 64 << 20;

/// How long an outcome may take after the fault.
const PROMPT: Duration = Duration::from_secs(1);

fn lost(res: &Result<u64, TransferError>) -> bool {
    matches!(res, Err(TransferError::ConnectionLost(_)))
}

#[test]
fn a_target_killed_mid_read_gives_an_outcome_within_a_second() {
    for round in 0..3 {
        let mut target = TargetProcess::spawn(&["--segment", "kv:67108864:rw"]);
        let token = target.seg("kv").token;
        Runtime::new().unwrap().block_on(async {
            let kv = open(target.addr, token).await;
            let r = spawn_local(async move { kv.read(0, BIG as u64, vec![0u8; BIG], 1).await });
            time::sleep(Duration::from_millis(3 + round)).await;
            target.child.kill().unwrap();
            let killed = Instant::now();
            let out = time::timeout(PROMPT, r).await;
            let (res, buf) = out
                .unwrap_or_else(|_| panic!("round {round}: no outcome {PROMPT:?} after the kill"))
                .unwrap();
            assert!(lost(&res) || res.is_ok(), "round {round}: {res:?}");
            assert_eq!(buf.len(), BIG, "the destination comes back");
            assert!(killed.elapsed() < PROMPT);
        });
    }
}

#[test]
fn a_target_killed_mid_write_gives_an_outcome_within_a_second() {
    for round in 0..3 {
        let mut target = TargetProcess::spawn(&["--segment", "kv:67108864:rw"]);
        let token = target.seg("kv").token;
        let data = pattern(BIG, round as u8);
        let expect = data.clone();
        Runtime::new().unwrap().block_on(async {
            let kv = open(target.addr, token).await;
            let w = spawn_local(async move { kv.write(0, data, 1).await });
            time::sleep(Duration::from_millis(3 + round)).await;
            target.child.kill().unwrap();
            let (res, buf) = time::timeout(PROMPT, w)
                .await
                .unwrap_or_else(|_| panic!("round {round}: no outcome {PROMPT:?} after the kill"))
                .unwrap();
            assert!(lost(&res) || res.is_ok(), "round {round}: {res:?}");
            assert!(buf == expect, "the source comes back intact");
        });
    }
}

fn shard_target() -> ShardTarget {
    ShardTarget::start(tcp(), &[("kv", BIG, Rights::READ | Rights::WRITE)])
}

/// 8 rounds of a 64 MiB read (or write) with `Peer::abort()` at 1-4 ms and
/// no deadline: each gets an outcome within a second, with its buffer, and
/// an error that names this initiator's abort.
fn abort_mid_transfer(write: bool) {
    let t = shard_target();
    let token = t.seg("kv").token;
    Runtime::new().unwrap().block_on(async {
        let kv = open(t.addr, token).await;
        let mut cut = 0;
        for round in 0..8u64 {
            let kv2 = kv.clone();
            let transfer = spawn_local(async move {
                match write {
                    true => kv2.write(0, vec![7u8; BIG], round).await,
                    false => kv2.read(0, BIG as u64, vec![0u8; BIG], round).await,
                }
            });
            time::sleep(Duration::from_millis(1 + round % 4)).await;
            kv.peer().abort();
            let (res, buf) = time::timeout(PROMPT, transfer)
                .await
                .unwrap_or_else(|_| panic!("round {round}: no outcome {PROMPT:?} after abort()"))
                .unwrap();
            assert_eq!(buf.len(), BIG);
            if let Err(e) = &res {
                cut += 1;
                assert!(
                    matches!(e, TransferError::ConnectionLost(why) if why.contains("abort")),
                    "round {round}: the error must name this initiator's abort: {e:?}"
                );
            }
        }
        // (A 64 MiB transfer takes several ms here: an abort at 1-4 ms cuts
        // most rounds. None cut would have checked nothing.)
        assert!(cut > 0, "no round of 8 was cut by the abort");
    });
}

#[test]
fn abort_mid_read_without_a_deadline_gives_an_outcome_within_a_second() {
    abort_mid_transfer(false);
}

#[test]
fn abort_mid_write_without_a_deadline_gives_an_outcome_within_a_second() {
    abort_mid_transfer(true);
}

/// Sockets of this network namespace connected to `port`: (state, send queue).
fn sockets_to(port: u16) -> Vec<(u8, u64)> {
    let mut out = Vec::new();
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let remote_port = f[2].rsplit(':').next().unwrap();
            if u16::from_str_radix(remote_port, 16).unwrap() != port {
                continue;
            }
            let state = u8::from_str_radix(f[3], 16).unwrap();
            let tx = u64::from_str_radix(f[4].split(':').next().unwrap(), 16).unwrap();
            out.push((state, tx));
        }
    }
    out
}

#[test]
fn abort_discards_what_the_sockets_still_hold() {
    let t = shard_target();
    let token = t.seg("kv").token;
    let port = t.addr.port();
    Runtime::new().unwrap().block_on(async {
        let kv = open(t.addr, token).await;
        let kv2 = kv.clone();
        let w = spawn_local(async move { kv2.write(0, vec![7u8; BIG], 1).await });
        while t.stats().bytes_landed == 0 {
            time::sleep(Duration::from_millis(1)).await;
        }
        // The target stops reading: the initiator's send queues fill up.
        t.stall(Duration::from_millis(600));
        time::sleep(Duration::from_millis(50)).await;
        kv.peer().abort();
        let (res, _buf) = time::timeout(PROMPT, w).await.expect("an outcome").unwrap();
        assert!(lost(&res), "{res:?}");
        // Give the reactor a turn to reap the last ops and close the fds.
        time::sleep(Duration::from_millis(20)).await;
        let held: Vec<_> = sockets_to(port)
            .into_iter()
            .filter(|&(_, tx)| tx > 0)
            .collect();
        assert!(
            held.is_empty(),
            "after abort() the kernel still holds unsent bytes for the target (state, bytes): {held:?}"
        );
    });
}

/// A fake target that completes every handshake until `mute` is set, and
/// after that answers a hello but never an auth, on a new connection or a
/// live one: a target that hangs between the two steps of a reconnect, or
/// one frozen with its kernel still acking.
fn muting_target(mute: Arc<AtomicBool>) -> SocketAddr {
    fake_target("muting", move |mut s, addr| {
        // Serve auth requests (or, muted, hold the connection open without
        // a word); everything else is read and ignored.
        while let Some(h) = recv_header(&mut s) {
            let Some(p) = payload(&mut s, &h) else { return };
            if h.op == Opcode::Auth && !mute.load(Ordering::SeqCst) {
                accept_auth(&mut s, &p, addr, |_| {});
            }
        }
    })
}

/// An engine (connect timeout 300 ms) with segment "kv" of a
/// [`muting_target`] opened, and the target muted since.
async fn opened_then_muted() -> (Engine, quiesce_transports::Peer, RemoteSegment) {
    let mute = Arc::new(AtomicBool::new(false));
    let addr = muting_target(mute.clone());
    let cfg = EngineConfig {
        connect_timeout: Duration::from_millis(300),
        ..tcp()
    };
    let e = Engine::bind(cfg).unwrap();
    let peer = e.connect(addr).await.unwrap();
    let kv = peer
        .open("kv", quiesce_transports::Token::random())
        .await
        .unwrap();
    mute.store(true, Ordering::SeqCst);
    (e, peer, kv)
}

/// `peer.open("lv", …)` fails as `ConnectionLost` within a second (within a
/// 300 ms connect timeout), not after 3 s waiting behind `what`.
async fn open_fails_within_a_second(peer: &quiesce_transports::Peer, what: &str) {
    let t0 = Instant::now();
    let out = time::timeout(Duration::from_secs(3), peer.open("lv", Token::random())).await;
    let err = out
        .unwrap_or_else(|_| panic!("the open waited 3 s behind {what}"))
        .err()
        .expect("an open with no auth ack succeeded");
    assert!(matches!(err, TransferError::ConnectionLost(_)), "{err:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t0.elapsed()
    );
}

/// An open on a live control connection whose target stopped answering (a
/// frozen process, whose kernel still acks) fails within the connect
/// timeout. It waited for the auth ack for ever: nothing bounded an open
/// but the connection's death, which such a target never brings, so a
/// Python `get_first_buffer_address` or a transfer's first touch of a
/// segment blocked for good.
#[test]
fn an_open_whose_auth_is_never_answered_fails_within_the_connect_timeout() {
    Runtime::new().unwrap().block_on(async {
        let (_e, peer, _kv) = opened_then_muted().await;
        open_fails_within_a_second(&peer, "an auth ack that never comes").await;
    });
}

/// The teardown's `Peer::abort` makes the next transfer reconnect; a target
/// that answers the reconnect's hello and then never its auth must not hold
/// the transfer (and a batch's ticket) for ever: the whole handshake is
/// bounded by the connect timeout.
#[test]
fn a_reconnect_whose_auth_is_never_answered_fails_within_the_connect_timeout() {
    Runtime::new().unwrap().block_on(async {
        let (_e, peer, kv) = opened_then_muted().await;
        peer.abort();
        let t0 = Instant::now();
        let out = time::timeout(Duration::from_secs(3), kv.write(0, vec![1u8; 4096], 1)).await;
        let (res, buf) = out.expect("the transfer waited 3 s for an auth ack that never comes");
        assert!(lost(&res), "{res:?}");
        assert_eq!(buf.len(), 4096, "the source comes back");
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "took {:?}",
            t0.elapsed()
        );
    });
}

/// A fake target that answers every auth, fence and write — but while
/// `hold` is set, stops reading a connection at its next write's header,
/// so that the initiator's send of that write blocks with its connection's
/// send lock held. With `lure`, it also sends, while it holds, the header
/// and first byte of a `ReadData` for the request after that write — one
/// the initiator has not sent — and the rest after the write.
fn holding_target(hold: Arc<AtomicBool>, lure: bool) -> SocketAddr {
    fake_target("holding", move |mut s, addr| {
        while let Some(h) = recv_header(&mut s) {
            let lured = h.op == Opcode::Write && hold.load(Ordering::SeqCst) && lure;
            if lured {
                // After the initiator registered its next request.
                std::thread::sleep(Duration::from_millis(150));
                let rd = Header {
                    op: Opcode::ReadData,
                    task: h.task + 1,
                    length: 4096,
                    ..h
                };
                send(&mut s, &rd, &[0x66]);
            }
            while h.op == Opcode::Write && hold.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let Some(p) = payload(&mut s, &h) else { return };
            if lured {
                std::thread::sleep(Duration::from_millis(100));
                if s.write_all(&[0x66; 4095]).is_err() {
                    return;
                }
            }
            match h.op {
                Opcode::Auth => accept_auth(&mut s, &p, addr, |_| {}),
                Opcode::Write => answer(&mut s, &h, Status::Ok),
                Opcode::Fence => ack_fence(&mut s, &h),
                _ => {}
            }
        }
    })
}

/// An `open` given up while it waited for a data connection's send lock
/// (a large write held it) sent no `Auth` there: it must leave no answer
/// slot behind, or the next open's answer fills the dead slot and that
/// open (and every later one) waits for the wrong answer.
#[test]
fn an_open_given_up_behind_a_write_leaves_the_next_open_its_answer() {
    let hold = Arc::new(AtomicBool::new(false));
    let addr = holding_target(hold.clone(), false);
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(addr).await.unwrap();
        let kv = peer.open("kv", Token::random()).await.unwrap();
        hold.store(true, Ordering::SeqCst);
        let write = spawn_local(async move { kv.write(0, vec![1u8; BIG], 1).await.0 });
        time::sleep(Duration::from_millis(100)).await;
        let given_up =
            time::timeout(Duration::from_millis(100), peer.open("b", Token::random())).await;
        assert!(given_up.is_err(), "the open did not wait behind the write");
        hold.store(false, Ordering::SeqCst);
        assert_eq!(write.await.unwrap().unwrap(), BIG as u64);
        let next = time::timeout(Duration::from_secs(2), peer.open("c", Token::random())).await;
        match next {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("the next open failed: {e}"),
            Err(_) => panic!("the next open got no answer within 2 s"),
        }
        e.shutdown();
    });
}

/// A target that answers a read the initiator has not sent yet (a hostile
/// one, guessing the next request id) while that read waits for its send
/// lock, and trickles the bytes. The read then gives up unsent (its batch
/// was fenced meanwhile): it must come back with an error once the reader
/// let go of its buffer — not panic, and not return while the reader still
/// writes into the buffer.
#[test]
fn a_read_answered_before_it_was_sent_ends_in_an_error_not_a_panic() {
    let hold = Arc::new(AtomicBool::new(false));
    let addr = holding_target(hold.clone(), true);
    Runtime::new().unwrap().block_on(async {
        let cfg = EngineConfig {
            connections_per_peer: 1,
            slice_size: BIG,
            max_frame: BIG as u64,
            ..tcp()
        };
        let e = Engine::bind(cfg).unwrap();
        let peer = e.connect(addr).await.unwrap();
        let kv = peer.open("kv", Token::random()).await.unwrap();
        hold.store(true, Ordering::SeqCst);
        let w = kv.clone();
        let write = spawn_local(async move { w.write(0, vec![1u8; BIG], 1).await.0 });
        time::sleep(Duration::from_millis(50)).await;
        let r = kv.clone();
        let read = spawn_local(async move { r.read(0, 4096, vec![0u8; 4096], 9).await.0 });
        time::sleep(Duration::from_millis(250)).await;
        peer.fence(9).await.unwrap();
        hold.store(false, Ordering::SeqCst);
        let read = time::timeout(Duration::from_secs(5), read)
            .await
            .expect("the read never ended");
        assert!(
            read.expect("the read panicked").is_err(),
            "an unsent read succeeded"
        );
        assert_eq!(write.await.unwrap().unwrap(), BIG as u64);
        e.shutdown();
    });
}

/// A reconnect given up mid-handshake (its transfer dropped while the
/// target had not answered the auth) must close the connection it made:
/// nothing else can reach it, and left open it would count as a carrier of
/// every batch fenced while it lives.
#[test]
fn a_reconnect_given_up_mid_handshake_closes_its_connection() {
    let mute = Arc::new(AtomicBool::new(false));
    let addr = muting_target(mute.clone());
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(addr).await.unwrap();
        let kv = peer.open("kv", Token::random()).await.unwrap();
        mute.store(true, Ordering::SeqCst);
        peer.abort();
        let given_up =
            time::timeout(Duration::from_millis(200), kv.write(0, vec![1u8; 4096], 1)).await;
        assert!(
            given_up.is_err(),
            "the write did not wait for the reconnect"
        );
        time::sleep(Duration::from_millis(300)).await;
        const ESTABLISHED: u8 = 1;
        let open: Vec<_> = sockets_to(addr.port())
            .into_iter()
            .filter(|&(state, _)| state == ESTABLISHED)
            .collect();
        assert!(open.is_empty(), "connections left open: {open:?}");
        e.shutdown();
    });
}

/// A fake target that keeps, per connection, the segment ids proven on it
/// and refuses a write to any other (`Forbidden`), as a real target does.
/// With `drop_next_write` set it closes the connection a write arrives on
/// (once); with `slow_new` set, connections opened from then on get their
/// auth answers 300 ms late.
fn proving_target(drop_next_write: Arc<AtomicBool>, slow_new: Arc<AtomicBool>) -> SocketAddr {
    fake_target("proving", move |mut s, addr| {
        let slow = slow_new.load(Ordering::SeqCst);
        let mut proven = std::collections::HashSet::new();
        while let Some(h) = recv_header(&mut s) {
            if h.op == Opcode::Write && drop_next_write.swap(false, Ordering::SeqCst) {
                return;
            }
            let Some(p) = payload(&mut s, &h) else { return };
            match h.op {
                Opcode::Auth => {
                    if slow {
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    accept_auth(&mut s, &p, addr, |id| {
                        proven.insert(id);
                    });
                }
                Opcode::Write => match proven.contains(&h.segment) {
                    true => answer(&mut s, &h, Status::Ok),
                    false => answer(&mut s, &h, Status::Forbidden),
                },
                _ => {}
            }
        }
    })
}

/// An open that runs while a data connection is being reconnected (its
/// re-proof of the segments opened so far still unanswered) must end with
/// its segment proven on that connection too: the reconnect proves what
/// was opened meanwhile before it installs the connection.
#[test]
fn an_open_during_a_reconnect_is_proven_on_the_new_connection() {
    let drop_next_write = Arc::new(AtomicBool::new(false));
    let slow_new = Arc::new(AtomicBool::new(false));
    let addr = proving_target(drop_next_write.clone(), slow_new.clone());
    Runtime::new().unwrap().block_on(async {
        let cfg = EngineConfig {
            connections_per_peer: 1,
            ..tcp()
        };
        let e = Engine::bind(cfg).unwrap();
        let peer = e.connect(addr).await.unwrap();
        let a = peer.open("a", Token::random()).await.unwrap();
        assert!(a.write(0, vec![1u8; 64], 1).await.0.is_ok());
        // The data connection dies; its reconnect's re-proof is slow.
        drop_next_write.store(true, Ordering::SeqCst);
        assert!(a.write(0, vec![1u8; 64], 2).await.0.is_err());
        slow_new.store(true, Ordering::SeqCst);
        let a2 = a.clone();
        let again = spawn_local(async move { a2.write(0, vec![1u8; 64], 3).await.0 });
        time::sleep(Duration::from_millis(50)).await;
        let b = peer.open("b", Token::random()).await.unwrap();
        assert!(again.await.unwrap().is_ok());
        let (res, _) = b.write(0, vec![2u8; 64], 4).await;
        assert!(
            res.is_ok(),
            "b was not proven on the reconnected connection: {res:?}"
        );
        e.shutdown();
    });
}
