//! The sync API's pointer-addressed memory (what the Python binding's
//! Mooncake-compatible `register_memory`/`unregister_memory` and
//! peer-address transfers use): one engine lends caller memory, another
//! opens it by an address inside it and writes; taking the memory back
//! waits until nothing can touch it.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{Direction, SyncEngine, SyncError, SyncTask};
use quiesce_batch::{BatchOptions, SYNC_OK};
use quiesce_transports::wire::{
    AuthRequest, GrantReceipt, Header, Hello, HelloAck, Opcode, SegmentRef, VERSION,
};
use quiesce_transports::{EngineConfig, Token};

const LEN: usize = 1 << 20;

#[path = "sync_memory/host.rs"]
mod host;

fn engine() -> SyncEngine {
    SyncEngine::start(EngineConfig::default()).unwrap()
}

/// A target lending `mem` (LEN bytes at `base`) as segment "m", and an
/// initiator; the test keeps `mem` until its last `reclaim` answered true.
struct Lent {
    target: SyncEngine,
    init: SyncEngine,
    token: Token,
    mem: Box<[u8]>,
    base: u64,
}

fn lent() -> Lent {
    let target = engine();
    let token = Token::derive(b"a secret both sides hold", "node");
    let mut mem = vec![0u8; LEN].into_boxed_slice();
    let base = mem.as_mut_ptr() as u64;
    // SAFETY: the box's heap memory does not move when it is returned; the
    // caller keeps it until `reclaim` answered true (or the engine stopped).
    unsafe { target.lend("m", base, LEN as u64, token).unwrap() };
    Lent {
        target,
        init: engine(),
        token,
        mem,
        base,
    }
}

/// Writes land in the lent memory at the offset the peer address names, and
/// reclaiming it answers `true` once nothing holds it.
#[test]
fn lent_memory_is_written_by_peer_address_and_reclaimed() {
    let Lent {
        target,
        init,
        token,
        mem,
        base,
    } = lent();
    let at = init
        .open_at(target.local_addr(), base + 8192, token)
        .unwrap();
    assert_eq!((at.base, at.len), (base, LEN as u64));
    let mut src = vec![0x5au8; 4096];
    // SAFETY: `src` outlives the batch (its outcome is 0 or -1 below).
    let buf = unsafe { RawBuf::new(src.as_mut_ptr(), src.len()) };
    let out = init
        .batch(
            Direction::Write,
            vec![SyncTask {
                segment: at.segment,
                offset: base + 8192 - at.base,
                buf,
            }],
            BatchOptions::default(),
        )
        .unwrap();
    assert_eq!(out.code, SYNC_OK);
    assert_eq!(target.reclaim(base, Duration::from_secs(5)), Ok(true));
    assert!(mem[8192..8192 + 4096].iter().all(|&b| b == 0x5a));
    assert!(mem[..8192].iter().all(|&b| b == 0));
    assert_eq!(
        target.reclaim(base, Duration::from_secs(1)),
        Err(SyncError::NotLent(base))
    );
    // A wrong secret opens nothing.
    let wrong = Token::derive(b"another secret", "node");
    assert!(init.open_at(target.local_addr(), base, wrong).is_err());
}

/// Writes 4 KiB of `fill` at offset 0 of `segment` (5 s deadline); the code.
fn write_4k_at_0(init: &SyncEngine, segment: u32, fill: u8) -> i32 {
    let mut src = vec![fill; 4096];
    // SAFETY: `src` outlives the batch (its outcome is final below).
    let buf = unsafe { RawBuf::new(src.as_mut_ptr(), src.len()) };
    let task = SyncTask {
        segment,
        offset: 0,
        buf,
    };
    let opts = BatchOptions::default().deadline(Duration::from_secs(5));
    init.batch(Direction::Write, vec![task], opts).unwrap().code
}

/// Opening a segment this engine already opened (by address again after a
/// failed batch, or `get_first_buffer_address` on every call) gives back
/// its handle: the engine's table grows with the segments peers serve, not
/// with how often they are opened. Memory lent again at the same address is
/// another segment, with a handle of its own, and the old handle fails.
#[test]
fn opening_a_segment_again_reuses_its_handle() {
    let Lent {
        target,
        init,
        token,
        mem,
        base,
    } = lent();
    let peer = target.local_addr();
    let first = init.open_at(peer, base, token).unwrap();
    for i in 0..200u64 {
        let again = init.open_at(peer, base + i * 4096, token).unwrap();
        assert_eq!(again, first, "open {i} by address made a new handle");
        assert_eq!(init.open_first(peer, token).unwrap(), first);
        assert_eq!(init.open_named(peer, "m", token).unwrap(), first);
    }
    let write = |segment: u32| write_4k_at_0(&init, segment, 0x5a);
    assert_eq!(write(first.segment), SYNC_OK);
    // The same address lent again: a new segment, a new handle.
    assert_eq!(target.reclaim(base, Duration::from_secs(5)), Ok(true));
    // SAFETY: as above.
    unsafe { target.lend("m", base, LEN as u64, token).unwrap() };
    let second = init.open_at(peer, base, token).unwrap();
    assert_ne!(second.segment, first.segment);
    assert_ne!(write(first.segment), SYNC_OK, "the old segment is gone");
    assert_eq!(write_4k_at_0(&init, second.segment, 0x6b), SYNC_OK);
    assert_eq!(init.open_at(peer, base, token).unwrap(), second);
    assert_eq!(target.reclaim(base, Duration::from_secs(5)), Ok(true));
    assert!(mem[..4096].iter().all(|&b| b == 0x6b));
}

/// A peer that starts a write into lent memory and stalls does not keep it:
/// reclaim revokes the range, the landing write is cut, and the memory comes
/// back while the peer is still connected.
#[test]
fn reclaim_cuts_a_stalled_write_and_returns_the_memory() {
    let target = engine();
    let token = Token::derive(b"a secret both sides hold", "node");
    let mut mem = vec![0u8; LEN].into_boxed_slice();
    let base = mem.as_mut_ptr() as u64;
    // SAFETY: `mem` lives until after `reclaim` answered true below.
    let id = unsafe { target.lend("m", base, LEN as u64, token).unwrap() };
    let mut s = stalled_writer(target.local_addr(), id, token, base);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(target.reclaim(base, Duration::from_secs(5)), Ok(true));
    // Bytes the peer sends now go to scratch, never into `mem`.
    let _ = s.write_all(&[0xff; 4096]);
    std::thread::sleep(Duration::from_millis(50));
    assert!(mem[..1000].iter().all(|&b| b == 0x11), "the landed part");
    assert!(
        mem[1000..].iter().all(|&b| b == 0),
        "bytes after the reclaim landed"
    );
    drop(s);
}

/// While a peer's read still sends from the lent memory, reclaiming answers
/// `false` — to a second caller at the same time too — and the address
/// cannot be lent again; once the peer goes, the memory comes back.
#[test]
fn memory_a_read_still_sends_from_stays_lent_for_every_caller() {
    const BIG: usize = 32 << 20;
    let target = std::sync::Arc::new(engine());
    let token = Token::derive(b"a secret both sides hold", "node");
    let mut mem = vec![0u8; BIG].into_boxed_slice();
    let base = mem.as_mut_ptr() as u64;
    // SAFETY: `mem` lives until after `reclaim` answered true below.
    let id = unsafe { target.lend("m", base, BIG as u64, token).unwrap() };
    let s = stalled_reader(target.local_addr(), id, token, base, BIG as u64);
    std::thread::sleep(Duration::from_millis(100));
    let t2 = target.clone();
    let second = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        t2.reclaim(base, Duration::from_millis(10))
    });
    assert_eq!(target.reclaim(base, Duration::from_millis(500)), Ok(false));
    assert_eq!(
        second.join().unwrap(),
        Ok(false),
        "a second caller was told it is free"
    );
    // SAFETY: refused, so nothing is lent.
    let again = unsafe { target.lend("m2", base, BIG as u64, token) };
    assert_eq!(again, Err(SyncError::StillLent(base)));
    assert_eq!(target.reclaim(base, Duration::from_millis(100)), Ok(false));
    drop(s);
    assert_eq!(target.reclaim(base, Duration::from_secs(5)), Ok(true));
    // Lendable again once it came back.
    // SAFETY: `mem` lives until after the reclaim below.
    unsafe { target.lend("m3", base, BIG as u64, token).unwrap() };
    assert_eq!(target.reclaim(base, Duration::from_secs(5)), Ok(true));
    drop(mem);
}

/// Connects raw, proves `token` by address, and sends a 64 KiB write's
/// header with only its first 1000 bytes.
fn stalled_writer(addr: std::net::SocketAddr, id: u64, token: Token, base: u64) -> TcpStream {
    let mut s = authed(addr, token, base);
    let mut w = Header::new(Opcode::Write);
    (w.batch, w.task, w.segment, w.length) = (1, 1, id, 64 << 10);
    s.write_all(&[&w.encode()[..], &[0x11; 1000]].concat())
        .unwrap();
    s
}

/// Connects raw, proves `token` by address, and asks to read all `len`
/// bytes of segment `id` — then never reads them, so the target's send
/// stalls with the memory in it.
fn stalled_reader(
    addr: std::net::SocketAddr,
    id: u64,
    token: Token,
    base: u64,
    len: u64,
) -> TcpStream {
    let mut s = authed(addr, token, base);
    // Two halves: one frame may ask for at most 16 MiB.
    for (task, offset) in [(1, 0), (2, len / 2)] {
        let mut r = Header::new(Opcode::Read);
        (r.batch, r.task, r.segment, r.offset, r.length) = (1, task, id, offset, len / 2);
        s.write_all(&r.encode()).unwrap();
    }
    s
}

fn authed(addr: std::net::SocketAddr, token: Token, base: u64) -> TcpStream {
    use std::io::Read;
    let mut s = TcpStream::connect(addr).unwrap();
    let nonce = [3u8; 16];
    let hello = Hello {
        version_min: VERSION,
        version_max: VERSION,
        session: 0,
        shards: 1,
        nonce,
        node: "raw".into(),
    }
    .encode()
    .unwrap();
    let frame = |h: Header, p: &[u8]| [&h.encode()[..], p].concat();
    let mut head = Header::new(Opcode::Hello);
    head.length = hello.len() as u64;
    s.write_all(&frame(head, &hello)).unwrap();
    let mut h = [0u8; 48];
    s.read_exact(&mut h).unwrap();
    let h = Header::decode(&h).unwrap();
    let mut p = vec![0u8; h.length as usize];
    s.read_exact(&mut p).unwrap();
    let ack = HelloAck::decode(&p).unwrap();
    let seg = SegmentRef::Address(base);
    let proof = token.prove(&ack.nonce, &nonce, ack.session, &seg);
    let auth = AuthRequest {
        join: [0; 32],
        proofs: vec![(seg, proof, GrantReceipt::NONE)],
    }
    .encode()
    .unwrap();
    let mut head = Header::new(Opcode::Auth);
    head.length = auth.len() as u64;
    s.write_all(&frame(head, &auth)).unwrap();
    let mut h = [0u8; 48];
    s.read_exact(&mut h).unwrap();
    let h = Header::decode(&h).unwrap();
    let mut p = vec![0u8; h.length as usize];
    s.read_exact(&mut p).unwrap();
    s
}

/// An engine named `name` listening on `listen`.
fn node_at(name: &str, listen: std::net::SocketAddr) -> SyncEngine {
    SyncEngine::start(EngineConfig {
        node: name.into(),
        listen,
        ..EngineConfig::default()
    })
    .unwrap()
}

/// Lends `mem` (LEN bytes) on `e` as segment "m".
fn lend_m(e: &SyncEngine, mem: &mut [u8], token: Token) {
    // SAFETY: the tests keep `mem` past the engine (dropped first).
    unsafe { e.lend("m", mem.as_mut_ptr() as u64, LEN as u64, token) }.unwrap();
}

/// Another node answering at a peer's address — the peer restarted under
/// another name, or the address of a stale directory entry was taken — is
/// not that peer, even with a segment of the same name and token: the
/// initiator's reconnect refuses it rather than writing what was meant for
/// the node that went into the new one's memory.
#[test]
fn another_node_at_a_peers_address_gets_none_of_its_writes() {
    let token = Token::derive(b"a secret both sides hold", "node");
    let lend = |e: &SyncEngine, mem: &mut [u8]| lend_m(e, mem, token);
    let init = engine();
    let write = |segment: u32| write_4k_at_0(&init, segment, 0x5a);
    let mut gone_mem = vec![0u8; LEN];
    let gone = node_at("decode-3", "127.0.0.1:0".parse().unwrap());
    let addr = gone.local_addr();
    lend(&gone, &mut gone_mem);
    let seg = init.open_named(addr, "m", token).unwrap();
    assert_eq!(write(seg.segment), SYNC_OK);
    assert_eq!(init.peer_node(addr).unwrap(), "decode-3");
    drop(gone);
    let mut new_mem = vec![0u8; LEN];
    let other = node_at("decode-7", addr);
    lend(&other, &mut new_mem);
    assert_ne!(write(seg.segment), SYNC_OK, "a write reached another node");
    assert!(
        new_mem.iter().all(|&b| b == 0),
        "another node's memory was written"
    );
    drop(other);
}

/// The same for a caller lane: a thread's first small batch connects its
/// own lane, which must reach the node the engine opened the segment at,
/// not whichever answers there now. (Another node lending the same memory
/// under the same name and token has the same id, base and length: the
/// lane's check of those passed, and the write landed, answering 0.)
#[test]
fn a_lane_reaches_only_the_node_its_segment_was_opened_at() {
    let token = Token::derive(b"a secret both sides hold", "node");
    let lend = |e: &SyncEngine, mem: &mut [u8]| lend_m(e, mem, token);
    let init = std::sync::Arc::new(engine());
    let mut mem = vec![0u8; LEN];
    let gone = node_at("decode-3", "127.0.0.1:0".parse().unwrap());
    let addr = gone.local_addr();
    lend(&gone, &mut mem);
    let seg = init.open_named(addr, "m", token).unwrap();
    assert_eq!(write_4k_at_0(&init, seg.segment, 0x5a), SYNC_OK);
    drop(gone);
    let other = node_at("decode-7", addr);
    lend(&other, &mut mem);
    // A thread that never ran a batch: its lane connects now.
    let fresh = {
        let init = init.clone();
        std::thread::spawn(move || write_4k_at_0(&init, seg.segment, 0x6b))
            .join()
            .unwrap()
    };
    assert_ne!(fresh, SYNC_OK, "a lane's write reached another node");
    drop(other);
    assert!(
        mem[..4096].iter().all(|&b| b == 0x5a),
        "another node's memory was written"
    );
}

/// Opening the segment again at the node that now answers there gives a
/// handle of its own, which a thread's lane opens afresh: the same handle
/// came back (same peer address, id, base and length), and the lane kept
/// using the segment it had opened at the node that went, failing every
/// small batch on it for good.
#[test]
fn a_segment_opened_at_the_node_that_replaced_another_gets_its_own_handle() {
    let token = Token::derive(b"a secret both sides hold", "node");
    let lend = |e: &SyncEngine, mem: &mut [u8]| lend_m(e, mem, token);
    let init = engine();
    let mut mem = vec![0u8; LEN];
    let gone = node_at("decode-3", "127.0.0.1:0".parse().unwrap());
    let addr = gone.local_addr();
    lend(&gone, &mut mem);
    let old = init.open_named(addr, "m", token).unwrap();
    assert_eq!(write_4k_at_0(&init, old.segment, 0x5a), SYNC_OK);
    drop(gone);
    let other = node_at("decode-7", addr);
    lend(&other, &mut mem);
    let t0 = std::time::Instant::now();
    let new = loop {
        match init.open_named(addr, "m", token) {
            Ok(s) => break s,
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(10), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_ne!(
        new.segment, old.segment,
        "another node's segment, the same handle"
    );
    assert_eq!(write_4k_at_0(&init, new.segment, 0x6b), SYNC_OK);
    drop(other);
    assert!(mem[..4096].iter().all(|&b| b == 0x6b));
}

/// Taking back a lending by its segment takes back only that one: once it
/// went (another call took it back) and the address was lent anew, the new
/// lending is another thread's, refused here as not lent — and still
/// served.
#[test]
fn reclaiming_a_segment_leaves_a_newer_lending_of_its_address_alone() {
    let (target, init) = (engine(), engine());
    let token = Token::derive(b"a secret both sides hold", "node");
    let mut mem = vec![0u8; LEN].into_boxed_slice();
    let base = mem.as_mut_ptr() as u64;
    // SAFETY: as in `lent`.
    let old = unsafe { target.lend("m", base, LEN as u64, token).unwrap() };
    let peer = target.local_addr();
    let first = init.open_at(peer, base, token).unwrap().segment;
    assert_eq!(target.reclaim(base, Duration::from_secs(5)), Ok(true));
    // SAFETY: as in `lent`.
    let new = unsafe { target.lend("m", base, LEN as u64, token).unwrap() };
    assert_ne!(new, old);
    assert_eq!(
        target.reclaim_segment(base, old, Duration::from_secs(1)),
        Err(SyncError::NotLent(base))
    );
    let second = init.open_at(peer, base, token).unwrap().segment;
    assert_ne!(second, first);
    assert_eq!(
        write_4k_at_0(&init, second, 0x7c),
        SYNC_OK,
        "the new lending was taken"
    );
    assert_eq!(
        target.reclaim_segment(base, new, Duration::from_secs(5)),
        Ok(true)
    );
    assert!(mem[..4096].iter().all(|&b| b == 0x7c));
}

/// The same node restarted at the same address, lending other memory under
/// the same name (ids count per process, so the new one has the old one's
/// id too), is not the segment the initiator opened: its writes must not
/// land in the new memory at the old offsets. The reconnect re-proved the
/// segment by id and took the new process's for it.
#[test]
fn a_restarted_peer_gets_none_of_the_writes_meant_for_its_old_memory() {
    let token = Token::derive(b"a secret both sides hold", "node");
    let node = |listen| node_at("decode-3", listen);
    let lend = |e: &SyncEngine, mem: &mut [u8]| lend_m(e, mem, token);
    let init = engine();
    let write = |segment: u32| write_4k_at_0(&init, segment, 0x5a);
    let mut old_mem = vec![0u8; LEN];
    let old = node("127.0.0.1:0".parse().unwrap());
    let addr = old.local_addr();
    lend(&old, &mut old_mem);
    let seg = init.open_named(addr, "m", token).unwrap();
    assert_eq!(write(seg.segment), SYNC_OK);
    drop(old);
    let mut new_mem = vec![0u8; LEN];
    let restarted = node(addr);
    lend(&restarted, &mut new_mem);
    assert_ne!(
        new_mem.as_ptr(),
        old_mem.as_ptr(),
        "the new memory must lie elsewhere"
    );
    assert_ne!(
        write(seg.segment),
        SYNC_OK,
        "a write reached the restarted peer"
    );
    assert!(
        new_mem.iter().all(|&b| b == 0),
        "the restarted peer's memory was written at the old segment's offsets"
    );
    // Opened again, it is the new segment: writes land there.
    let again = init.open_named(addr, "m", token).unwrap();
    assert_eq!(write(again.segment), SYNC_OK);
    assert!(new_mem[..4096].iter().all(|&b| b == 0x5a));
    drop(restarted);
}

/// Once another node answers at a peer's address, that node is reachable
/// there: its name is what the address answers now, and it can be opened
/// and written. The engine kept the first peer (and its hello's name) for
/// the address for good: the new node was "not at" its own address, its
/// correct directory entry taken for a stale one, until the initiator
/// restarted.
#[test]
fn another_node_at_a_peers_address_is_reachable_under_its_own_name() {
    let token = Token::derive(b"a secret both sides hold", "node");
    let lend = |e: &SyncEngine, mem: &mut [u8]| lend_m(e, mem, token);
    let init = engine();
    let mut gone_mem = vec![0u8; LEN];
    let gone = node_at("decode-3", "127.0.0.1:0".parse().unwrap());
    let addr = gone.local_addr();
    lend(&gone, &mut gone_mem);
    let seg = init.open_named(addr, "m", token).unwrap();
    assert_eq!(write_4k_at_0(&init, seg.segment, 0x11), SYNC_OK);
    drop(gone);
    let mut new_mem = vec![0u8; LEN];
    let other = node_at("decode-7", addr);
    lend(&other, &mut new_mem);
    assert_eq!(init.peer_node(addr).unwrap(), "decode-7");
    let seg = init.open_named(addr, "m", token).unwrap();
    assert_eq!(write_4k_at_0(&init, seg.segment, 0x22), SYNC_OK);
    assert!(new_mem[..4096].iter().all(|&b| b == 0x22));
    drop(other);
}
