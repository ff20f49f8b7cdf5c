//! Target-side revoke: once `Segment::revoke(range)` resolves, no byte of a
//! write accepted, landing, or queued before it lands in the range, whoever
//! sent it; writes land there again only under a grant proven afterwards.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::Runtime;
use quiesce_transports::wire::{GrantReceipt, Header, Opcode, SegmentRef, Status};
use quiesce_transports::{Engine, EngineConfig, LocalMode, RevokeError, Rights, TransferError};

const LEN: usize = 1 << 20;
const HALF: usize = LEN / 2;

fn target() -> ShardTarget {
    ShardTarget::start(tcp(), &[("kv", 4 * LEN, Rights::READ | Rights::WRITE)])
}

fn write_header(id: u64, task: u64, len: usize) -> Header {
    Header {
        batch: 1,
        task,
        segment: id,
        offset: 0,
        length: len as u64,
        ..Header::new(Opcode::Write)
    }
}

/// Another initiator (a real engine) writes `LEN` bytes of `0xB2` at 0.
fn newer_write(t: &ShardTarget) {
    let token = t.seg("kv").token;
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let kv = e
            .connect(t.addr)
            .await
            .unwrap()
            .open("kv", token)
            .await
            .unwrap();
        let (r, _) = kv.write(0, vec![0xB2; LEN], 2).await;
        assert_eq!(r.unwrap(), LEN as u64, "the newer write completes");
        e.shutdown();
    });
}

/// An old initiator's write is half landed (its sender holds back the rest);
/// the owner revokes the range (or not); a newer write completes; then the
/// old sender delivers the rest and one more write. Returns the status of
/// both old writes and how many old bytes are found over the newer ones.
fn late_writer(revoke: bool) -> (Header, Header, usize) {
    let t = target();
    let kv = t.seg("kv").clone();
    let mut old = RawClient::connect(t.addr);
    assert_eq!(old.auth_status(kv.id, kv.token), Status::Ok);
    old.s
        .write_all(&write_header(kv.id, 1, LEN).encode())
        .unwrap();
    old.s.write_all(&[0xA1; HALF]).unwrap();
    let t0 = Instant::now();
    while t.snapshot("kv", 0, HALF).iter().any(|&b| b != 0xA1) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the first half never landed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    if revoke {
        t.revoke("kv", 0..(4 * LEN) as u64)
            .expect("revoke resolves");
    }
    newer_write(&t);
    // The old sender delivers the rest of its write, then another write.
    old.s.write_all(&[0xA1; HALF]).unwrap();
    let first = old.recv().expect("an answer to the old write");
    old.send(&write_header(kv.id, 3, 64 << 10), &[0xA1; 64 << 10]);
    let second = old.recv().expect("an answer to the second old write");
    std::thread::sleep(Duration::from_millis(50));
    let stale = t
        .snapshot("kv", 0, LEN)
        .iter()
        .filter(|&&b| b == 0xA1)
        .count();
    (first, second, stale)
}

#[test]
fn without_revoke_an_old_write_lands_over_a_newer_one() {
    // The hazard revoke exists for: bytes of an old grant arrive late.
    let (first, second, stale) = late_writer(false);
    assert_eq!(first.status().unwrap(), Status::Ok);
    assert_eq!(second.status().unwrap(), Status::Ok);
    assert!(stale > 0, "the late bytes did not land: nothing was tested");
}

#[test]
fn revoke_stops_a_landing_write_and_refuses_queued_and_later_ones_of_the_old_grant() {
    let (first, second, stale) = late_writer(true);
    assert_eq!(first.status().unwrap(), Status::Revoked, "{first:?}");
    assert_eq!(
        first.length, HALF as u64,
        "the prefix that landed before the revoke"
    );
    assert_eq!(second.status().unwrap(), Status::Revoked, "{second:?}");
    assert_eq!(
        stale, 0,
        "{stale} bytes of the old grant landed after the revoke"
    );
}

#[test]
fn a_connection_that_proves_the_token_again_writes_under_the_new_grant() {
    let t = target();
    let kv = t.seg("kv").clone();
    let mut c = RawClient::connect(t.addr);
    c.auth(kv.id, kv.token);
    t.revoke("kv", 0..4096).unwrap();
    c.send(&write_header(kv.id, 1, 16), &[1u8; 16]);
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::Revoked);
    // Outside the revoked range the old grant still writes.
    c.send(
        &Header {
            offset: 8192,
            ..write_header(kv.id, 2, 16)
        },
        &[2u8; 16],
    );
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::Ok);
    // A proof that names no newer grant than the connection holds regrants
    // nothing (it could have been sent before the revoke); its answer
    // carries the receipt of the grant now.
    let ack = c.auth(kv.id, kv.token);
    assert_eq!(ack.results[0].0, Status::Ok);
    let grant = ack.results[0].1.as_ref().unwrap().grant;
    assert_eq!(grant.epoch, 1, "the revoke's epoch");
    c.send(&write_header(kv.id, 3, 16), &[3u8; 16]);
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::Revoked);
    // A receipt the target did not issue is no grant either.
    let forged = GrantReceipt {
        epoch: 1,
        tag: [0x5a; 16],
    };
    let ack = c.auth_granted(SegmentRef::Id(kv.id), kv.token, forged);
    assert_eq!(
        ack.results[0].0,
        Status::Ok,
        "the token is proven all the same"
    );
    c.send(&write_header(kv.id, 4, 16), &[4u8; 16]);
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::Revoked);
    // Naming the receipt, sent after the revoke, writes under the new grant.
    let ack = c.auth_granted(SegmentRef::Id(kv.id), kv.token, grant);
    assert_eq!(ack.results[0].0, Status::Ok);
    c.send(&write_header(kv.id, 5, 16), &[5u8; 16]);
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::Ok);
    assert_eq!(t.snapshot("kv", 0, 16), vec![5u8; 16]);
}

#[test]
fn the_initiator_sees_a_typed_revoked_error_and_open_regrants() {
    let t = target();
    let token = t.seg("kv").token;
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let kv = peer.open("kv", token).await.unwrap();
        assert_eq!(kv.write(0, vec![1u8; 100], 1).await.0.unwrap(), 100);
        t.revoke("kv", 0..100).unwrap();
        let (r, _) = kv.write(0, vec![2u8; 100], 2).await;
        assert_eq!(r.unwrap_err(), TransferError::Revoked { landed: 0 });
        let kv = peer.open("kv", token).await.unwrap();
        assert_eq!(kv.write(0, vec![3u8; 100], 3).await.0.unwrap(), 100);
        e.shutdown();
    });
    assert_eq!(t.snapshot("kv", 0, 100), vec![3u8; 100]);
}

/// A write made before the revoke whose connection is gone: the transfer
/// reconnects after the revoke resolved, and the new connection must not
/// carry it under the grant the revoke made (it proves only the grant its
/// segment was opened with), so it is refused and nothing of it lands.
#[test]
fn a_write_made_before_the_revoke_does_not_land_through_a_reconnect() {
    let t = target();
    let token = t.seg("kv").token;
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let kv = peer.open("kv", token).await.unwrap();
        assert_eq!(kv.write(0, vec![1u8; 100], 1).await.0.unwrap(), 100);
        peer.abort();
        let late = kv.write(0, vec![0xBB; 100], 2);
        t.revoke("kv", 0..100).unwrap();
        let (r, _) = late.await;
        assert_eq!(r.unwrap_err(), TransferError::Revoked { landed: 0 });
        // Outside the revoked range the reconnected connection writes.
        assert_eq!(kv.write(200, vec![4u8; 100], 3).await.0.unwrap(), 100);
        e.shutdown();
    });
    assert_eq!(
        t.snapshot("kv", 0, 100),
        vec![1u8; 100],
        "a write made before the revoke landed after it"
    );
    assert_eq!(t.snapshot("kv", 200, 100), vec![4u8; 100]);
}

/// The same write, still waiting when its initiator opens the segment
/// again (and so takes the revoke's grant on every connection): it goes
/// out under none newer than its handle's, and is refused; the new
/// handle's writes land. `len`: the write's size (a mailbox slot's, or a
/// request of its own).
fn refused_after_the_segment_is_opened_again(
    target: EngineConfig,
    initiator: EngineConfig,
    len: usize,
) {
    let t = ShardTarget::start(target, &[("kv", 4 * LEN, Rights::READ | Rights::WRITE)]);
    let token = t.seg("kv").token;
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(initiator).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let kv = peer.open("kv", token).await.unwrap();
        assert_eq!(kv.write(0, vec![1u8; len], 1).await.0.unwrap(), len as u64);
        peer.abort();
        let late = kv.write(0, vec![0xBB; len], 2);
        let also_late = kv.clone();
        t.revoke("kv", 0..len as u64).unwrap();
        let again = peer.open("kv", token).await.unwrap();
        let (r, _) = late.await;
        assert_eq!(r.unwrap_err(), TransferError::Revoked { landed: 0 });
        let (r, _) = also_late.write(0, vec![0xBC; len], 3).await;
        assert_eq!(r.unwrap_err(), TransferError::Revoked { landed: 0 });
        assert_eq!(
            again.write(0, vec![3u8; len], 4).await.0.unwrap(),
            len as u64
        );
        e.shutdown();
    });
    assert!(t.snapshot("kv", 0, len) == vec![3u8; len], "{len} bytes");
}

#[test]
fn a_write_made_before_the_revoke_is_refused_after_the_segment_is_opened_again() {
    refused_after_the_segment_is_opened_again(tcp(), tcp(), 100);
    refused_after_the_segment_is_opened_again(tcp(), tcp(), LEN);
}

/// The same over the local transport: through the mailbox and through
/// requests of their own on the attached socket.
#[test]
fn a_write_made_before_the_revoke_is_refused_after_a_new_open_over_the_local_transport() {
    for (mailbox, len) in [(true, 100), (true, LEN), (false, 100)] {
        let initiator = EngineConfig {
            local: LocalMode::Required,
            mailbox,
            ..EngineConfig::default()
        };
        refused_after_the_segment_is_opened_again(EngineConfig::default(), initiator, len);
    }
}

#[test]
fn bad_revokes_are_typed_errors() {
    let t = target();
    let len = (4 * LEN) as u64;
    assert_eq!(
        t.revoke("kv", 0..len + 1),
        Err(RevokeError::OutOfBounds {
            start: 0,
            end: len + 1,
            len
        })
    );
    assert!(matches!(
        t.revoke("kv", 5..5),
        Err(RevokeError::OutOfBounds { .. })
    ));
}

/// Segments may overlap (a range registered, then one inside it). A revoke
/// of a range of one reaches every segment whose memory holds part of it:
/// a write landing there through the other segment is stopped before the
/// revoke resolves, and the old grant's later writes there are refused.
#[test]
fn a_revoke_reaches_writes_through_every_overlapping_segment() {
    use quiesce_runtime::time::sleep;
    use quiesce_transports::ForeignMemory;
    const PART: usize = 16 << 10;
    let mut owned = vec![0u8; 64 << 10].into_boxed_slice();
    let ptr = owned.as_mut_ptr();
    Runtime::new().unwrap().block_on(async {
        let engine = Engine::bind(tcp()).unwrap();
        let rw = Rights::READ | Rights::WRITE;
        // SAFETY: `owned` outlives `block_on`, which drops the engine (and
        // with it both lendings); only the engine writes it meanwhile.
        let (outer, inner) = unsafe {
            (
                ForeignMemory::new(ptr, 64 << 10, || {}),
                ForeignMemory::new(ptr.add(PART), PART, || {}),
            )
        };
        let outer = engine.register("outer", outer, rw).unwrap();
        let inner = engine.register("inner", inner, rw).unwrap();
        let (addr, id, token) = (engine.local_addr(), inner.id(), inner.token());
        // A peer of `inner` sends half a write, and the rest when told.
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let peer = std::thread::spawn(move || {
            let mut c = RawClient::connect(addr);
            assert_eq!(c.auth_status(id, token), Status::Ok);
            c.s.write_all(&write_header(id, 1, PART).encode()).unwrap();
            c.s.write_all(&[0xA1; PART / 2]).unwrap();
            go_rx.recv().unwrap();
            c.s.write_all(&[0xA1; PART / 2]).unwrap();
            let first = c.recv().expect("an answer to the old write");
            c.send(&write_header(id, 2, 4096), &[0xA1; 4096]);
            let second = c.recv().expect("an answer to the second old write");
            (first, second)
        });
        let t0 = Instant::now();
        let mut half = vec![0u8; PART / 2];
        while {
            assert!(outer.read_at(PART as u64, &mut half));
            half.iter().any(|&b| b != 0xA1)
        } {
            assert!(t0.elapsed() < Duration::from_secs(5), "half never landed");
            sleep(Duration::from_millis(1)).await;
        }
        // Revoked through the outer segment: resolves once nothing of the
        // old grant can land in it, through either segment.
        outer.revoke(0..(64 << 10)).await.unwrap();
        assert!(outer.write_at(PART as u64, &[0u8; PART]));
        go_tx.send(()).unwrap();
        while !peer.is_finished() {
            assert!(t0.elapsed() < Duration::from_secs(10), "the peer hangs");
            sleep(Duration::from_millis(1)).await;
        }
        let (first, second) = peer.join().unwrap();
        assert_eq!(first.status().unwrap(), Status::Revoked, "{first:?}");
        assert_eq!(second.status().unwrap(), Status::Revoked, "{second:?}");
        let mut after = vec![1u8; PART];
        assert!(outer.read_at(PART as u64, &mut after));
        let stale = after.iter().filter(|&&b| b == 0xA1).count();
        assert_eq!(
            stale, 0,
            "{stale} bytes of the old grant landed after the revoke"
        );
        engine.shutdown();
    });
    drop(owned);
}

/// An `Auth` proving the token again, queued in the target's socket with a
/// write behind it before the revoke was called, regrants nothing: it may
/// have been sent before the revoke too, and so may the write. (The target
/// stamped the connection with the epoch current when it *read* the proof —
/// after the revoke — and the write landed in the revoked range.)
#[test]
fn a_proof_queued_before_the_revoke_does_not_regrant_the_writes_behind_it() {
    use std::sync::mpsc;
    let rt = Runtime::new().unwrap();
    let e = rt.block_on(async { Engine::bind(tcp()).unwrap() });
    let kv = e
        .register("kv", vec![0u8; 4096], Rights::READ | Rights::WRITE)
        .unwrap();
    let (addr, id, token) = (e.local_addr(), kv.id(), kv.token());
    let (ready_tx, ready_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (sent_tx, sent_rx) = mpsc::channel();
    let client = std::thread::spawn(move || {
        let mut c = RawClient::connect(addr);
        assert_eq!(c.auth_status(id, token), Status::Ok);
        ready_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        // The proof and a write behind it, in one send.
        let mut frames = c.auth_frame(&[(SegmentRef::Id(id), token)]);
        frames.extend_from_slice(&write_header(id, 1, 8).encode());
        frames.extend_from_slice(&[0xAA; 8]);
        c.s.write_all(&frames).unwrap();
        sent_tx.send(()).unwrap();
        let h = c.recv().expect("the proof's answer");
        assert_eq!(h.op, Opcode::AuthAck);
        fake::payload(&mut c.s, &h).expect("the proof's answer's payload");
        c.recv().expect("the write's answer")
    });
    // The runtime turns while the client connects and proves the token.
    rt.block_on(async {
        while ready_rx.try_recv().is_err() {
            quiesce_runtime::time::sleep(Duration::from_millis(1)).await;
        }
    });
    // Now it does not: the frames wait in the target's socket, unread.
    go_tx.send(()).unwrap();
    sent_rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    rt.block_on(kv.revoke(0..8)).expect("the revoke resolves");
    rt.block_on(async {
        while !client.is_finished() {
            quiesce_runtime::time::sleep(Duration::from_millis(1)).await;
        }
    });
    let answer = client.join().unwrap();
    let mut landed = [0u8; 8];
    assert!(kv.read_at(0, &mut landed));
    assert_eq!(
        landed, [0u8; 8],
        "a write sent before the revoke landed after it"
    );
    assert_eq!(answer.status().unwrap(), Status::Revoked, "{answer:?}");
    rt.block_on(async { e.shutdown() });
}
