//! Every rejection: typed, and the segment is left untouched.

mod common;

use std::time::Duration;

use common::*;
use quiesce_runtime::Runtime;
use quiesce_transports::wire::{Header, Hello, Opcode, SegmentRef, Status, VERSION};
use quiesce_transports::{Engine, EngineConfig, Rights, Token, TransferError};

fn target() -> ShardTarget {
    target_with_handshake_timeout(Duration::from_secs(5))
}

/// A short timeout only where a test waits for it: under load a hello can
/// take a while, and a short one then drops honest peers.
fn target_with_handshake_timeout(handshake_timeout: Duration) -> ShardTarget {
    ShardTarget::start(
        EngineConfig {
            max_frame: 1 << 20,
            handshake_timeout,
            ..tcp()
        },
        &[
            ("kv", 1 << 20, Rights::READ | Rights::WRITE),
            ("ro", 4096, Rights::READ),
            ("wo", 4096, Rights::WRITE),
        ],
    )
}

fn untouched(t: &ShardTarget, name: &str) -> bool {
    let len = t.seg(name).len as usize;
    t.snapshot(name, 0, len).iter().all(|&b| b == 0)
}

fn write(id: u64, offset: u64, length: u64) -> Header {
    Header {
        batch: 1,
        task: 1,
        segment: id,
        offset,
        length,
        ..Header::new(Opcode::Write)
    }
}

#[test]
fn unauthorised_writes_are_forbidden_and_discarded() {
    let t = target();
    let id = t.seg("kv").id;
    // Before any token is proven: refused, and the connection is closed.
    let mut c = RawClient::connect(t.addr);
    c.send(&write(id, 0, 100), &[0xee; 100]);
    let h = c.recv().unwrap();
    assert_eq!(
        (h.op, h.status().unwrap()),
        (Opcode::Status, Status::Forbidden)
    );
    assert!(
        c.recv().is_none(),
        "closed: only Auth is served before a proof"
    );
    // Authenticated for another segment: refused per request, the payload
    // consumed, the connection still in sync.
    let mut c = RawClient::connect(t.addr);
    let ro = t.seg("ro").id;
    assert_eq!(c.auth_status(ro, t.seg("ro").token), Status::Ok);
    c.send(&write(id, 0, 100), &[0xee; 100]);
    let h = c.recv().unwrap();
    assert_eq!(
        (h.op, h.status().unwrap()),
        (Opcode::Status, Status::Forbidden)
    );
    assert_eq!(c.auth_status(id, t.seg("kv").token), Status::Ok);
    c.send(&write(id, 0, 4), &[1, 2, 3, 4]);
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::Ok);
    assert_eq!(t.snapshot("kv", 0, 6), vec![1, 2, 3, 4, 0, 0]);
}

#[test]
fn a_wrong_token_is_refused() {
    let t = target();
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        // A wrong token and a name the target does not have are refused
        // alike: a refusal does not say whether a segment exists.
        let err = peer.open("kv", Token::random()).await.err().unwrap();
        assert_eq!(err, TransferError::OpenRefused("kv".into()));
        let err = peer.open("nope", Token::random()).await.err().unwrap();
        assert_eq!(err, TransferError::OpenRefused("nope".into()));
        // The right token opens it, on the same peer.
        let kv = peer.open("kv", t.seg("kv").token).await.unwrap();
        assert_eq!(kv.id(), t.seg("kv").id);
    });
    let mut c = RawClient::connect(t.addr);
    let id = t.seg("kv").id;
    assert_eq!(c.auth_status(id, Token::random()), Status::Forbidden);
    // Nothing is listed before a proof (a hello ack names no segment); a
    // proof by name opens it and returns its descriptor.
    let ack = c.auth_ref(SegmentRef::Name("kv".into()), t.seg("kv").token);
    match &ack.results[..] {
        [(Status::Ok, Some(d))] => assert_eq!((d.id, d.name.as_str()), (id, "kv")),
        r => panic!("opening by name: {r:?}"),
    }
    assert!(untouched(&t, "kv"));
}

#[test]
fn rights_are_enforced_by_the_target() {
    let t = target();
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let ro = peer.open("ro", t.seg("ro").token).await.unwrap();
        let (res, buf) = ro.write(0, vec![5u8; 64], 1).await;
        assert_eq!(res.unwrap_err(), TransferError::Forbidden(t.seg("ro").id));
        assert_eq!(buf, vec![5u8; 64], "the buffer comes back");
        let wo = peer.open("wo", t.seg("wo").token).await.unwrap();
        let (res, _) = wo.read(0, 64, vec![0u8; 64], 2).await;
        assert_eq!(res.unwrap_err(), TransferError::Forbidden(t.seg("wo").id));
        // The connection is still good.
        let (res, _) = wo.write(0, vec![1u8; 8], 3).await;
        assert_eq!(res.unwrap(), 8);
    });
    assert!(untouched(&t, "ro"));
}

#[test]
fn out_of_bounds_is_refused_locally_and_by_the_target() {
    let t = target();
    let (id, len) = (t.seg("kv").id, t.seg("kv").len);
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let kv = e
            .connect(t.addr)
            .await
            .unwrap()
            .open("kv", t.seg("kv").token)
            .await
            .unwrap();
        let (res, buf) = kv.write(len - 1, vec![1u8; 2], 1).await;
        assert_eq!(
            res.unwrap_err(),
            TransferError::OutOfBounds {
                offset: len - 1,
                len: 2,
                seg_len: len
            }
        );
        assert_eq!(buf.len(), 2);
        let (res, _) = kv.write(u64::MAX, vec![1u8; 2], 1).await;
        assert!(matches!(res, Err(TransferError::OutOfBounds { .. })));
    });
    // A raw client skips the local check: the target refuses too.
    let mut c = RawClient::connect(t.addr);
    c.auth(id, t.seg("kv").token);
    c.send(&write(id, len - 10, 20), &[0xaa; 20]);
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::OutOfBounds);
    c.send(&write(id, u64::MAX - 5, 10), &[0xaa; 10]);
    assert_eq!(
        c.recv().unwrap().status().unwrap(),
        Status::OutOfBounds,
        "offset + length overflows"
    );
    c.send(
        &Header {
            length: 10,
            offset: len - 5,
            segment: id,
            ..Header::new(Opcode::Read)
        },
        &[],
    );
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::OutOfBounds);
    assert!(untouched(&t, "kv"));
}

#[test]
fn unknown_segments_are_refused() {
    let t = target();
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
        assert!(t.deregister("kv"));
        let (res, _) = kv.write(0, vec![1u8; 16], 1).await;
        assert_eq!(res.unwrap_err(), TransferError::NoSuchSegment(kv.id()));
    });
    // A segment this connection never proved: the same refusal whether it
    // exists or not, in Auth and in requests (no existence oracle).
    let mut c = RawClient::connect(t.addr);
    let ro = t.seg("ro").id;
    c.auth(ro, t.seg("ro").token);
    for id in [999, t.seg("wo").id] {
        assert_eq!(c.auth_status(id, Token::random()), Status::Forbidden);
        c.send(&write(id, 0, 3), &[1, 2, 3]);
        assert_eq!(c.recv().unwrap().status().unwrap(), Status::Forbidden);
    }
}

#[test]
fn zero_and_oversized_lengths() {
    let t = target();
    let id = t.seg("kv").id;
    let mut c = RawClient::connect(t.addr);
    c.auth(id, t.seg("kv").token);
    c.send(&write(id, 0, 0), &[]);
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::BadFrame);
    c.send(
        &Header {
            segment: id,
            length: 0,
            ..Header::new(Opcode::Read)
        },
        &[],
    );
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::BadFrame);
    // Over max_frame: the payload cannot be trusted, so the target hangs up.
    c.send(&write(id, 0, 2 << 20), &[]);
    assert_eq!(c.recv().unwrap().status().unwrap(), Status::BadFrame);
    assert!(c.recv().is_none(), "connection closed");
    assert!(untouched(&t, "kv"));
}

#[test]
fn malformed_frames_close_the_connection_but_not_the_target() {
    let t = target();
    let id = t.seg("kv").id;
    for bad in [
        {
            let mut b = write(id, 0, 4).encode();
            b[0] = b'X'; // magic
            b
        },
        {
            let mut b = write(id, 0, 4).encode();
            b[4] = 9; // version
            b
        },
        {
            let mut b = write(id, 0, 4).encode();
            b[6] = 200; // op
            b
        },
        Header::new(Opcode::HelloAck).encode(), // an op a target never receives
    ] {
        // Authenticated first: before that, anything but Auth is refused.
        let mut c = RawClient::connect(t.addr);
        c.auth(id, t.seg("kv").token);
        use std::io::Write;
        c.s.write_all(&bad).unwrap();
        c.s.write_all(&[0xaa; 4]).unwrap();
        let h = c.recv();
        assert!(h.is_none() || h.unwrap().status() == Ok(Status::BadFrame));
        assert!(
            c.recv().is_none(),
            "connection closed after a malformed frame"
        );
    }
    // Garbage instead of a hello.
    let mut s = std::net::TcpStream::connect(t.addr).unwrap();
    use std::io::Write;
    s.write_all(&[0x55; 200]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = recv_header(&mut s);
    assert!(recv_header(&mut s).is_none());
    // The target still serves.
    let mut c = RawClient::connect(t.addr);
    assert_eq!(c.auth_status(id, t.seg("kv").token), Status::Ok);
    assert!(untouched(&t, "kv"));
}

#[test]
fn version_mismatch_and_silent_peers_are_dropped() {
    let t = target_with_handshake_timeout(Duration::from_millis(300));
    let mut s = std::net::TcpStream::connect(t.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hello = Hello {
        version_min: VERSION + 1,
        version_max: VERSION + 2,
        session: 1,
        shards: 1,
        nonce: [0; 16],
        node: "future".into(),
    }
    .encode()
    .unwrap();
    send(
        &mut s,
        &Header {
            length: hello.len() as u64,
            ..Header::new(Opcode::Hello)
        },
        &hello,
    );
    assert_eq!(
        recv_header(&mut s).unwrap().status().unwrap(),
        Status::BadFrame
    );
    assert!(recv_header(&mut s).is_none());
    // Says nothing: closed after the handshake timeout.
    let mut quiet = std::net::TcpStream::connect(t.addr).unwrap();
    quiet
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let t0 = std::time::Instant::now();
    assert!(recv_header(&mut quiet).is_none());
    assert!(t0.elapsed() >= Duration::from_millis(250));
}

#[test]
fn unknown_peers_and_garbage_targets_are_typed_errors() {
    // Nothing listens there.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // A "target" that answers the hello with garbage.
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = fake.local_addr().unwrap();
    let th = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = fake.accept().unwrap();
        let mut b = [0u8; 256];
        let _ = s.read(&mut b);
        s.write_all(&[0xff; 64]).unwrap();
    });
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        assert!(matches!(
            e.connect(addr).await.err().unwrap(),
            TransferError::Handshake { .. }
        ));
        assert!(matches!(
            e.connect(fake_addr).await.err().unwrap(),
            TransferError::Handshake { .. }
        ));
    });
    th.join().unwrap();
}

/// Frames sent back to back in one `write` reach the target in one segment
/// of the stream, and its read-ahead takes several at once: each is still
/// checked before any of its bytes land, a refused write's payload is
/// dropped from what was read ahead (the frames after it stay in step),
/// and only the accepted writes change the segment.
#[test]
fn frames_sent_together_are_each_checked_before_any_byte_lands() {
    let t = target();
    let (kv, ro) = (t.seg("kv").id, t.seg("ro").id);
    let mut c = RawClient::connect(t.addr);
    c.auth(kv, t.seg("kv").token);
    c.auth(ro, t.seg("ro").token);
    let frame = |h: Header, payload: &[u8]| {
        let mut v = h.encode().to_vec();
        v.extend_from_slice(payload);
        v
    };
    let w = |batch, task, segment, offset, len: usize| Header {
        batch,
        task,
        segment,
        offset,
        length: len as u64,
        ..Header::new(Opcode::Write)
    };
    let mut all = frame(
        Header {
            batch: 9,
            ..Header::new(Opcode::Fence)
        },
        &[],
    );
    all.extend(frame(w(9, 1, kv, 0, 4096), &[0xab; 4096])); // its batch is fenced
    all.extend(frame(w(10, 2, kv, 8192, 4096), &[0xcd; 4096]));
    all.extend(frame(w(10, 3, ro, 0, 4096), &[0xee; 4096])); // read-only
    all.extend(frame(w(10, 4, kv, 16384, 100), &[0x11; 100]));
    all.extend(frame(w(10, 5, kv, (1 << 20) - 10, 100), &[0x22; 100])); // out of bounds
    all.extend(frame(w(10, 6, kv, 20000, 3), &[0x33; 3]));
    use std::io::Write;
    c.s.write_all(&all).unwrap();

    let ack = c.recv().unwrap();
    assert_eq!((ack.op, ack.batch), (Opcode::FenceAck, 9));
    for (task, want) in [
        (1, Status::Fenced),
        (2, Status::Ok),
        (3, Status::Forbidden),
        (4, Status::Ok),
        (5, Status::OutOfBounds),
        (6, Status::Ok),
    ] {
        let h = c.recv().expect("a status for every write, in order");
        assert_eq!(
            (h.op, h.task, h.status().unwrap()),
            (Opcode::Status, task, want),
            "write {task}"
        );
    }
    let mut expect = vec![0u8; 1 << 20];
    expect[8192..12288].fill(0xcd);
    expect[16384..16484].fill(0x11);
    expect[20000..20003].fill(0x33);
    let got = t.snapshot("kv", 0, 1 << 20);
    let first_bad = got.iter().zip(&expect).position(|(a, b)| a != b);
    assert_eq!(first_bad, None, "kv differs from the accepted writes");
    assert!(untouched(&t, "ro"));
}
