//! Hostile proofs and fences: malformed auths, First proofs that cost the
//! target work, fences of sessions a peer does not own, and the caps on
//! connections and fence entries.

use super::*;

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

/// The budget of refused proofs is the target's too, not only each
/// connection's: a peer that reconnects after every close (up to the
/// target's connection cap at once) got a fresh one each time, about 1,300
/// HMACs per connection of ~700 bytes sent against 256 segments.
#[test]
fn reconnecting_does_not_renew_the_budget_of_refused_first_proofs() {
    let ((acks, took), checks) = against_256_segments(
        |_| Token::random(),
        |addr| {
            let t0 = Instant::now();
            let acks = (0..50).map(|_| refused_firsts(addr, 8)).sum::<usize>();
            (acks, t0.elapsed())
        },
    );
    // The target's budget (16 connections' First budgets, 64 + 4 x 256
    // HMACs each), what it refilled meanwhile (all of it per 10 s), and
    // the frame that went past it.
    let budget = 16 * (64 + 4 * 256) as u64;
    let refilled = (budget as f64 * took.as_secs_f64() / 10.0).ceil() as u64;
    assert!(
        checks <= budget + refilled + 257,
        "{checks} proof checks over 50 connections in {took:?} ({acks} refusals answered)"
    );
}

/// A well-formed `Auth` whose answer would not fit a frame (4,096 proofs
/// of one segment with a long name: a descriptor each, past 256 KiB) is
/// refused with a status, as every refused frame is, before the close:
/// the connection was closed with no answer at all.
#[test]
fn an_auth_whose_answer_is_too_large_is_answered_bad_frame() {
    use quiesce_transports::wire::{Opcode, SegmentRef, Status};
    use quiesce_transports::Rights;
    let name = "a-segment-whose-name-is-long-enough-to-matter";
    let t = ShardTarget::start(tcp(), &[(name, 4096, Rights::READ | Rights::WRITE)]);
    let (id, token) = (t.seg(name).id, t.seg(name).token);
    let mut c = RawClient::connect(t.addr);
    // As many proofs as a request of 256 KiB holds (65 bytes each); their
    // descriptors (~120 bytes each) are more than an answer may be.
    c.send_auth(&vec![(SegmentRef::Id(id), token); 3500]);
    let h = c.recv().expect("an answer before the close");
    assert_eq!(h.op, Opcode::Status, "{h:?}");
    assert_eq!(h.status(), Ok(Status::BadFrame));
}

/// An honest reconnect to a target that restarted re-proves every segment
/// it had opened, 512 per `Auth` (`tcp::peer::REPROVE_CHUNK`), every one
/// refused now (their ids are gone): each answer comes, and the connection
/// stays for the opens after them. A budget of refused proofs of every
/// kind closed it (at the first chunk, then at the third), and every later
/// reconnect alike.
#[test]
fn a_reconnect_re_proving_many_stale_segments_keeps_its_connection() {
    use quiesce_transports::wire::{Opcode, SegmentRef, Status};
    use quiesce_transports::Rights;
    let t = ShardTarget::start(tcp(), &[("kv", 4096, Rights::READ | Rights::WRITE)]);
    let (id, token) = (t.seg("kv").id, t.seg("kv").token);
    let mut c = RawClient::connect(t.addr);
    for chunk in 0..3u64 {
        let stale: Vec<_> = (0..512u64)
            .map(|i| (SegmentRef::Id((1 << 40) | chunk << 20 | i), Token::random()))
            .collect();
        c.send_auth(&stale);
        let h = c.recv().expect("an answer");
        assert_eq!(
            h.op,
            Opcode::AuthAck,
            "chunk {chunk} was not answered: {h:?}"
        );
        let mut payload = vec![0u8; h.length as usize];
        std::io::Read::read_exact(&mut c.s, &mut payload).unwrap();
    }
    assert_eq!(
        c.auth_status(id, token),
        Status::Ok,
        "an open after the re-proof"
    );
}
