//! RDMA verbs transport, on a real device. Every test but the first needs
//! one and is `#[ignore]`d on machines without: `scripts/softroce-vm.sh
//! test` runs them inside a QEMU guest with Soft-RoCE (rxe0).

#[path = "../common/mod.rs"]
mod common;
mod fences;
mod keys;

use std::future::Future;
use std::time::{Duration, Instant};

use common::{pattern, TargetProcess};
use quiesce_runtime::time::sleep;
use quiesce_runtime::{spawn_local, Runtime};
use quiesce_transports::rdma::{
    device_names, LocalMemory, RdmaConfig, RdmaEngine, RdmaError, RdmaPeer, RdmaSegment,
};
use quiesce_transports::{AlignedBuf, Lease, Region, Rights, Segment, TransferError};

const NEEDS_DEVICE: &str = "needs an RDMA device: scripts/softroce-vm.sh test";

fn has_device() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

/// On a machine without RDMA (no libibverbs, or no device) binding fails
/// with the typed error; with a device it succeeds.
#[test]
fn bind_reports_no_device_as_a_typed_error() {
    Runtime::new().unwrap().block_on(async {
        match RdmaEngine::bind(RdmaConfig::default()) {
            Ok(e) => assert!(has_device(), "bound {} without a device?", e.device()),
            Err(RdmaError::NoDevice(why)) => {
                assert!(!has_device(), "a device exists, yet: {why}");
                assert!(!why.is_empty());
                assert!(device_names().map_or(true, |n| n.is_empty()));
            }
            Err(e) => panic!("expected NoDevice, got {e}"),
        }
    });
}

struct Pair {
    target: RdmaEngine,
    initiator: RdmaEngine,
    kv: Segment,
    remote: RdmaSegment,
    region: Region,
    _local: quiesce_transports::rdma::LocalMemory,
}

/// A target engine with a read-write segment `kv` of `len` bytes.
fn kv_target(len: usize) -> (RdmaEngine, Segment) {
    let target = RdmaEngine::bind(RdmaConfig::default()).expect("target engine");
    let kv = target
        .register("kv", AlignedBuf::new(len), Rights::READ | Rights::WRITE)
        .unwrap();
    (target, kv)
}

async fn pair(kv_len: usize, region_len: usize) -> Pair {
    let (target, kv) = kv_target(kv_len);
    target
        .register("ro", AlignedBuf::new(4096), Rights::READ)
        .unwrap();
    let initiator = RdmaEngine::bind(RdmaConfig::default()).expect("initiator engine");
    let region = Region::new(region_len);
    let local = initiator.register_region(&region).unwrap();
    let peer = initiator.connect(target.local_addr()).await.unwrap();
    let remote = peer.open("kv", kv.token()).await.unwrap();
    Pair {
        target,
        initiator,
        kv,
        remote,
        region,
        _local: local,
    }
}

fn fill(l: &mut Lease, seed: u8) {
    let p = pattern(l.len(), seed);
    l.copy_from_slice(&p);
}

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn write_and_read_back_every_size() {
    let _ = NEEDS_DEVICE;
    Runtime::new().unwrap().block_on(async {
        let max = 16 << 20;
        let p = pair(max + 4096, 2 * max).await;
        for (i, &size) in [1usize, 7, 64, 4096, 65_536, 1 << 20, 3 << 20, 16 << 20]
            .iter()
            .enumerate()
        {
            let seed = i as u8 + 1;
            let mut src = p.region.lease(0..size).unwrap();
            fill(&mut src, seed);
            let (r, src) = p.remote.write(1, src, 1).await;
            assert_eq!(r.unwrap(), size as u64, "write of {size}");
            let mut landed = vec![0u8; size];
            assert!(p.kv.read_at(1, &mut landed));
            assert!(
                landed == src[..],
                "target memory differs after a {size}-byte write"
            );
            let dst = p.region.lease(max..max + size).unwrap();
            let (r, dst) = p.remote.read(1, size as u64, dst, 2).await;
            assert_eq!(r.unwrap(), size as u64, "read of {size}");
            assert!(dst[..] == src[..], "read-back differs for {size} bytes");
        }
        let s = p.initiator.stats();
        assert_eq!(s.in_flight, 0);
        assert!(s.posted >= 16 + 2, "{s:?}");
        assert_eq!(s.posted, s.completed);
        drop(p.target);
    });
}

/// `shutdown()` closes the engine's peers: a segment opened before it
/// posts nothing after it, and no peer connects. The segment reconnected,
/// built a new queue pair and posted: `shutdown` had answered "drained"
/// of an engine that could still set the NIC on the caller's memory.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn an_engine_shut_down_posts_nothing_and_connects_nowhere() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut src = p.region.lease(0..4096).unwrap();
        fill(&mut src, 3);
        let (r, _) = p.remote.write(0, src, 1).await;
        assert_eq!(r.unwrap(), 4096);
        assert!(p.initiator.shutdown(Duration::from_secs(5)));
        let posted = p.initiator.stats().posted;
        let src = p.region.lease(0..4096).unwrap();
        let (r, _) = p.remote.write(0, src, 2).await;
        assert!(r.is_err(), "a write after shutdown: {r:?}");
        assert_eq!(p.initiator.stats().posted, posted, "posted after shutdown");
        let again = p.initiator.connect(p.target.local_addr()).await;
        assert!(again.is_err(), "a peer connected after shutdown");
    });
}

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn bad_input_is_refused_before_posting() {
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        // Not in registered memory: refused, buffer back untouched.
        let (r, v) = p.remote.write(0, vec![5u8; 4096], 1).await;
        assert!(
            matches!(r, Err(TransferError::Unregistered { len: 4096, .. })),
            "{r:?}"
        );
        assert!(v.iter().all(|&b| b == 5));
        // Out of bounds and zero length: typed, nothing posted.
        let l = p.region.lease(0..4096).unwrap();
        let (r, l) = p.remote.write((1 << 20) - 100, l, 1).await;
        assert!(matches!(r, Err(TransferError::OutOfBounds { .. })), "{r:?}");
        let (r, l) = p.remote.read(0, 8192, l, 1).await;
        assert!(matches!(r, Err(TransferError::BadLength(_))), "{r:?}");
        // A key whose address (the target's word) would wrap past the end
        // of the address space with the offset: refused, not posted.
        let key = p.remote.remote_key().expect("a key");
        let wrapping = p
            .remote
            .with_remote_key(quiesce_transports::wire::RemoteKey {
                addr: u64::MAX - 8,
                ..key
            });
        let (r, _l) = wrapping.write(16, l, 1).await;
        assert!(matches!(r, Err(TransferError::RemoteAccess(_))), "{r:?}");
        assert_eq!(p.initiator.stats().posted, 0);
    });
}

/// A target with a read-only segment "ro" (8 KiB) and a read-write "kv"
/// (1 MiB), and an initiator with a 1 MiB region that opened both.
struct RoKv {
    target: RdmaEngine,
    ro: Segment,
    _kv: Segment,
    init: RdmaEngine,
    region: Region,
    _local: quiesce_transports::rdma::LocalMemory,
    peer: quiesce_transports::rdma::RdmaPeer,
    ro_r: RdmaSegment,
    kv_r: RdmaSegment,
}

async fn ro_and_kv() -> RoKv {
    ro_and_kv_with(RdmaConfig::default()).await
}

/// [`ro_and_kv`] with the target's engine made from `target_config`.
async fn ro_and_kv_with(target_config: RdmaConfig) -> RoKv {
    let target = RdmaEngine::bind(target_config).unwrap();
    let ro = target
        .register("ro", AlignedBuf::new(8192), Rights::READ)
        .unwrap();
    let kv = target
        .register("kv", AlignedBuf::new(1 << 20), Rights::READ | Rights::WRITE)
        .unwrap();
    let init = RdmaEngine::bind(RdmaConfig::default()).unwrap();
    let region = Region::new(1 << 20);
    let local = init.register_region(&region).unwrap();
    let peer = init.connect(target.local_addr()).await.unwrap();
    let ro_r = peer.open("ro", ro.token()).await.unwrap();
    let kv_r = peer.open("kv", kv.token()).await.unwrap();
    RoKv {
        target,
        ro,
        _kv: kv,
        init,
        region,
        _local: local,
        peer,
        ro_r,
        kv_r,
    }
}

/// Samples `len` bytes of `seg` now and `after` later: equal once fenced.
async fn quiet(seg: &Segment, len: usize, after: Duration) -> bool {
    let mut a = vec![0u8; len];
    let mut b = vec![0u8; len];
    seg.read_at(0, &mut a);
    sleep(after).await;
    seg.read_at(0, &mut b);
    a == b
}

/// Two shards, each with its own engine (device context, PD, CQ) and its own
/// queue pair to the same target, write and read back disjoint halves at once.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn each_shard_has_its_own_completion_queue_and_queue_pair() {
    use quiesce_runtime::shard::Shards;
    const HALF: usize = 4 << 20;
    let target = TargetProcess::spawn(&["--rdma", "--segment", "kv:8388608:rw"]);
    let (addr, token) = (target.addr, target.seg("kv").token);
    let shards = Shards::builder()
        .count(2)
        .pin(false)
        .spawn(move |shard| async move {
            let i = shard.index();
            let engine = RdmaEngine::bind(RdmaConfig::default()).expect("engine");
            let region = Region::new(2 * HALF);
            let _reg = engine.register_region(&region).unwrap();
            let peer = engine.connect(addr).await.unwrap();
            let kv = peer.open("kv", token).await.unwrap();
            let mut src = region.lease(0..HALF).unwrap();
            fill(&mut src, 20 + i as u8);
            let mut dst = region.lease(HALF..2 * HALF).unwrap();
            for round in 0..4u64 {
                let (r, s) = kv.write((i * HALF) as u64, src, round).await;
                assert_eq!(r.unwrap(), HALF as u64);
                src = s;
                let (r, d) = kv
                    .read((i * HALF) as u64, HALF as u64, dst, 100 + round)
                    .await;
                assert_eq!(r.unwrap(), HALF as u64);
                dst = d;
                assert!(dst[..] == src[..], "shard {i} read back other bytes");
            }
            engine.stats()
        })
        .unwrap();
    for (i, s) in shards.shutdown().into_iter().enumerate() {
        let s = s.expect("shard panicked");
        assert_eq!(s.in_flight, 0, "shard {i}: {s:?}");
        assert_eq!(s.posted, s.completed, "shard {i}: {s:?}");
        assert!(
            s.posted >= 8 * 4,
            "shard {i} used another shard's queues? {s:?}"
        );
    }
}

/// An initiator that cuts transfers into 4 KiB requests (a 256 KiB write is
/// 64 of them), with a registered 1 MiB region, connected to `target`, with
/// its segment `kv` open.
struct Sliced {
    init: RdmaEngine,
    region: Region,
    _reg: LocalMemory,
    peer: RdmaPeer,
    remote: RdmaSegment,
}

impl Sliced {
    async fn connect(target: &RdmaEngine, kv: &Segment, cq_depth: Option<u32>) -> Sliced {
        let cfg = RdmaConfig {
            queue_depth: 256,
            cq_depth,
            slice_size: 4096,
            ..Default::default()
        };
        Sliced::connect_with(target, kv, cfg).await
    }

    async fn connect_with(target: &RdmaEngine, kv: &Segment, cfg: RdmaConfig) -> Sliced {
        let init = RdmaEngine::bind(cfg).unwrap();
        let region = Region::new(1 << 20);
        let _reg = init.register_region(&region).unwrap();
        let peer = init.connect(target.local_addr()).await.unwrap();
        let remote = peer.open("kv", kv.token()).await.unwrap();
        Sliced {
            init,
            region,
            _reg,
            peer,
            remote,
        }
    }
}

/// A one-request write to an idle link is posted as it is submitted. A
/// transfer's requests in one doorbell ask for one completion, the
/// last's: the send queue completes in order, so it vouches for the rest.
/// When the NIC refuses the first of them, the transfer still resolves
/// only once the last is flushed, and nothing of it has landed.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_transfer_asks_for_one_completion_per_doorbell_and_resolves_only_after_its_last() {
    Runtime::new().unwrap().block_on(async {
        let (target, kv) = kv_target(1 << 20);
        let ro = target
            .register("ro", AlignedBuf::new(64 << 10), Rights::READ)
            .unwrap();
        let Sliced {
            init,
            region,
            _reg,
            peer,
            remote,
        } = Sliced::connect(&target, &kv, None).await;
        // A one-request write to an idle link is posted as it is submitted,
        // not a reactor tick later.
        let mut one = region.lease(512 << 10..(512 << 10) + 4096).unwrap();
        fill(&mut one, 20);
        let (r, _one) = remote.write(512 << 10, one, 3).await;
        assert_eq!(r.unwrap(), 4096);
        let s = init.stats();
        assert_eq!((s.posted, s.doorbells, s.immediate), (1, 1, 1), "{s:?}");
        let before = s;
        let mut src = region.lease(0..256 << 10).unwrap();
        fill(&mut src, 21);
        let (r, src) = remote.write(0, src, 1).await;
        assert_eq!(r.unwrap(), 256 << 10);
        let mut landed = vec![0u8; 256 << 10];
        assert!(kv.read_at(0, &mut landed));
        assert!(landed == src[..], "a 64-request write did not land whole");
        let s = init.stats();
        let (posted, completed, reaped, doorbells) = (
            s.posted - before.posted,
            s.completed - before.completed,
            s.reaped - before.reaped,
            s.doorbells - before.doorbells,
        );
        assert_eq!((posted, completed, s.in_flight), (64, 64, 0), "{s:?}");
        // One transfer per doorbell here: one completion each. Many
        // requests wait for the tick's doorbell, idle link or not (a large
        // post never runs inside the submitting task's poll).
        assert_eq!(reaped, doorbells, "{s:?}");
        assert_eq!(s.immediate, before.immediate, "{s:?}");
        assert!(
            reaped < posted,
            "every request asked for a completion: {s:?}"
        );

        // 16 requests to a read-only segment: the first is refused, the
        // others flush; the last one's flush resolves the transfer.
        let ro_r = peer.open("ro", ro.token()).await.unwrap();
        drop(src);
        let mut src = region.lease(0..64 << 10).unwrap();
        fill(&mut src, 22);
        let before = init.stats();
        let (r, _src) =
            quiesce_runtime::time::timeout(Duration::from_secs(30), ro_r.write(0, src, 2))
                .await
                .expect("a refused transfer never resolved: a completion was not accounted for");
        assert!(
            matches!(
                r,
                Err(TransferError::RemoteAccess(_) | TransferError::ConnectionLost(_))
            ),
            "{r:?}"
        );
        let mut snap = vec![1u8; 64 << 10];
        assert!(ro.read_at(0, &mut snap));
        assert!(snap.iter().all(|&b| b == 0), "a refused write landed");
        let s = init.stats();
        assert_eq!(s.posted - before.posted, 16, "{s:?}");
        assert_eq!(s.immediate, before.immediate, "{s:?}");
        assert_eq!((s.in_flight, s.posted), (0, s.completed), "{s:?}");
    });
}

/// More requests than the completion queue holds: they are posted as
/// completions make room (several doorbells), never overflowing it.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn requests_beyond_the_completion_queue_wait_for_room() {
    Runtime::new().unwrap().block_on(async {
        let (target, kv) = kv_target(1 << 20);
        let Sliced {
            init,
            region,
            _reg,
            peer: _peer,
            remote,
        } = Sliced::connect(&target, &kv, Some(8)).await;
        let mut src = region.lease(0..256 << 10).unwrap();
        fill(&mut src, 11);
        // 64 requests of 4 KiB. An overflowed CQ loses completions: the
        // transfer would never resolve, hence the timeout.
        let (r, src) =
            quiesce_runtime::time::timeout(Duration::from_secs(30), remote.write(0, src, 1))
                .await
                .expect("the CQ overflowed: completions were lost");
        assert_eq!(r.unwrap(), 256 << 10);
        let mut landed = vec![0u8; 256 << 10];
        kv.read_at(0, &mut landed);
        assert!(landed == src[..]);
        let s = init.stats();
        assert_eq!((s.posted, s.completed, s.in_flight), (64, 64, 0), "{s:?}");
        assert!(
            s.doorbells >= 2,
            "64 requests cannot fit one small CQ: {s:?}"
        );
    });
}

/// The device's resource counts (`rdma resource show`: pd, cq, qp, mr).
fn device_resources() -> Vec<(String, u64)> {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .expect("iproute2's rdma tool in the guest");
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = text.split_whitespace().collect();
    ["pd", "cq", "qp", "mr"]
        .iter()
        .filter_map(|k| {
            let i = words.iter().position(|w| w == k)?;
            Some((k.to_string(), words.get(i + 1)?.parse().ok()?))
        })
        .collect()
}

/// Engines dropped without `shutdown()` (after a transfer, with their peer,
/// segment and region handles gone too) give every device resource back:
/// protection domains, completion queues, queue pairs, memory regions.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn engines_dropped_without_shutdown_release_their_device_resources() {
    let before = device_resources();
    assert_eq!(before.len(), 4, "rdma resource show: {before:?}");
    Runtime::new().unwrap().block_on(async {
        let p = pair(1 << 20, 1 << 20).await;
        let mut src = p.region.lease(0..4096).unwrap();
        fill(&mut src, 3);
        let (r, _) = p.remote.write(0, src, 1).await;
        r.unwrap();
        assert_ne!(device_resources(), before, "the engines hold resources");
        drop(p);
        sleep(Duration::from_millis(300)).await;
        assert_eq!(
            device_resources(),
            before,
            "dropped engines still hold device resources"
        );
    });
}

/// Writes `l` filled with `seed` as batch `seed`, opening "kv" again (on a
/// new control connection, once the target closed the old one) until the
/// target serves it; gives `l` back.
async fn served_again(p: &Pair, mut l: Lease, seed: u8) -> Lease {
    let t0 = Instant::now();
    loop {
        fill(&mut l, seed);
        let done = match p.remote.peer().open("kv", p.kv.token()).await {
            Ok(fresh) => {
                let (r, back) = fresh.write(0, l, u64::from(seed)).await;
                l = back;
                r.is_ok()
            }
            Err(_) => false,
        };
        if done {
            return l;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "never served again");
        sleep(Duration::from_millis(50)).await;
    }
}
