//! Writes and reads of every size, verified, between two shards of one
//! process and between two processes.

mod common;

use common::*;
use quiesce_runtime::Runtime;
use quiesce_transports::{AlignedBuf, Engine, EngineConfig, Region, Rights};

const SEG: usize = 80 << 20;

fn initiator() -> Engine {
    Engine::bind(EngineConfig {
        node: "initiator".into(),
        ..tcp()
    })
    .unwrap()
}

/// Writes `len` patterned bytes at `offset`, reads them back through the
/// protocol, and returns what the target's memory holds there (in-process).
fn round_trip_shards(len: usize) {
    let target = ShardTarget::start(tcp(), &[("kv", SEG, Rights::READ | Rights::WRITE)]);
    let seg = target.seg("kv").clone();
    let offset = 4096 + 7; // deliberately unaligned
    let data = pattern(len, len as u8);
    let rt = Runtime::new().unwrap();
    let back = rt.block_on(async {
        let engine = initiator();
        let peer = engine.connect(target.addr).await.unwrap();
        assert_eq!(peer.node(), "quiesce");
        let kv = peer.open("kv", seg.token).await.unwrap();
        let (res, src) = kv.write(offset, data.clone(), 1).await;
        assert_eq!(res.unwrap(), len as u64);
        assert_eq!(src, data, "the source comes back untouched");
        let (res, dst) = kv
            .read(offset, len as u64, Vec::with_capacity(len), 2)
            .await;
        assert_eq!(res.unwrap(), len as u64);
        engine.shutdown();
        dst
    });
    assert!(back == data, "read back differs");
    assert!(
        target.snapshot("kv", offset, len) == data,
        "target memory differs"
    );
    // Nothing outside the range was touched.
    assert!(target.snapshot("kv", offset - 7, 7).iter().all(|&b| b == 0));
    assert!(target
        .snapshot("kv", offset + len as u64, 4096)
        .iter()
        .all(|&b| b == 0));
}

#[test]
fn shards_1_byte() {
    round_trip_shards(1);
}

#[test]
fn shards_4_kib() {
    round_trip_shards(4 << 10);
}

#[test]
fn shards_64_kib() {
    round_trip_shards(64 << 10);
}

#[test]
fn shards_1_mib() {
    round_trip_shards(1 << 20);
}

#[test]
fn shards_64_mib() {
    round_trip_shards(64 << 20);
}

/// The same against a target in its own process; verified by reading back.
fn round_trip_process(len: usize) {
    let seg_arg = format!("kv:{SEG}:rw");
    let target = TargetProcess::spawn(&["--segment", &seg_arg]);
    let token = target.seg("kv").token;
    let data = pattern(len, 3);
    Runtime::new().unwrap().block_on(async {
        let engine = initiator();
        let peer = engine.connect(target.addr).await.unwrap();
        assert_eq!(peer.node(), "test-target");
        let kv = peer.open("kv", token).await.unwrap();
        assert_eq!(kv.len(), SEG as u64);
        let (res, _) = kv.write(123, data.clone(), 1).await;
        assert_eq!(res.unwrap(), len as u64);
        let (res, dst) = kv.read(123, len as u64, AlignedBuf::new(len), 2).await;
        assert_eq!(res.unwrap(), len as u64);
        assert!(dst[..] == data[..], "read back differs");
        let (res, before) = kv.read(0, 123, vec![1u8; 123], 3).await;
        res.unwrap();
        assert!(
            before.iter().all(|&b| b == 0),
            "bytes before the range were touched"
        );
    });
}

#[test]
fn process_1_byte() {
    round_trip_process(1);
}

#[test]
fn process_4_kib() {
    round_trip_process(4 << 10);
}

#[test]
fn process_64_kib() {
    round_trip_process(64 << 10);
}

#[test]
fn process_1_mib() {
    round_trip_process(1 << 20);
}

#[test]
fn process_64_mib() {
    round_trip_process(64 << 20);
}

#[test]
fn striping_uses_every_connection_and_region_leases_work() {
    let target = ShardTarget::start(tcp(), &[("kv", 16 << 20, Rights::READ | Rights::WRITE)]);
    let token = target.seg("kv").token;
    Runtime::new().unwrap().block_on(async {
        let cfg = EngineConfig {
            connections_per_peer: 4,
            slice_size: 256 << 10,
            ..tcp()
        };
        let engine = Engine::bind(cfg).unwrap();
        let peer = engine.connect(target.addr).await.unwrap();
        let kv = peer.open("kv", token).await.unwrap();
        let region = Region::new(8 << 20);
        let mut src = region.lease(0..(4 << 20)).unwrap();
        src.copy_from_slice(&pattern(4 << 20, 11));
        let dst = region.lease((4 << 20)..(8 << 20)).unwrap();
        let (res, src) = kv.write(1 << 20, src, 1).await;
        assert_eq!(res.unwrap(), 4 << 20);
        let (res, dst) = kv.read(1 << 20, 4 << 20, dst, 2).await;
        assert_eq!(res.unwrap(), 4 << 20);
        assert!(src[..] == dst[..]);
    });
    assert!(
        target.stats().accepted >= 4,
        "slices were striped over 4 connections"
    );
}

#[test]
fn segment_memory_kinds_and_registration_errors() {
    Runtime::new().unwrap().block_on(async {
        let e = initiator();
        e.register("vec", vec![0u8; 10], Rights::READ).unwrap();
        e.register("boxed", vec![0u8; 10].into_boxed_slice(), Rights::WRITE)
            .unwrap();
        let seg = e
            .register(
                "aligned",
                AlignedBuf::new(8192),
                Rights::READ | Rights::WRITE,
            )
            .unwrap();
        assert_eq!(seg.len(), 8192);
        assert!(seg.write_at(8190, &[1, 2]));
        assert!(
            !seg.write_at(8191, &[1, 2]),
            "local writes are bounds-checked too"
        );
        use quiesce_transports::RegisterError::*;
        assert_eq!(
            e.register("vec", vec![0u8; 1], Rights::READ).unwrap_err(),
            Duplicate("vec".into())
        );
        assert_eq!(
            e.register("", vec![0u8; 1], Rights::READ).unwrap_err(),
            BadName
        );
        assert_eq!(
            e.register("x", vec![0u8; 1], Rights::empty()).unwrap_err(),
            NoRights
        );
    });
}

/// Writes sent while the target is frozen fill the connections' sockets:
/// frames go partly straight to the kernel and the rest through the driver
/// — a small write's from the frame pool, a 64 KiB write's as the rest of
/// its lent part — and every write lands whole, where it was sent.
#[test]
fn writes_cut_by_a_full_socket_land_whole() {
    const N: usize = 256;
    const STRIDE: usize = 64 << 10;
    let len = |i: usize| {
        if i.is_multiple_of(2) {
            STRIDE - i % 61
        } else {
            (16 << 10) - i % 61
        }
    };
    let target = ShardTarget::start(tcp(), &[("kv", SEG, Rights::READ | Rights::WRITE)]);
    let seg = target.seg("kv").clone();
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let engine = initiator();
        let peer = engine.connect(target.addr).await.unwrap();
        let kv = peer.open("kv", seg.token).await.unwrap();
        // Made first: the writes must outrun the freeze.
        let data: Vec<Vec<u8>> = (0..N).map(|i| pattern(len(i), i as u8)).collect();
        target.stall(std::time::Duration::from_millis(300));
        let handles: Vec<_> = data
            .into_iter()
            .enumerate()
            .map(|(i, d)| {
                let kv = kv.clone();
                quiesce_runtime::spawn_local(
                    async move { kv.write((i * STRIDE) as u64, d, 1).await.0 },
                )
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            assert_eq!(h.await.unwrap().unwrap(), len(i) as u64, "write {i}");
        }
        engine.shutdown();
    });
    for i in 0..N {
        let want = pattern(len(i), i as u8);
        assert!(
            target.snapshot("kv", (i * STRIDE) as u64, want.len()) == want,
            "write {i} landed wrong"
        );
    }
}
