//! Stateful: sequences of steps over up to four connections against one live
//! engine (its own thread, io_uring or epoll). The harness knows the token of
//! segment "pub", so inputs can authenticate and reach every served state,
//! and never that of "kv". After each input — every connection closed and
//! served to its end — it checks what an unauthenticated peer must never
//! change:
//!
//! * "kv" is all zero: no input can prove its token;
//! * "pub" changed only if a connection the target had acknowledged a proof
//!   on sent a `Write`;
//! * the fence table's peak grew by at most the `Fence`s and `Write`s (a
//!   write in flight has an entry) sent on such connections, and the session
//!   count's peak by at most the connections that authenticated;
//! * the engine never panics (the hook aborts, which libFuzzer reports).
#![no_main]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use quiesce_transports::wire::{
    AuthAck, AuthRequest, GrantReceipt, Header, Hello, HelloAck, Opcode, SegmentRef, Status,
    HEADER_LEN, VERSION,
};
use quiesce_transports::{Rights, Token};

#[path = "live_engine.rs"]
mod live_engine;

const CONNS: usize = 4;
/// Every opcode (invalid ones come through `Step::Raw`).
const OPS: [Opcode; 13] = [
    Opcode::Write,
    Opcode::Fence,
    Opcode::Read,
    Opcode::Forget,
    Opcode::QpConnect,
    Opcode::Hello,
    Opcode::Auth,
    Opcode::HelloAck,
    Opcode::AuthAck,
    Opcode::QpAccept,
    Opcode::Status,
    Opcode::ReadData,
    Opcode::FenceAck,
];
const SEG_LEN: usize = 4096;

/// What the engine thread reports between inputs.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    kv_zero: bool,
    pub_sum: u64,
    connections: u64,
    fences: u64,
    sessions: u64,
    peak_fences: u64,
    peak_sessions: u64,
}

struct Target {
    addr: SocketAddr,
    ids: (u64, u64),
    /// The segments' addresses at the target.
    bases: (u64, u64),
    pub_token: Token,
    ask: mpsc::SyncSender<mpsc::SyncSender<Snapshot>>,
}

fn target() -> &'static Target {
    static T: OnceLock<Target> = OnceLock::new();
    T.get_or_init(|| {
        let (tx, rx) = mpsc::channel();
        let (ask_tx, ask_rx) = mpsc::sync_channel::<mpsc::SyncSender<Snapshot>>(1);
        live_engine::spawn(move |engine| async move {
            let rw = Rights::READ | Rights::WRITE;
            let kv = engine.register("kv", vec![0u8; SEG_LEN], rw).unwrap();
            let public = engine.register("pub", vec![0u8; SEG_LEN], rw).unwrap();
            let ids = ((kv.id(), public.id()), (kv.base(), public.base()));
            tx.send((engine.local_addr(), ids, public.token())).unwrap();
            let (mut peak_fences, mut peak_sessions) = (0, 0);
            let mut buf = vec![0u8; SEG_LEN];
            loop {
                let s = engine.stats();
                peak_fences = peak_fences.max(s.fence_entries);
                peak_sessions = peak_sessions.max(s.sessions);
                if let Ok(reply) = ask_rx.try_recv() {
                    kv.read_at(0, &mut buf);
                    let kv_zero = buf.iter().all(|&b| b == 0);
                    public.read_at(0, &mut buf);
                    let pub_sum = buf.iter().enumerate().fold(0u64, |a, (i, &b)| {
                        a.wrapping_mul(31).wrapping_add(b as u64 ^ i as u64)
                    });
                    let _ = reply.send(Snapshot {
                        kv_zero,
                        pub_sum,
                        connections: s.connections,
                        fences: s.fence_entries,
                        sessions: s.sessions,
                        peak_fences,
                        peak_sessions,
                    });
                    (peak_fences, peak_sessions) = (s.fence_entries, s.sessions);
                }
                quiesce_runtime::time::sleep(Duration::from_micros(100)).await;
            }
        });
        let (addr, (ids, bases), pub_token) = rx.recv().unwrap();
        Target {
            addr,
            ids,
            bases,
            pub_token,
            ask: ask_tx,
        }
    })
}

fn snapshot(t: &Target) -> Snapshot {
    let (tx, rx) = mpsc::sync_channel(1);
    t.ask.send(tx).unwrap();
    rx.recv().unwrap()
}

/// Which segment a step names.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Seg {
    Kv,
    Pub,
    Other(u64),
}

/// How a proof names "pub".
#[derive(Arbitrary, Debug, Clone, Copy)]
enum By {
    Id,
    Name,
    Address { at: u64 },
    /// The first registered segment "pub"'s token opens: "pub", never "kv".
    First,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// Opens connection `conn` (closing what was there) and says hello: in
    /// a new session, or asking to join connection `join`'s session.
    Hello {
        conn: u8,
        join: Option<u8>,
        nonce: [u8; 16],
    },
    /// A valid proof of "pub"'s token (by id, by name, or by an address
    /// `base + at % 2·len`: inside it or not), with a join proof from the
    /// input (the harness never knows a session's key).
    AuthPub { conn: u8, by: By, join: [u8; 32] },
    /// A proof from the input, for any segment.
    AuthForged {
        conn: u8,
        seg: Seg,
        proof: [u8; 32],
        join: [u8; 32],
    },
    /// Any frame: header fields and payload from the input.
    Frame {
        conn: u8,
        op: u8,
        flags: u8,
        batch: u64,
        seg: Seg,
        offset: u64,
        /// The header's length field (`None`: the payload's).
        length: Option<u16>,
        /// The payload: `len % 4097` bytes of `fill` (any bytes come
        /// through `Step::Raw`).
        fill: u8,
        len: u16,
    },
    /// Raw bytes.
    Raw { conn: u8, bytes: Vec<u8> },
    /// Reads what the target sent so far.
    Drain { conn: u8 },
    /// Closes the connection.
    Close { conn: u8 },
}

struct Conn {
    s: TcpStream,
    /// From the HelloAck, once read.
    ack: Option<HelloAck>,
    nonce: [u8; 16],
    /// The target acknowledged a proof on this connection.
    authenticated: bool,
    /// Whether this connection asked for a new session.
    creates: bool,
}

#[derive(Default)]
struct Tally {
    authed_writes: u64,
    authed_fences: u64,
    authed_sessions: u64,
}

fn send(c: &mut Conn, h: &Header, payload: &[u8]) {
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    let _ = c.s.write_all(&v);
}

/// The next frame, if one comes within the read timeout.
fn recv(c: &mut Conn) -> Option<(Header, Vec<u8>)> {
    let mut b = [0u8; HEADER_LEN];
    c.s.read_exact(&mut b).ok()?;
    let h = Header::decode(&b).ok()?;
    let mut p = vec![0u8; (h.length as usize).min(1 << 20)];
    if matches!(
        h.op,
        Opcode::HelloAck | Opcode::AuthAck | Opcode::QpAccept | Opcode::ReadData
    ) {
        c.s.read_exact(&mut p).ok()?;
    }
    Some((h, p))
}

fn seg_id(t: &Target, s: Seg) -> u64 {
    match s {
        Seg::Kv => t.ids.0,
        Seg::Pub => t.ids.1,
        Seg::Other(x) => x,
    }
}

fn auth(c: &mut Conn, tally: &mut Tally, seg: SegmentRef, proof: [u8; 32], join: [u8; 32]) {
    let p = AuthRequest {
        join,
        proofs: vec![(seg, proof, GrantReceipt::NONE)],
    }
    .encode()
    .unwrap();
    send(
        c,
        &Header {
            length: p.len() as u64,
            ..Header::new(Opcode::Auth)
        },
        &p,
    );
    // Frames sent before may be answered first: skip to the AuthAck.
    while let Some((h, p)) = recv(c) {
        if h.op == Opcode::AuthAck {
            if let Ok(a) = AuthAck::decode(&p) {
                if a.results.first().is_some_and(|r| r.0 == Status::Ok) {
                    if !c.authenticated && c.creates {
                        tally.authed_sessions += 1;
                    }
                    c.authenticated = true;
                }
            }
            return;
        }
    }
}

fn run(t: &Target, steps: Vec<Step>) {
    let mut conns: Vec<Option<Conn>> = (0..CONNS).map(|_| None).collect();
    let mut tally = Tally::default();
    for step in steps.into_iter().take(32) {
        match step {
            Step::Hello { conn, join, nonce } => {
                let Ok(s) = TcpStream::connect(t.addr) else {
                    continue;
                };
                s.set_read_timeout(Some(Duration::from_millis(300)))
                    .unwrap();
                let session = join
                    .and_then(|j| conns[j as usize % CONNS].as_ref())
                    .and_then(|c| c.ack.as_ref())
                    .map_or(0, |a| a.session);
                let mut c = Conn {
                    s,
                    ack: None,
                    nonce,
                    authenticated: false,
                    creates: true,
                };
                let hello = Hello {
                    version_min: VERSION,
                    version_max: VERSION,
                    session,
                    shards: 1,
                    nonce,
                    node: "fuzz".into(),
                }
                .encode()
                .unwrap();
                send(
                    &mut c,
                    &Header {
                        length: hello.len() as u64,
                        ..Header::new(Opcode::Hello)
                    },
                    &hello,
                );
                if let Some((h, p)) = recv(&mut c) {
                    if h.op == Opcode::HelloAck {
                        c.ack = HelloAck::decode(&p).ok();
                        // No key: the target is letting it join a session.
                        c.creates = c.ack.as_ref().is_some_and(|a| a.session_key != [0; 16]);
                    }
                }
                conns[conn as usize % CONNS] = Some(c);
            }
            Step::AuthPub { conn, by, join } => {
                let Some(c) = conns[conn as usize % CONNS].as_mut() else {
                    continue;
                };
                let Some(ack) = c.ack.as_ref() else { continue };
                let seg = match by {
                    By::Name => SegmentRef::Name("pub".into()),
                    By::Id => SegmentRef::Id(t.ids.1),
                    By::Address { at } => {
                        SegmentRef::Address(t.bases.1.wrapping_add(at % (2 * SEG_LEN as u64)))
                    }
                    By::First => SegmentRef::First,
                };
                let proof = t.pub_token.prove(&ack.nonce, &c.nonce, ack.session, &seg);
                auth(c, &mut tally, seg, proof, join);
            }
            Step::AuthForged {
                conn,
                seg,
                proof,
                join,
            } => {
                let Some(c) = conns[conn as usize % CONNS].as_mut() else {
                    continue;
                };
                // "kv" by name, by its address or as the first registered;
                // others by id.
                let r = match seg {
                    Seg::Kv if proof[0] & 3 == 2 => SegmentRef::First,
                    Seg::Kv if proof[0] & 1 == 0 => SegmentRef::Name("kv".into()),
                    Seg::Kv => SegmentRef::Address(t.bases.0 + proof[1] as u64),
                    s => SegmentRef::Id(seg_id(t, s)),
                };
                auth(c, &mut tally, r, proof, join);
            }
            Step::Frame {
                conn,
                op,
                flags,
                batch,
                seg,
                offset,
                length,
                fill,
                len,
            } => {
                let payload = vec![fill; len as usize % (SEG_LEN + 1)];
                let Some(c) = conns[conn as usize % CONNS].as_mut() else {
                    continue;
                };
                let op = OPS[op as usize % OPS.len()];
                if c.authenticated {
                    tally.authed_writes += (op == Opcode::Write) as u64;
                    tally.authed_fences += (op == Opcode::Fence) as u64;
                }
                let h = Header {
                    op,
                    flags,
                    batch,
                    task: 0,
                    segment: seg_id(t, seg),
                    offset: offset % (2 * SEG_LEN as u64),
                    length: length.map_or(payload.len() as u64, u64::from),
                };
                send(c, &h, &payload);
            }
            Step::Raw { conn, bytes } => {
                if let Some(c) = conns[conn as usize % CONNS].as_mut() {
                    let _ = c.s.write_all(&bytes);
                    // Raw bytes may complete a frame of any kind.
                    if c.authenticated {
                        tally.authed_writes += 1;
                        tally.authed_fences += 1 + bytes.len() as u64 / HEADER_LEN as u64;
                    }
                }
            }
            Step::Drain { conn } => {
                if let Some(c) = conns[conn as usize % CONNS].as_mut() {
                    c.s.set_nonblocking(true).unwrap();
                    let mut sink = [0u8; 4096];
                    while let Ok(n) = c.s.read(&mut sink) {
                        if n == 0 {
                            break;
                        }
                    }
                    c.s.set_nonblocking(false).unwrap();
                }
            }
            Step::Close { conn } => conns[conn as usize % CONNS] = None,
        }
    }
    drop(conns);
    if std::env::var_os("QUIESCE_FUZZ_TRACE").is_some() {
        eprintln!(
            "authed: sessions {} writes {} fences {}",
            tally.authed_sessions, tally.authed_writes, tally.authed_fences
        );
    }
    check(t, &tally);
}

fn check(t: &Target, tally: &Tally) {
    // Every connection served to its end (the target saw each close).
    // Each snapshot resets the peaks: keep the highest.
    let deadline = Instant::now() + Duration::from_secs(5);
    let (mut peak_fences, mut peak_sessions) = (0, 0);
    let mut after = loop {
        let s = snapshot(t);
        peak_fences = peak_fences.max(s.peak_fences);
        peak_sessions = peak_sessions.max(s.peak_sessions);
        if s.connections == 0 || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    (after.peak_fences, after.peak_sessions) = (peak_fences, peak_sessions);
    assert_eq!(after.connections, 0, "connections still served: {after:?}");
    assert!(after.kv_zero, "kv was written without its token");
    BEFORE.with(|b| {
        let before = b.get();
        if tally.authed_writes == 0 {
            assert_eq!(
                after.pub_sum, before.pub_sum,
                "pub was written unauthenticated"
            );
        }
        assert!(
            after.peak_fences <= before.fences + tally.authed_fences + tally.authed_writes,
            "fence entries grew without an authenticated fence: {before:?} → {after:?}"
        );
        assert!(
            after.peak_sessions <= before.sessions + tally.authed_sessions,
            "sessions grew without an authentication: {before:?} → {after:?}"
        );
    });
}

thread_local! {
    static BEFORE: std::cell::Cell<Snapshot> = std::cell::Cell::new(snapshot(target()));
}

/// Before any input: a scripted honest sequence must change "pub", or the
/// harness cannot reach authenticated states and its checks would be empty.
fn self_test(t: &Target) {
    let before = snapshot(t);
    let frame = |seg| Step::Frame {
        conn: 0,
        op: 0,
        flags: 0,
        batch: 1,
        seg,
        offset: 0,
        length: None,
        fill: 7,
        len: 64,
    };
    let steps = vec![
        Step::Hello {
            conn: 0,
            join: None,
            nonce: [1; 16],
        },
        Step::AuthPub {
            conn: 0,
            by: By::Address { at: 10 },
            join: [0; 32],
        },
        frame(Seg::Pub),
        frame(Seg::Kv),
    ];
    BEFORE.with(|b| b.set(before));
    run(t, steps);
    assert_ne!(
        snapshot(t).pub_sum,
        before.pub_sum,
        "the harness's write did not land"
    );
}

fuzz_target!(|steps: Vec<Step>| {
    let t = target();
    static SELF_TEST: std::sync::Once = std::sync::Once::new();
    SELF_TEST.call_once(|| self_test(t));
    // The state this input starts from (and its peaks reset).
    BEFORE.with(|b| b.set(snapshot(t)));
    run(t, steps);
});
