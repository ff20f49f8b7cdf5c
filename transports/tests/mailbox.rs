//! The local transport's mailbox: an attached connection's small requests
//! and their answers through shared memory (DESIGN.md §16.5, PROTOCOL.md
//! §4.7), with the target's checks, and a hostile mailbox closing only its
//! own connection.

mod common;

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::shm::{Doorbell, SharedMemory};
use quiesce_runtime::Runtime;
use quiesce_transports::wire::{Header, Opcode, Status};
use quiesce_transports::{Engine, EngineConfig, LocalMode, Rights, TransferError};

fn initiator(mailbox: bool) -> Engine {
    Engine::bind(EngineConfig {
        node: "initiator".into(),
        local: LocalMode::Required,
        mailbox,
        ..Default::default()
    })
    .unwrap()
}

const RW: Rights = Rights::READ.union(Rights::WRITE);

#[test]
fn small_requests_go_through_the_mailbox_and_large_ones_through_the_socket() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let seg = target.seg("kv").clone();
    Runtime::new().unwrap().block_on(async {
        let engine = initiator(true);
        let kv = engine
            .connect(target.addr)
            .await
            .unwrap()
            .open("kv", seg.token)
            .await
            .unwrap();
        let mut offset = 5u64;
        // (bytes, requests the mailbox serves for its write and read)
        for (i, (len, via)) in [
            (1usize, 2),
            (4096, 2),
            (16 << 10, 2),
            (64 << 10, 2),
            ((64 << 10) + 1, 0),
        ]
        .into_iter()
        .enumerate()
        {
            let before = target.stats().mailbox_requests;
            let data = pattern(len, i as u8 + 1);
            let (res, src) = kv.write(offset, data.clone(), 1).await;
            assert_eq!(res.unwrap(), len as u64);
            assert_eq!(src, data, "the source comes back untouched");
            assert!(
                target.snapshot("kv", offset, len) == data,
                "{len}: target memory"
            );
            let (res, dst) = kv.read(offset, len as u64, vec![0u8; len], 2).await;
            assert_eq!(res.unwrap(), len as u64);
            assert!(dst == data, "{len} bytes read back differ");
            assert_eq!(
                target.stats().mailbox_requests - before,
                via,
                "{len}-byte requests through the mailbox"
            );
            offset += len as u64;
        }
        // The target's own checks hold for the mailbox: a revoked range
        // takes nothing, and says so.
        target.revoke("kv", 0..4096).unwrap();
        let before = target.stats();
        let (res, _) = kv.write(0, vec![7u8; 64], 3).await;
        assert!(
            matches!(res, Err(TransferError::Revoked { landed: 0 })),
            "{res:?}"
        );
        let after = target.stats();
        assert_eq!(after.mailbox_requests, before.mailbox_requests + 1);
        assert_eq!(
            after.bytes_landed, before.bytes_landed,
            "a revoked write landed"
        );
        assert!(target.snapshot("kv", 0, 64).iter().all(|&b| b != 7));
        engine.shutdown();
    });
}

#[test]
fn without_the_mailbox_small_requests_take_the_socket() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let seg = target.seg("kv").clone();
    Runtime::new().unwrap().block_on(async {
        let engine = initiator(false);
        let peer = engine.connect(target.addr).await.unwrap();
        let kv = peer.open("kv", seg.token).await.unwrap();
        assert!(peer.is_local());
        let (res, _) = kv.write(0, pattern(4096, 1), 1).await;
        assert_eq!(res.unwrap(), 4096);
        let (res, dst) = kv.read(0, 4096, vec![0u8; 4096], 2).await;
        assert_eq!(res.unwrap(), 4096);
        assert_eq!(dst, pattern(4096, 1));
        engine.shutdown();
    });
    assert_eq!(target.stats().mailbox_requests, 0);
}

/// CPU time (s) the calling thread used so far.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec into a live one.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) },
        0
    );
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// A target gone (its process dead, its engine shut down, or a hostile one
/// that closed its end of the initiator's doorbell) leaves that doorbell
/// readable for good: the initiator stops watching it. Its reactor woke
/// for it at every turn, one core at 100 % for as long as the segment's
/// handle lived.
#[test]
fn a_gone_target_does_not_make_the_initiator_spin() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let seg = target.seg("kv").clone();
    let mut target = Some(target);
    Runtime::new().unwrap().block_on(async {
        let engine = initiator(true);
        let kv = engine
            .connect(target.as_ref().unwrap().addr)
            .await
            .unwrap()
            .open("kv", seg.token)
            .await
            .unwrap();
        let (res, _) = kv.write(0, pattern(512, 1), 1).await;
        assert_eq!(res.unwrap(), 512);
        assert_eq!(target.as_ref().unwrap().stats().mailbox_requests, 1);
        drop(target.take());
        // The reactor sees the ends go.
        quiesce_runtime::time::sleep(Duration::from_millis(100)).await;
        let before = thread_cpu();
        quiesce_runtime::time::sleep(Duration::from_secs(1)).await;
        let used = thread_cpu() - before;
        assert!(
            used < 0.5,
            "the initiator's thread used {used:.2} s of one idle second"
        );
        let t0 = Instant::now();
        let (res, _) = kv.write(0, pattern(512, 2), 2).await;
        assert!(res.is_err(), "a write to a gone target: {res:?}");
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        engine.shutdown();
    });
}

/// The mailbox layout of PROTOCOL.md §4.7.
const SLOTS: usize = 32;
const SLOT_DATA: usize = 64 << 10;
const RING: usize = 256;
const STRIDE: usize = 64 + SLOT_DATA;
const SIZE: usize = RING + SLOTS * STRIDE;

/// Another initiator, with a mailbox of its own, writes to `target`'s "kv".
fn others_are_served(target: &ShardTarget, token: quiesce_transports::Token) {
    Runtime::new().unwrap().block_on(async {
        let engine = initiator(true);
        let peer = engine.connect(target.addr).await.unwrap();
        let kv = peer.open("kv", token).await.unwrap();
        let (res, _) = kv.write(0, pattern(512, 9), 9).await;
        assert_eq!(res.unwrap(), 512);
        engine.shutdown();
    });
}

/// A mailbox made by hand, published over a raw connection.
struct HandMailbox {
    mem: SharedMemory,
    to_target: Doorbell,
    /// `None` once a test closed it.
    to_initiator: Option<Doorbell>,
    /// The doorbells' other ends, as the offer named them.
    named: [OwnedFd; 2],
    next: u64,
}

impl HandMailbox {
    /// Offers a hand-made mailbox on `c`; the target's verdict must be `Ok`.
    fn offer(c: &mut RawClient) -> HandMailbox {
        let (to_target, to_initiator, named) = hand_bells();
        let mem = hand_memory();
        assert_eq!(
            offer(c, mem.fd(), named[0].as_raw_fd(), named[1].as_raw_fd()),
            Status::Ok
        );
        HandMailbox {
            mem,
            to_target,
            to_initiator: Some(to_initiator),
            named,
            next: 0,
        }
    }

    /// Publishes one request (`kind` 1 write, 2 read) and waits for its
    /// answer: (status, applied).
    fn request(
        &mut self,
        kind: u64,
        segment: u64,
        offset: u64,
        data: &[u8],
        len: u64,
    ) -> (u64, u64) {
        let slot = RING + (self.next as usize % SLOTS) * STRIDE;
        for (i, v) in [kind, self.next + 100, 1, segment, offset, len]
            .into_iter()
            .enumerate()
        {
            self.mem.word(slot + 8 * i).store(v, Ordering::Relaxed);
        }
        self.mem.copy_from_slice(slot + 64, data);
        self.publish(self.next + 1);
        self.wait_served(self.next + 1);
        self.next += 1;
        (
            self.mem.word(slot + 48).load(Ordering::Relaxed),
            self.mem.word(slot + 56).load(Ordering::Relaxed),
        )
    }

    fn publish(&self, submitted: u64) {
        self.mem.word(0).store(submitted, Ordering::Release);
        self.to_target.ring();
    }

    fn wait_served(&self, n: u64) {
        let t0 = Instant::now();
        while self.mem.word(64).load(Ordering::Acquire) < n {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the target never answered"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Two hand-made doorbells: the initiator's ends (to the target, to
/// itself), and the other ends, whose fd numbers an offer names.
fn hand_bells() -> (Doorbell, Doorbell, [OwnedFd; 2]) {
    let (to_target, target_end) = Doorbell::pair().unwrap();
    let (to_initiator, initiator_end) = Doorbell::pair().unwrap();
    (to_target, to_initiator, [target_end, initiator_end])
}

/// The token every hand-made offer carries (PROTOCOL.md §4.7).
const TOKEN: [u64; 2] = [0x5155_4945_5343_4521, 0x746f_6b65_6e21_2121];

/// Memory for a hand-made mailbox, holding [`TOKEN`] at offset 8.
fn hand_memory() -> SharedMemory {
    let mem = SharedMemory::create("hand", SIZE).unwrap();
    mem.word(8).store(TOKEN[0], Ordering::Relaxed);
    mem.word(16).store(TOKEN[1], Ordering::Relaxed);
    mem
}

/// Sends `LocalAttach` for this process on `c`; the target's verdict.
fn attach(c: &mut RawClient) -> Status {
    attach_as(c, std::process::id())
}

/// Sends `LocalAttach` naming process `pid` (which must hold `c`'s socket
/// and the nonce at the same address: this process or a fork of it).
fn attach_as(c: &mut RawClient, pid: u32) -> Status {
    let mut attach = [0u8; 12];
    attach[0..4].copy_from_slice(&pid.to_le_bytes());
    attach[4..12].copy_from_slice(&(c.ack.nonce.as_ptr() as u64).to_le_bytes());
    c.send(
        &Header {
            length: 12,
            ..Header::new(Opcode::LocalAttach)
        },
        &attach,
    );
    c.recv().expect("an attach answer").status().unwrap()
}

/// Each `LocalAttach` costs the target a scan of the kernel's socket
/// tables and the process's fds, on its reactor: a connection gets one
/// attempt, so a peer cannot repeat it without bound.
#[test]
fn a_connection_attaches_once() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 4096, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    assert_eq!(attach(&mut c), Status::Ok);
    for _ in 0..3 {
        assert_eq!(attach(&mut c), Status::Forbidden, "attached again");
    }
    // A connection whose attempt failed gets no second one either.
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let nonce = c.ack.nonce;
    c.ack.nonce = [0; 16];
    assert_eq!(attach(&mut c), Status::Forbidden, "a wrong nonce");
    c.ack.nonce = nonce;
    assert_eq!(attach(&mut c), Status::Forbidden, "a second attempt");
}

/// Attaches `c` to this process and offers a mailbox of the files `mem`
/// and the target's ends of two doorbells (fd numbers: the one to the
/// target, the one to the initiator), with [`TOKEN`]; returns the target's
/// verdict.
fn offer(c: &mut RawClient, mem: i32, to_target: i32, to_initiator: i32) -> Status {
    assert_eq!(attach(c), Status::Ok, "the attach was refused");
    let mut p = [0u8; 32];
    for (i, v) in [mem, to_target, to_initiator, SLOTS as i32]
        .into_iter()
        .enumerate()
    {
        p[i * 4..i * 4 + 4].copy_from_slice(&(v as u32).to_le_bytes());
    }
    p[16..24].copy_from_slice(&TOKEN[0].to_le_bytes());
    p[24..32].copy_from_slice(&TOKEN[1].to_le_bytes());
    c.send(
        &Header {
            length: 32,
            ..Header::new(Opcode::LocalMailbox)
        },
        &p,
    );
    c.recv().expect("a mailbox answer").status().unwrap()
}

#[test]
fn a_hostile_mailbox_is_refused_checked_or_closes_only_its_own_connection() {
    let target = ShardTarget::start(
        EngineConfig::default(),
        &[("kv", 1 << 20, RW), ("other", 4096, RW)],
    );
    let kv = target.seg("kv").clone();
    let connect = || {
        let mut c = RawClient::connect(target.addr);
        assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
        c
    };
    // Memory the initiator could still shrink under the target's mapping,
    // or a "doorbell" that is a memfd, is refused.
    let unsealed = {
        // SAFETY: a NUL-terminated name; returns a new fd or -1.
        let raw = unsafe { libc::memfd_create(c"loose".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a new fd nothing else owns; ftruncate is a plain syscall.
        unsafe {
            assert_eq!(libc::ftruncate(raw, SIZE as libc::off_t), 0);
            std::os::fd::OwnedFd::from_raw_fd(raw)
        }
    };
    let (_b, _c, bell) = hand_bells();
    {
        let mut c = connect();
        let fake = SharedMemory::create("fake", SIZE).unwrap();
        // A fake sealed mapping passes as memory but not as a doorbell.
        assert_eq!(
            offer(&mut c, fake.fd(), fake.fd(), bell[1].as_raw_fd()),
            Status::Forbidden
        );
        // The unsealed file, offered as the memory.
        let mut c = connect();
        let st = offer(
            &mut c,
            unsealed.as_raw_fd(),
            bell[0].as_raw_fd(),
            bell[1].as_raw_fd(),
        );
        assert_eq!(st, Status::Forbidden);
        // Memory without the offer's token: not the mailbox it names (the
        // initiator closed the files and their numbers were reused).
        let mut c = connect();
        let (_a, _b, ab) = hand_bells();
        let st = offer(&mut c, fake.fd(), ab[0].as_raw_fd(), ab[1].as_raw_fd());
        assert_eq!(st, Status::Forbidden);
    }
    // A good mailbox: every request is checked as if it came from the socket.
    let mut c = connect();
    let mut hand = HandMailbox::offer(&mut c);
    let other = target.seg("other").clone();
    let before = target.stats();
    let cases: [(u64, u64, u64, u64, Status); 5] = [
        // kind, segment, offset, length: verdict
        (1, kv.id, 100, 4096, Status::Ok),
        (9, kv.id, 0, 16, Status::BadFrame),
        (1, kv.id, 0, SLOT_DATA as u64 + 1, Status::BadFrame),
        (1, other.id, 0, 16, Status::Forbidden),
        (1, kv.id, (1 << 20) - 8, 16, Status::OutOfBounds),
    ];
    for (kind, seg, off, len, want) in cases {
        let data = pattern(len.min(SLOT_DATA as u64) as usize, 5);
        let (st, applied) = hand.request(kind, seg, off, &data, len);
        assert_eq!(
            (st, applied),
            (want as u64, if want == Status::Ok { len } else { 0 })
        );
    }
    assert!(target.snapshot("kv", 100, 4096) == pattern(4096, 5));
    let after = target.stats();
    assert_eq!(
        after.bytes_landed - before.bytes_landed,
        4096,
        "only the valid write landed"
    );
    assert_eq!(after.rejected - before.rejected, 4);
    // A read comes back in the slot.
    let (st, applied) = hand.request(2, kv.id, 100, &[], 4096);
    assert_eq!((st, applied), (0, 4096));
    let mut back = vec![0u8; 4096];
    let slot = RING + ((hand.next - 1) as usize % SLOTS) * STRIDE;
    hand.mem.copy_into(slot + 64, &mut back, 4096);
    assert!(back == pattern(4096, 5));
    // More requests published than the ring has slots: the connection is
    // closed, the requests unserved.
    let served = hand.next;
    hand.publish(served + SLOTS as u64 + 1);
    let mut rest = Vec::new();
    assert!(
        c.s.read_to_end(&mut rest).is_ok(),
        "the connection stayed open"
    );
    assert_eq!(
        hand.mem.word(64).load(Ordering::Acquire),
        served,
        "served past the ring"
    );
    // Everyone else is served as before.
    others_are_served(&target, kv.token);
}

/// The mailbox and the socket are one stream: a request published before
/// a frame was sent is served before the target acts on the frame. Here
/// the request is published without ringing (the target sleeps, so only
/// the frame wakes it) and the frame is a fence of the request's batch:
/// served after the fence, the write would be refused.
#[test]
fn a_request_published_before_a_frame_is_served_before_it() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let hand = HandMailbox::offer(&mut c);
    for round in 0..5u64 {
        // Let the target's reactor go to sleep.
        std::thread::sleep(Duration::from_millis(20));
        let batch = 1 + round;
        let slot = RING + (round as usize % SLOTS) * STRIDE;
        for (i, v) in [1, round + 1, batch, kv.id, 0, 512].into_iter().enumerate() {
            hand.mem.word(slot + 8 * i).store(v, Ordering::Relaxed);
        }
        hand.mem
            .copy_from_slice(slot + 64, &pattern(512, round as u8));
        hand.mem.word(0).store(round + 1, Ordering::Release);
        c.send(
            &Header {
                batch,
                ..Header::new(Opcode::Fence)
            },
            &[],
        );
        let h = c.recv().expect("a fence ack");
        assert_eq!(h.op, Opcode::FenceAck);
        hand.wait_served(round + 1);
        assert_eq!(
            hand.mem.word(slot + 48).load(Ordering::Relaxed),
            Status::Ok as u64,
            "round {round}: the request was served after the fence that followed it"
        );
        assert!(target.snapshot("kv", 0, 512) == pattern(512, round as u8));
    }
}

/// Makes the target's end `fd` of a doorbell block: full, then blocking —
/// what a hostile initiator, which shares the file, can do to the doorbell
/// the target rings.
fn jam(fd: i32) {
    // SAFETY: fcntl and write on an fd this test holds; 8 bytes from a live u64.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        assert!(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0);
        let v = u64::MAX - 1;
        while libc::write(fd, (&v as *const u64).cast(), 8) == 8 {}
        assert!(libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0);
    }
}

/// Another peer's 512-byte write to `kv` at `addr`, from a thread of its
/// own: its result comes on the channel (never, if the target's reactor is
/// held).
fn another_peer_writes(
    addr: std::net::SocketAddr,
    token: quiesce_transports::Token,
) -> std::sync::mpsc::Receiver<Result<u64, String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        Runtime::new().unwrap().block_on(async {
            let engine = initiator(false);
            let peer = engine.connect(addr).await.unwrap();
            let kv = peer.open("kv", token).await.unwrap();
            let (res, _) = kv.write(4096, pattern(512, 9), 9).await;
            let _ = tx.send(res.map_err(|e| e.to_string()));
            engine.shutdown();
        })
    });
    rx
}

/// The doorbell the target rings is a file the initiator made. An
/// initiator that jams it (fills it, then clears `O_NONBLOCK` on it) and
/// says it sleeps must not block the target's reactor when it rings: the
/// request is answered, and every other peer is served.
#[test]
fn a_jammed_doorbell_does_not_block_the_target() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let mut hand = HandMailbox::offer(&mut c);
    jam(hand.named[1].as_raw_fd());
    // "Asleep": the target rings after it serves.
    hand.mem.word(192).store(1, Ordering::Relaxed);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (st, applied) = hand.request(1, kv.id, 0, &pattern(512, 4), 512);
        done_tx.send((st, applied, hand)).unwrap();
    });
    let answered = done_rx.recv_timeout(Duration::from_secs(10));
    // The target's reactor still runs: another peer is served.
    let served = another_peer_writes(target.addr, kv.token).recv_timeout(Duration::from_secs(10));
    if answered.is_err() || served.is_err() {
        // A blocked target would never stop: leave its thread behind.
        std::mem::forget(target);
    }
    let (st, applied, _hand) = answered.expect("the request was never answered");
    assert_eq!((st, applied), (Status::Ok as u64, 512));
    let res = served.expect("the target's reactor is blocked: another peer was never served");
    assert_eq!(res.unwrap(), 512);
}

/// An initiator that floods the doorbell it rings the target with (bytes
/// faster than 64-byte receives drain them) holds nothing of the target:
/// its reactor drains a bounded amount per wake and serves every other
/// peer meanwhile (the drain looped while a receive came back full, for as
/// long as the flood lasted).
#[test]
fn a_flooded_doorbell_does_not_hold_the_target() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let hand = HandMailbox::offer(&mut c);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        let fd = hand.to_target.fd();
        std::thread::spawn(move || {
            let bytes = vec![1u8; 64 << 10];
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(20) {
                // SAFETY: sends from a live buffer on an fd `hand` keeps open.
                unsafe {
                    libc::send(
                        fd,
                        bytes.as_ptr().cast(),
                        bytes.len(),
                        libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                    )
                };
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let served = another_peer_writes(target.addr, kv.token).recv_timeout(Duration::from_secs(10));
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    drop(hand);
    let res = served.expect("the target's reactor is held: another peer was never served");
    assert_eq!(res.unwrap(), 512);
}

/// An initiator that closes its ends of the doorbells harms only its own
/// connection. Ringing one whose other end is gone raises no `SIGPIPE` (a
/// host that did not ignore it died of it with pipe doorbells); a doorbell
/// whose ringer is gone stays readable for good, so the target closes the
/// connection rather than wake for it again and again.
#[test]
fn closed_doorbells_neither_signal_nor_keep_the_target_waking() {
    // As a C host that never ignored SIGPIPE. (This binary's other tests
    // send with MSG_NOSIGNAL, as the engine does.)
    // SAFETY: sets a signal's disposition; no handler runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let mut hand = HandMailbox::offer(&mut c);
    // The initiator's own end gone, and it "sleeps": the target rings it.
    hand.to_initiator = None;
    hand.mem.word(192).store(1, Ordering::Relaxed);
    let (st, applied) = hand.request(1, kv.id, 0, &pattern(512, 4), 512);
    assert_eq!(
        (st, applied),
        (Status::Ok as u64, 512),
        "the target died or refused"
    );
    // The end that rings the target gone: the target closes the connection.
    drop(hand);
    let t0 = Instant::now();
    assert!(c.recv().is_none(), "the connection stayed open");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // Everyone else is served as before.
    others_are_served(&target, kv.token);
}

/// CPU time (s) each target shard thread of the process used so far, by
/// thread id.
fn shard_cpu() -> std::collections::HashMap<String, f64> {
    let tick = 100.0; // USER_HZ
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            comm.starts_with("target-shard").then_some(())?;
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            // After the ")" closing comm: state is field 3, utime 14, stime 15.
            let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let cpu = (f[11].parse::<f64>().ok()? + f[12].parse::<f64>().ok()?) / tick;
            Some((dir.file_name()?.to_string_lossy().into_owned(), cpu))
        })
        .collect()
}

/// The most CPU one target shard thread used over an idle second (the
/// tests alongside serve a request or two in it, not a second's worth).
fn idle_cpu() -> f64 {
    let before = shard_cpu();
    std::thread::sleep(Duration::from_secs(1));
    shard_cpu()
        .into_iter()
        .map(|(tid, cpu)| cpu - before.get(&tid).copied().unwrap_or(cpu))
        .fold(0.0, f64::max)
}

/// Nothing an initiator writes in the shared mapping makes the target
/// spin: a `served` count it moved past `submitted` woke the serve loop at
/// every reactor turn for nothing (the reactor compared the two words of
/// the mapping, the serve loop its own count), one core at 100 % for as
/// long as the connection lived.
#[test]
fn a_served_count_moved_by_the_initiator_does_not_make_the_target_spin() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let hand = HandMailbox::offer(&mut c);
    hand.mem.word(64).store(1, Ordering::Release);
    hand.to_target.ring();
    let used = idle_cpu();
    assert!(
        used < 0.5,
        "the target's shard used {used:.2} s of one idle second"
    );
    drop(hand);
}

/// A doorbell must be a connected socket (PROTOCOL.md §4.7): one that was
/// never connected polls as hung up for ever, and the target, watching it,
/// never blocked again.
#[test]
fn an_unconnected_doorbell_is_refused() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let (_to_target, _to_initiator, named) = hand_bells();
    // SAFETY: a plain socket(2) call; the fd is owned below.
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(raw >= 0);
    // SAFETY: `raw` is a new fd nothing else owns.
    let unconnected = unsafe { OwnedFd::from_raw_fd(raw) };
    let mem = hand_memory();
    let st = offer(
        &mut c,
        mem.fd(),
        unconnected.as_raw_fd(),
        named[1].as_raw_fd(),
    );
    if st == Status::Ok {
        let used = idle_cpu();
        panic!("an unconnected doorbell was accepted (the target's shard then used {used:.2} s of one idle second)");
    }
    assert_eq!(st, Status::Forbidden);
}

/// The target copies between its segments and an attached process with
/// its own credentials, for as long as the connection lives: a process of
/// another user must not attach. Through it (its child that keeps the
/// socket, once it exec'd a setuid program), a target with more rights
/// than the initiator — root, as in many containers — would read and write
/// memory the initiator's user may not. Only a process of the target's own
/// user attaches; others stay on TCP.
#[test]
fn a_process_of_another_user_does_not_attach() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a process as another user");
        return;
    }
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 4096, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    // A fork holds the socket and the nonce at the same address; it turns
    // into user `nobody` and waits.
    // SAFETY: the child calls only async-signal-safe functions.
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        // SAFETY: async-signal-safe calls in the forked child.
        unsafe {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                libc::_exit(1);
            }
            loop {
                libc::pause();
            }
        }
    }
    // Until the child runs as `nobody`.
    let t0 = Instant::now();
    while !std::fs::read_to_string(format!("/proc/{child}/status"))
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("65534"))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the child never changed user"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = attach_as(&mut c, child as u32);
    // SAFETY: kills and reaps the child forked above.
    unsafe {
        libc::kill(child, libc::SIGKILL);
        libc::waitpid(child, std::ptr::null_mut(), 0);
    }
    assert_eq!(st, Status::Forbidden, "a process of another user attached");
}
