//! Opening a segment by the target's virtual address of a byte inside it
//! (`SegmentRef::Address`, how Mooncake-style callers name remote memory).

mod common;

use std::time::Duration;

use common::*;
use quiesce_runtime::Runtime;
use quiesce_transports::wire::{SegmentRef, Status};
use quiesce_transports::{Engine, EngineConfig, ForeignMemory, Rights, Token, TransferError};

fn target() -> ShardTarget {
    ShardTarget::start(
        EngineConfig {
            handshake_timeout: Duration::from_secs(5),
            ..tcp()
        },
        &[
            ("a", 1 << 20, Rights::READ | Rights::WRITE),
            ("b", 64 << 10, Rights::READ | Rights::WRITE),
        ],
    )
}

/// Any address inside a segment opens that segment, and its descriptor's
/// base maps addresses to offsets: a write to `base + 4096` lands at offset
/// 4096 of the right segment.
#[test]
fn an_address_inside_a_segment_opens_it_and_maps_to_its_offset() {
    let t = target();
    let (a, b) = (t.seg("a").clone(), t.seg("b").clone());
    assert_ne!(a.base, 0);
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        for (seg, name) in [(&a, "a"), (&b, "b")] {
            for addr in [seg.base, seg.base + 4096, seg.base + seg.len - 1] {
                let r = peer.open_at(addr, seg.token).await.unwrap();
                assert_eq!(
                    (r.name(), r.id(), r.base(), r.len()),
                    (name, seg.id, seg.base, seg.len)
                );
            }
        }
        let r = peer.open_at(b.base + 4096, b.token).await.unwrap();
        let off = b.base + 4096 - r.base();
        let (res, _) = r.write(off, pattern(512, 3), 1).await;
        assert_eq!(res.unwrap(), 512);
        assert_eq!(t.snapshot("b", 4096, 512), pattern(512, 3));
        assert!(t.snapshot("a", 0, 1 << 20).iter().all(|&x| x == 0));
    });
}

/// An address in no segment, one past a segment's end, and a right address
/// with another segment's token are refused alike (`OpenRefused`), so the
/// answer does not say where memory is.
#[test]
fn addresses_outside_every_segment_and_wrong_tokens_are_refused_alike() {
    let t = target();
    let (a, b) = (t.seg("a").clone(), t.seg("b").clone());
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let outside = [a.base + a.len, 1, u64::MAX]
            .into_iter()
            .filter(|&x| !(b.base..b.base + b.len).contains(&x));
        for addr in outside {
            let r = peer.open_at(addr, a.token).await.err();
            assert!(
                matches!(r, Some(TransferError::OpenRefused(_))),
                "{addr:#x}: {r:?}"
            );
        }
        let r = peer.open_at(a.base, b.token).await.err();
        assert!(matches!(r, Some(TransferError::OpenRefused(_))), "{r:?}");
        let r = peer.open_at(a.base, Token::random()).await.err();
        assert!(matches!(r, Some(TransferError::OpenRefused(_))), "{r:?}");
    });
    // On the wire: the same status, and no descriptor.
    let mut c = RawClient::connect(t.addr);
    for (seg, token) in [
        (SegmentRef::Address(a.base + a.len + (1 << 30)), a.token),
        (SegmentRef::Address(a.base), b.token),
    ] {
        let ack = c.auth_ref(seg, token);
        assert_eq!(ack.results, vec![(Status::Forbidden, None)]);
    }
    let ack = c.auth_ref(SegmentRef::Address(a.base + 1), a.token);
    assert_eq!(ack.results[0].0, Status::Ok);
    assert_eq!(ack.results[0].1.as_ref().map(|d| d.base), Some(a.base));
}

/// A cluster that shares a secret derives the same token everywhere
/// (HMAC-SHA256(secret, "quiesce-token-v1" ‖ label), first 16 bytes, as
/// computed independently here): a target registers with it and a peer that
/// holds the secret opens by address; one with another secret is refused.
#[test]
fn tokens_derived_from_a_shared_secret_open_and_others_do_not() {
    let secret = b"sixteen+ random bytes, shared";
    let derived = Token::derive(secret, "node");
    let expect = hmac(secret, &[b"quiesce-token-v1", b"node"]);
    let hex: String = expect[..16].iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(derived.to_string(), hex);
    assert_ne!(Token::derive(secret, "other"), derived);
    assert_ne!(Token::derive(b"another secret", "node"), derived);
    Runtime::new().unwrap().block_on(async {
        let target = Engine::bind(tcp()).unwrap();
        let seg = target
            .register_with_token(
                "0x1000",
                vec![0u8; 8192],
                Rights::READ | Rights::WRITE,
                derived,
            )
            .unwrap();
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(target.local_addr()).await.unwrap();
        let wrong = Token::derive(b"another secret", "node");
        let r = peer.open_at(seg.base() + 100, wrong).await.err();
        assert!(matches!(r, Some(TransferError::OpenRefused(_))), "{r:?}");
        let r = peer
            .open_at(seg.base() + 100, Token::derive(secret, "node"))
            .await
            .unwrap();
        let (res, _) = r.write(100, vec![5u8; 10], 1).await;
        assert_eq!(res.unwrap(), 10);
        let mut b = [0u8; 10];
        assert!(seg.read_at(100, &mut b));
        assert_eq!(b, [5u8; 10]);
    });
}

/// `SegmentRef::First` opens the segment registered first among the live
/// ones that the token opens (Mooncake's `get_first_buffer_address`): with
/// "a"'s token "a" while it lives; with "b"'s, "b" even while the older "a"
/// lives (nothing is learnt about a segment the token does not open);
/// nothing once the token's segments are gone — and on the wire a refusal
/// looks like any other.
#[test]
fn the_first_registered_segment_the_token_opens_opens_by_first() {
    let t = target();
    let (a, b) = (t.seg("a").clone(), t.seg("b").clone());
    assert!(a.id < b.id, "a was registered first");
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let r = peer.open_first(a.token).await.unwrap();
        assert_eq!(
            (r.name(), r.id(), r.base(), r.len()),
            ("a", a.id, a.base, a.len)
        );
        let r = peer.open_first(b.token).await.unwrap();
        assert_eq!((r.name(), r.base()), ("b", b.base));
        let r = peer.open_first(Token::random()).await.err();
        assert!(matches!(r, Some(TransferError::OpenRefused(_))), "{r:?}");
    });
    assert!(t.deregister("a"));
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let r = peer.open_first(a.token).await.err();
        assert!(matches!(r, Some(TransferError::OpenRefused(_))), "{r:?}");
    });
    assert!(t.deregister("b"));
    let mut c = RawClient::connect(t.addr);
    let ack = c.auth_ref(SegmentRef::First, b.token);
    assert_eq!(ack.results, vec![(Status::Forbidden, None)]);
}

/// Segments may overlap (a caller registers a range, then a sub-range of
/// it, as Mooncake callers do). An address inside both opens the one whose
/// token the proof shows, whichever was registered first: the inner
/// segment with its own token, the outer with the outer's, and a token of
/// neither opens nothing.
#[test]
fn an_address_in_overlapping_segments_opens_the_one_the_token_proves() {
    let mut owned = vec![0u8; 64 << 10].into_boxed_slice();
    let ptr = owned.as_mut_ptr();
    Runtime::new().unwrap().block_on(async {
        let target = Engine::bind(tcp()).unwrap();
        let rw = Rights::READ | Rights::WRITE;
        // SAFETY: `owned` outlives `block_on`, which drops the engine (and
        // with it both lendings); only the engine writes it meanwhile.
        let (outer, inner) = unsafe {
            (
                ForeignMemory::new(ptr, 64 << 10, || {}),
                ForeignMemory::new(ptr.add(16 << 10), 4096, || {}),
            )
        };
        let outer = target.register("outer", outer, rw).unwrap();
        let inner = target.register("inner", inner, rw).unwrap();
        assert!(outer.id() < inner.id());
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(target.local_addr()).await.unwrap();
        let at = inner.base() + 100;
        let r = peer.open_at(at, inner.token()).await.unwrap();
        assert_eq!((r.name(), r.base(), r.len()), ("inner", inner.base(), 4096));
        let r = peer.open_at(at, outer.token()).await.unwrap();
        assert_eq!((r.name(), r.base()), ("outer", outer.base()));
        let r = peer.open_at(at, Token::random()).await.err();
        assert!(matches!(r, Some(TransferError::OpenRefused(_))), "{r:?}");
        // Outside the inner segment its token opens nothing.
        let r = peer.open_at(outer.base(), inner.token()).await.err();
        assert!(matches!(r, Some(TransferError::OpenRefused(_))), "{r:?}");
    });
    drop(owned);
}

/// Overlapping segments that share one token (as the Mooncake drop-in
/// registers every range): an address inside several opens the one that
/// reaches furthest, whichever was registered first, so a transfer from
/// that address that fits any of them fits it.
#[test]
fn an_address_in_overlapping_segments_of_one_token_opens_the_one_reaching_furthest() {
    let mut owned = vec![0u8; 64 << 10].into_boxed_slice();
    let ptr = owned.as_mut_ptr();
    Runtime::new().unwrap().block_on(async {
        let target = Engine::bind(tcp()).unwrap();
        let rw = Rights::READ | Rights::WRITE;
        let token = Token::derive(b"one secret for every range", "node");
        // SAFETY: `owned` outlives `block_on`, which drops the engine (and
        // with it every lending); only the engine writes it meanwhile.
        let [inner, outer, tail] = unsafe {
            [
                ForeignMemory::new(ptr.add(16 << 10), 4096, || {}),
                ForeignMemory::new(ptr, 32 << 10, || {}),
                ForeignMemory::new(ptr.add(8 << 10), 8 << 10, || {}),
            ]
        };
        let inner = target
            .register_with_token("inner", inner, rw, token)
            .unwrap();
        let outer = target
            .register_with_token("outer", outer, rw, token)
            .unwrap();
        let _tail = target.register_with_token("tail", tail, rw, token).unwrap();
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(target.local_addr()).await.unwrap();
        let at = inner.base() + 100;
        let r = peer.open_at(at, token).await.unwrap();
        assert_eq!((r.name(), r.base()), ("outer", outer.base()));
        let (res, _) = r.write(at - r.base(), pattern(8192, 6), 1).await;
        assert_eq!(res.unwrap(), 8192, "8 KiB from inside the inner range");
        // Where the shorter ones end first, the longest still wins.
        let r = peer.open_at(outer.base() + (9 << 10), token).await.unwrap();
        assert_eq!(r.name(), "outer");
    });
    drop(owned);
}

/// A proof by address tries every segment holding the address, so one
/// `Auth` of many such proofs into deeply overlapping segments would cost
/// the target that many HMACs each, from a peer that proved nothing. Past a
/// budget (two per proof, and one pass over every segment) the frame is
/// bad and the connection closed; one such proof is served.
#[test]
fn an_auth_of_many_proofs_into_overlapping_segments_is_a_bad_frame() {
    use quiesce_transports::wire::Opcode;
    const DEPTH: usize = 16;
    let mut owned = vec![0u8; 64 << 10].into_boxed_slice();
    let ptr = owned.as_mut_ptr();
    Runtime::new().unwrap().block_on(async {
        let target = Engine::bind(tcp()).unwrap();
        for i in 0..DEPTH {
            // SAFETY: `owned` outlives `block_on`, which drops the engine
            // (and with it every lending); only the engine writes it.
            let mem = unsafe { ForeignMemory::new(ptr.add(i * 1024), (64 - i) << 10, || {}) };
            target
                .register(&format!("s{i}"), mem, Rights::READ | Rights::WRITE)
                .unwrap();
        }
        let at = ptr as u64 + (32 << 10);
        let addr = target.local_addr();
        let peer = std::thread::spawn(move || {
            let mut c = RawClient::connect(addr);
            c.send_auth(&[(SegmentRef::Address(at), Token::random())]);
            let one = c.recv().map(|h| h.op);
            let mut c = RawClient::connect(addr);
            c.send_auth(&vec![(SegmentRef::Address(at), Token::random()); 64]);
            let many = c.recv();
            // (An AuthAck's payload is not a header: read on only after a Status.)
            let closed = many.is_some_and(|h| h.op == Opcode::Status) && c.recv().is_none();
            (one, many, closed)
        });
        while !peer.is_finished() {
            quiesce_runtime::time::sleep(Duration::from_millis(1)).await;
        }
        let (one, many, closed) = peer.join().unwrap();
        assert_eq!(one, Some(Opcode::AuthAck), "one proof by address is served");
        let many = many.expect("an answer");
        assert_eq!(
            (many.op, many.status()),
            (Opcode::Status, Ok(Status::BadFrame)),
            "{many:?}"
        );
        assert!(closed, "the connection stayed open");
    });
    drop(owned);
}

/// Proofs by address or by name find their segments by an index: one
/// `Auth` from a peer that proved nothing, of 3,500 proofs naming no
/// segment (about as many as an `Auth` of 256 KiB holds), costs about what
/// as many proofs by id cost (the same HMACs),
/// however many segments the target serves. Each walked every segment
/// served, a cost the HMAC budget did not count: with 20,000 segments, one
/// frame held the reactor for 3,500 × 20,000 comparisons — and so did one
/// long segment, when the lookup was bounded by the longest length alone.
#[test]
fn proofs_by_address_or_name_cost_no_walk_over_every_segment() {
    const SEGMENTS: usize = 20_000;
    let names: Vec<String> = (0..SEGMENTS).map(|i| format!("s{i}")).collect();
    let mut segs: Vec<(&str, usize, Rights)> = names
        .iter()
        .map(|n| (n.as_str(), 64, Rights::READ))
        .collect();
    // And one long segment: a lookup bounded by the longest length alone
    // read every short segment within 64 MiB below an address.
    segs.push(("long", 64 << 20, Rights::READ));
    let t = ShardTarget::start(tcp(), &segs);
    let long = t.seg("long").clone();
    // Just past the short segments (their bases lie within ~2 MiB of each
    // other): no segment holds these, and every short one lies below.
    let top = names.iter().map(|n| t.seg(n).base + 64).max().unwrap();
    let outside = |a: u64| a < long.base || a >= long.base + long.len;
    // The fastest of three answers: the machine's noise is slower, never
    // faster.
    let answer_time = |refs: &[(SegmentRef, Token)]| {
        (0..3)
            .map(|_| {
                let mut c = RawClient::connect(t.addr);
                let t0 = std::time::Instant::now();
                c.send_auth(refs);
                let h = c.recv().expect("an AuthAck");
                assert_eq!(h.op, quiesce_transports::wire::Opcode::AuthAck);
                t0.elapsed()
            })
            .min()
            .unwrap()
    };
    let proofs = |r: &dyn Fn(u64) -> SegmentRef| {
        (0..3500u64)
            .map(|i| (r(i), Token::random()))
            .collect::<Vec<_>>()
    };
    let by_id = answer_time(&proofs(&|i| SegmentRef::Id(1 << 40 | i)));
    let by_address = answer_time(&proofs(&|i| {
        assert!(outside(top + i));
        SegmentRef::Address(top + i)
    }));
    let by_name = answer_time(&proofs(&|i| SegmentRef::Name(format!("x{i}"))));
    assert!(
        by_address < 5 * by_id && by_name < 5 * by_id,
        "3,500 proofs answered in {by_id:?} by id, {by_address:?} by address, {by_name:?} by name"
    );
}
