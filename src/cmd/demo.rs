//! `quiesce demo`: the seed scenario against a target process on loopback.

use std::time::Duration;

use quiesce::runtime::Runtime;
use quiesce::scenario::{seed_options, write_round, Buf, Bufs, Kind, Remote, Round, Seg};
use quiesce::target_child::TargetChild;
use quiesce::transports::rdma::{RdmaConfig, RdmaEngine};
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, Region};

/// Runs `rounds` write rounds over `remote`.
async fn rounds<S: Seg, B: Buf>(remote: &Remote<S>, mut bufs: Bufs<B>, rounds: u32) -> Vec<Round> {
    let mut results = Vec::new();
    for round in 0..rounds {
        let (r, b) = write_round(
            remote,
            bufs,
            round,
            seed_options(),
            Duration::from_millis(20),
        )
        .await;
        bufs = b;
        results.push(r);
    }
    results
}

/// Runs the scenario; `Ok(true)` if no round was corrupted.
pub fn run(rounds_n: u32, size: usize, rdma: bool) -> Result<bool, Box<dyn std::error::Error>> {
    let target = TargetChild::spawn(&std::env::current_exe()?, size, rdma)?;
    println!(
        "quiesce demo: target on {} (separate process, {}), {rounds_n} rounds",
        target.addr,
        if rdma { "RDMA verbs" } else { "TCP" }
    );
    println!(
        "each round: batch [4 KiB write the target refuses, valid {} MiB write], fail-fast;",
        size >> 20
    );
    println!("then the returned source is overwritten and the destination checked for it.");
    let rt = Runtime::new()?;
    let (results, driver) = rt.block_on(async {
        let results = if rdma {
            let engine = RdmaEngine::bind(RdmaConfig::default())?;
            let piece = size.min(8 << 20);
            let region = Region::new(size + 4096 + piece);
            let _registration = engine.register_region(&region)?;
            let peer = engine.connect(target.addr).await?;
            let remote = Remote {
                kv: peer.open("kv", target.tokens["kv"]).await?,
                refuse: peer.open("ro", target.tokens["ro"]).await?,
            };
            let bufs = Bufs {
                big: region.lease(0..size)?,
                probe: region.lease(size..size + 4096)?,
                scratch: region.lease(size + 4096..size + 4096 + piece)?,
            };
            let results = rounds(&remote, bufs, rounds_n).await;
            engine.shutdown(Duration::from_secs(5));
            results
        } else {
            let engine = Engine::bind(EngineConfig {
                node: "quiesce-demo".into(),
                ..Default::default()
            })?;
            let peer = engine.connect(target.addr).await?;
            let remote = Remote {
                kv: peer.open("kv", target.tokens["kv"]).await?,
                refuse: peer.open("ro", target.tokens["ro"]).await?,
            };
            let bufs = Bufs {
                big: AlignedBuf::new(size),
                probe: AlignedBuf::new(4096),
                scratch: AlignedBuf::new(size.min(8 << 20)),
            };
            let results = rounds(&remote, bufs, rounds_n).await;
            engine.shutdown();
            results
        };
        Ok::<_, Box<dyn std::error::Error>>((results, quiesce::runtime::stats()))
    })?;
    let rounds = rounds_n;
    let corrupted = results.iter().filter(|r| r.corrupted_bytes > 0).count();
    let count = |k: Kind| results.iter().filter(|r| r.kind == k).count();
    let mut times: Vec<Duration> = results.iter().map(|r| r.time_to_safe).collect();
    times.sort();
    let pct = |p: f64| times[((times.len() - 1) as f64 * p) as usize];
    println!(
        "outcomes: failed (-1, buffers back) {}, completion unknown (-2) {}, completed (0) {}",
        count(Kind::Failed),
        count(Kind::Unknown),
        count(Kind::Completed)
    );
    println!(
        "time to a safe outcome: p50 {:.2} ms, max {:.2} ms (driver: {} ops submitted)",
        pct(0.5).as_secs_f64() * 1e3,
        pct(1.0).as_secs_f64() * 1e3,
        driver.ops_submitted
    );
    println!("corrupted: {corrupted}/{rounds}");
    Ok(corrupted == 0)
}
