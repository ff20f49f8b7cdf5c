//! The cluster tests' hosts, etcd, targets and one-transfer helpers.

use std::time::{Duration, Instant};

use quiesce::batch::{Batch, BatchOptions, RemoteRange, Tcp};
use quiesce::cluster::Cluster;
use quiesce::directory::{Directory, LocalEtcd};
use quiesce::runtime::time;
use quiesce::scenario::Bufs;
use quiesce::target_child::TargetChild;
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, RemoteSegment};

pub(crate) const BIG: usize = 64 << 20;
pub(crate) const TTL: u64 = 2;
pub(crate) const ETCD: usize = 0;
pub(crate) const TARGET_A: usize = 1;
pub(crate) const TARGET_B: usize = 2;
pub(crate) const INITIATOR: usize = 3;
pub(crate) const INITIATOR_2: usize = 4;

/// Five hosts, where this process may build them and etcd is installed.
pub(crate) fn cluster() -> Option<Cluster> {
    hosts(5, true)
}

/// Two hosts and no etcd.
pub(crate) fn two_hosts() -> Option<Cluster> {
    hosts(2, false)
}

/// `n` hosts, where this process may build them (and etcd is installed,
/// if `etcd`); `None`, saying so, where not — never under `CI=true`.
pub(crate) fn hosts(n: usize, etcd: bool) -> Option<Cluster> {
    if !Cluster::available() || (etcd && !LocalEtcd::available()) {
        assert!(
            std::env::var("CI").is_err(),
            "CI must run the cluster tests: they need root, iproute2, tc, nft, iptables and etcd-server"
        );
        eprintln!("skipped: needs root, iproute2, tc, nft, iptables and etcd-server");
        return None;
    }
    Some(Cluster::new(n).expect("build the cluster"))
}

/// etcd on its own host, started from a thread already inside the cluster
/// (its health is checked from there); the directory URL for `prefix`.
pub(crate) fn etcd(c: &Cluster, prefix: &str) -> (LocalEtcd, String) {
    let ip = c.hosts[ETCD].ip;
    let wrapper = ["ip", "netns", "exec", c.hosts[ETCD].netns.as_str()];
    let e = LocalEtcd::start_with(ip, 2379, 2380, &wrapper).expect("etcd on its host");
    (e, format!("etcd://{ip}:2379/{prefix}"))
}

pub(crate) fn target(c: &Cluster, host: usize, node: &str, url: &str) -> TargetChild {
    let mut launcher = c.launcher(host);
    launcher
        .env("QUIESCE_DIRECTORY_TTL", TTL.to_string())
        .arg(env!("CARGO_BIN_EXE_quiesce"));
    let listen = format!("{}:7000", c.hosts[host].ip);
    TargetChild::spawn_command(
        launcher,
        BIG,
        false,
        &["--listen", &listen, "--directory", url, "--node", node],
    )
    .expect("a target on its host")
}

pub(crate) async fn open(
    e: &Engine,
    dir: &Directory,
    node: &str,
    t: &TargetChild,
    name: &str,
) -> RemoteSegment {
    // After a partition the target's lease may have run out while its
    // keep-alives sat behind TCP's backed-off retransmissions; its session
    // publishes again once etcd answers. Wait for that (DESIGN §15.3).
    let since = Instant::now();
    let addr = loop {
        match dir.resolve(node) {
            Ok(r) => break r.addr,
            Err(_) if since.elapsed() < Duration::from_secs(TTL + 5) => {
                time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the target is not back in the directory: {e}"),
        }
    };
    if since.elapsed() > Duration::from_millis(100) {
        eprintln!(
            "{node} was back in the directory after {:?}",
            since.elapsed()
        );
    }
    assert_eq!(addr, t.addr);
    e.connect(addr)
        .await
        .unwrap()
        .open(name, t.tokens[name])
        .await
        .unwrap()
}

pub(crate) fn engine() -> Engine {
    Engine::bind(EngineConfig {
        listen: "0.0.0.0:0".parse().unwrap(),
        ..Default::default()
    })
    .unwrap()
}

pub(crate) fn bufs() -> Bufs<AlignedBuf> {
    Bufs {
        big: AlignedBuf::new(BIG),
        probe: AlignedBuf::new(4096),
        scratch: AlignedBuf::new(8 << 20),
    }
}

pub(crate) async fn one_write(kv: &RemoteSegment, len: usize, byte: u8) -> (bool, Duration) {
    let mut b = Batch::new(
        Tcp,
        BatchOptions::default().deadline(Duration::from_secs(60)),
    );
    b.write(vec![byte; len], RemoteRange::new(kv, 0, len as u64))
        .ok()
        .unwrap();
    let t0 = Instant::now();
    let q = b.submit().await.quiesced().await;
    (q.all_completed(), t0.elapsed())
}

pub(crate) async fn one_read(kv: &RemoteSegment, len: usize) -> (bool, Duration) {
    let mut b = Batch::new(
        Tcp,
        BatchOptions::default().deadline(Duration::from_secs(60)),
    );
    b.read(vec![0u8; len], RemoteRange::new(kv, 0, len as u64))
        .ok()
        .unwrap();
    let t0 = Instant::now();
    let q = b.submit().await.quiesced().await;
    (q.all_completed(), t0.elapsed())
}

/// How many of `kv`'s first 64 MiB are `byte` (read back 8 MiB at a time).
pub(crate) async fn bytes_equal(kv: &RemoteSegment, byte: u8) -> usize {
    quiesce::scenario::count_remote(kv, BIG as u64, byte, AlignedBuf::new(8 << 20))
        .await
        .0
}

pub(crate) fn filled(byte: u8) -> AlignedBuf {
    let mut b = AlignedBuf::new(BIG);
    b.fill(byte);
    b
}

pub(crate) fn gbps(len: usize, d: Duration) -> f64 {
    len as f64 * 8.0 / d.as_secs_f64() / 1e9
}

/// Polls two futures to completion on this task.
pub(crate) async fn futures_join<A: std::future::Future, B: std::future::Future>(
    a: A,
    b: B,
) -> (A::Output, B::Output) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    let (mut ra, mut rb) = (None, None);
    std::future::poll_fn(|cx| {
        if ra.is_none() {
            if let std::task::Poll::Ready(v) = a.as_mut().poll(cx) {
                ra = Some(v);
            }
        }
        if rb.is_none() {
            if let std::task::Poll::Ready(v) = b.as_mut().poll(cx) {
                rb = Some(v);
            }
        }
        if ra.is_some() && rb.is_some() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    (ra.unwrap(), rb.unwrap())
}
