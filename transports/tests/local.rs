//! The local transport: a peer on this host moves data by cross-memory
//! attach, and a lent buffer comes back only once the target let go of it.

mod common;

use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::{spawn_local, time, Runtime};
use quiesce_transports::{Engine, EngineConfig, LocalMode, Rights, TransferError};

fn initiator(local: LocalMode) -> Engine {
    Engine::bind(EngineConfig {
        node: "initiator".into(),
        local,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn writes_and_reads_of_every_size_move_by_cross_memory_attach() {
    let target = ShardTarget::start(
        EngineConfig::default(),
        &[("kv", 8 << 20, Rights::READ | Rights::WRITE)],
    );
    let seg = target.seg("kv").clone();
    Runtime::new().unwrap().block_on(async {
        let engine = initiator(LocalMode::Required);
        let peer = engine.connect(target.addr).await.unwrap();
        let kv = peer.open("kv", seg.token).await.unwrap();
        assert!(peer.is_local(), "a peer on this host is attached");
        let mut offset = 3u64;
        for (i, len) in [1usize, 4096, 64 << 10, 3 << 20].into_iter().enumerate() {
            let data = pattern(len, i as u8 + 1);
            let (res, src) = kv.write(offset, data.clone(), 1).await;
            assert_eq!(res.unwrap(), len as u64);
            assert_eq!(src, data, "the source comes back untouched");
            let (res, dst) = kv
                .read(offset, len as u64, Vec::with_capacity(len), 2)
                .await;
            assert_eq!(res.unwrap(), len as u64);
            assert!(dst == data, "{len} bytes read back differ");
            assert!(target.snapshot("kv", offset, len) == data, "target memory");
            offset += len as u64;
        }
        // Bounds are the target's, as over TCP.
        let (res, _) = kv.write(seg.len - 1, vec![1u8; 2], 3).await;
        assert!(
            matches!(res, Err(TransferError::OutOfBounds { .. })),
            "{res:?}"
        );
        engine.shutdown();
    });
    assert_eq!(
        target.stats().bytes_landed,
        1 + 4096 + (64 << 10) + (3 << 20)
    );
}

#[test]
fn a_target_with_the_local_transport_off_is_reached_over_tcp() {
    let target = ShardTarget::start(
        EngineConfig {
            local: LocalMode::Off,
            ..Default::default()
        },
        &[("kv", 1 << 20, Rights::READ | Rights::WRITE)],
    );
    let seg = target.seg("kv").clone();
    Runtime::new().unwrap().block_on(async {
        let auto = initiator(LocalMode::Auto);
        let peer = auto.connect(target.addr).await.unwrap();
        let kv = peer.open("kv", seg.token).await.unwrap();
        assert!(!peer.is_local(), "the target refused the attach");
        let (res, _) = kv.write(0, vec![5u8; 4096], 1).await;
        assert_eq!(res.unwrap(), 4096);
        let required = initiator(LocalMode::Required);
        let peer = required.connect(target.addr).await.unwrap();
        let res = peer.open("kv", seg.token).await;
        assert!(res.is_err(), "Required fails when the target refuses");
    });
    assert!(target.snapshot("kv", 0, 4096).iter().all(|&b| b == 5));
}

/// The key check of the loan: with the target stopped, a torn-down write's
/// buffer stays lent (the target could wake and copy it) until the target
/// confirmed a fence; after it comes back, nothing the caller writes into
/// it reaches the target.
#[test]
fn a_buffer_lent_to_a_stopped_target_comes_back_only_once_it_let_go() {
    let t = TargetProcess::spawn(&["--segment", "kv:67108864:rw"]);
    let seg = t.seg("kv").clone();
    const LEN: usize = 64 << 20;
    Runtime::new().unwrap().block_on(async {
        let engine = initiator(LocalMode::Required);
        let peer = engine.connect(t.addr).await.unwrap();
        let kv = peer.open("kv", seg.token).await.unwrap();
        assert!(peer.is_local());
        t.signal(libc::SIGSTOP);
        let w = spawn_local({
            let kv = kv.clone();
            async move { kv.write(0, vec![1u8; LEN], 7).await }
        });
        time::sleep(Duration::from_millis(20)).await;
        peer.abort();
        time::sleep(Duration::from_millis(500)).await;
        assert!(
            !w.is_finished(),
            "the buffer came back while the stopped target could still copy it"
        );
        t.signal(libc::SIGCONT);
        let started = Instant::now();
        let (res, mut src) = w.await.unwrap();
        eprintln!("let go {:?} after the resume: {res:?}", started.elapsed());
        assert!(!res.as_ref().is_ok_and(|&n| n < LEN as u64), "{res:?}");
        // Ours again: nothing written into it now may reach the target.
        src.iter_mut().for_each(|b| *b = 0xEE);
        time::sleep(Duration::from_millis(200)).await;
        let (res, back) = kv.read(0, LEN as u64, Vec::with_capacity(LEN), 8).await;
        res.unwrap();
        let late = back.iter().filter(|&&b| b == 0xEE).count();
        assert_eq!(
            late, 0,
            "{late} bytes written after the buffer came back landed"
        );
    });
}

#[test]
fn a_killed_target_ends_a_local_transfer_with_its_buffer() {
    let mut t = TargetProcess::spawn(&["--segment", "kv:67108864:rw"]);
    let seg = t.seg("kv").clone();
    Runtime::new().unwrap().block_on(async {
        let engine = initiator(LocalMode::Required);
        let peer = engine.connect(t.addr).await.unwrap();
        let kv = peer.open("kv", seg.token).await.unwrap();
        t.signal(libc::SIGSTOP);
        let w = spawn_local({
            let kv = kv.clone();
            async move { kv.write(0, vec![1u8; 64 << 20], 7).await }
        });
        time::sleep(Duration::from_millis(20)).await;
        t.child.kill().unwrap();
        t.child.wait().unwrap();
        let started = Instant::now();
        let (res, src) = time::timeout(Duration::from_secs(5), w)
            .await
            .expect("an outcome, never a hang")
            .unwrap();
        assert!(
            matches!(res, Err(TransferError::ConnectionLost(_))),
            "{res:?}"
        );
        assert_eq!(src.len(), 64 << 20, "the buffer comes back");
        assert!(started.elapsed() < Duration::from_secs(2));
    });
}

/// One request larger than a chunk: the target looks at the batch's fence
/// before every chunk, so a fence stops the copy part-way, and once it is
/// acknowledged no further byte lands.
#[test]
fn a_fence_stops_a_large_copy_between_chunks() {
    const LEN: usize = 16 << 20;
    let target = ShardTarget::start(
        EngineConfig::default(),
        &[("kv", LEN, Rights::READ | Rights::WRITE)],
    );
    let seg = target.seg("kv").clone();
    Runtime::new().unwrap().block_on(async {
        let engine = Engine::bind(EngineConfig {
            local: LocalMode::Required,
            slice_size: LEN,
            connections_per_peer: 1,
            ..Default::default()
        })
        .unwrap();
        let peer = engine.connect(target.addr).await.unwrap();
        let kv = peer.open("kv", seg.token).await.unwrap();
        let mut cut = 0;
        for round in 0..8u64 {
            let batch = 10 + round;
            let w = spawn_local({
                let kv = kv.clone();
                async move { kv.write(0, vec![round as u8 + 1; LEN], batch).await }
            });
            time::sleep(Duration::from_micros(200)).await;
            peer.fence(batch).await.unwrap();
            let after = target.snapshot("kv", 0, LEN);
            let (res, _) = w.await.unwrap();
            let landed = match res {
                Ok(n) => n,
                Err(TransferError::FencedPartial { landed }) => landed,
                Err(TransferError::Fenced) => 0,
                Err(e) => panic!("round {round}: {e:?}"),
            };
            // Stopped mid-copy (not before it began, not after it ended).
            cut += (landed > 0 && landed < LEN as u64) as u32;
            eprintln!("round {round}: {landed} of {LEN} bytes landed before the fence");
            time::sleep(Duration::from_millis(50)).await;
            assert!(
                target.snapshot("kv", 0, LEN) == after,
                "round {round}: bytes landed after the fence was acknowledged"
            );
            peer.retire(batch);
        }
        assert!(cut > 0, "no fence stopped a copy in progress");
    });
}

/// A runtime shut down while a buffer is lent to a stopped target (the
/// write's future, then the task that waits for the target to let go,
/// dropped by the shutdown) must not free it, and must say so: its
/// shutdown answers `Undrained`, as for an operation still in the kernel's
/// hands. It answered `Ok`, having freed the buffer the target could still
/// read (or, for a read, write) once resumed.
#[test]
fn a_runtime_shut_down_with_a_buffer_lent_to_a_stopped_target_does_not_free_it() {
    let t = TargetProcess::spawn(&["--segment", "kv:67108864:rw"]);
    let seg = t.seg("kv").clone();
    const LEN: usize = 4 << 20;
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let engine = initiator(LocalMode::Required);
        let peer = engine.connect(t.addr).await.unwrap();
        let kv = peer.open("kv", seg.token).await.unwrap();
        assert!(peer.is_local());
        t.signal(libc::SIGSTOP);
        spawn_local(async move { kv.read(0, LEN as u64, vec![0u8; LEN], 7).await });
        time::sleep(Duration::from_millis(50)).await;
    });
    let shut = rt.shutdown();
    t.signal(libc::SIGCONT);
    assert!(
        shut.is_err(),
        "shut down clean with a buffer lent to a stopped target"
    );
}
