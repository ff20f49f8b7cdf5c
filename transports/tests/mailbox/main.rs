//! The local transport's mailbox: an attached connection's small requests
//! and their answers through shared memory (DESIGN.md §16.5, PROTOCOL.md
//! §4.7), with the target's checks, and a hostile mailbox closing only its
//! own connection.

#[path = "../common/mod.rs"]
mod common;
mod doorbells;
mod hostile_target;

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

/// Forks a child that holds this process's sockets and turns into user
/// `nobody`; returns once it has.
pub(crate) fn fork_as_nobody() -> libc::pid_t {
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
    let t0 = std::time::Instant::now();
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
    child
}
