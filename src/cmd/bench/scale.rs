//! `quiesce bench --scale`: what many transfers at once cost, against a
//! `quiesce target` process on loopback.
//!
//! 1. **1,000 batches in flight on one shard**: 1,000 single-task 4 KiB
//!    write batches submitted before any is awaited; the heap each in-flight
//!    batch holds beyond its 4 KiB source (the binary's counting allocator),
//!    and batches per second until all drained.
//! 2. **16 concurrent 64 MiB writes on one shard**, each a batch of its own,
//!    against one 64 MiB write alone: aggregate throughput and the ratio.
//! 3. **Two shards on two cores**, each with its own engine and connection,
//!    writing 64 MiB batches back to back for a while, against one shard
//!    doing the same: aggregate throughput and the ratio.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use quiesce::batch::{Batch, BatchOptions, RemoteRange, Submitted, Tcp};
use quiesce::runtime::heap::Heap;
use quiesce::runtime::shard::Shards;
use quiesce::runtime::{IoBufMut, Runtime};
use quiesce::target_child::TargetChild;
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, RemoteSegment, Token};

const IN_FLIGHT: usize = 1000;
const SMALL: usize = 4096;
const BIG: usize = 64 << 20;
const CONCURRENT: usize = 16;
/// How long each shard configuration writes in a turn of part 3.
const SHARD_RUN: Duration = Duration::from_secs(2);
/// Turns of each configuration in parts 2 and 3.
const ROUNDS: usize = 3;

/// An engine on this thread's runtime and the target's `kv`.
async fn open(
    addr: SocketAddr,
    token: Token,
) -> Result<(Engine, RemoteSegment), Box<dyn std::error::Error>> {
    let e = Engine::bind(EngineConfig::default())?;
    let kv = e.connect(addr).await?.open("kv", token).await?;
    Ok((e, kv))
}

/// A batch of one write of all of `src` at `at`, submitted (in flight).
fn submit_write<B: IoBufMut>(kv: &RemoteSegment, src: B, at: u64) -> Submitted<B> {
    let n = src.bytes_init() as u64;
    let mut b = Batch::new(
        Tcp,
        BatchOptions::default().deadline(Duration::from_secs(60)),
    );
    b.write(src, RemoteRange::new(kv, at, n))
        .map_err(|r| r.reason)
        .expect("a valid task");
    b.submit()
}

/// One batch writing `src` at `at`; whether it completed.
async fn write_one(kv: &RemoteSegment, src: AlignedBuf, at: u64) -> (bool, AlignedBuf) {
    let q = submit_write(kv, src, at).await.quiesced().await;
    let ok = q.all_completed();
    (ok, q.into_buffers().next_back().expect("its buffer"))
}

fn gbs(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Runs the three parts; `Ok(false)` if a transfer failed.
pub fn scale() -> Result<bool, Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let target = TargetChild::spawn(&exe, CONCURRENT * BIG, false)?;
    let (addr, token) = (target.addr, target.tokens["kv"]);
    println!("quiesce bench --scale: target {addr} (its own process), loopback TCP, io_uring or QUIESCE_DRIVER");
    let rt = Runtime::new()?;
    let mut ok = true;
    ok &= rt.block_on(async {
        let (e, kv) = open(addr, token).await?;
        // Warm: the connections, the pools, the allocator's arenas.
        for i in 0..200u64 {
            let (done, _) = write_one(&kv, AlignedBuf::new(SMALL), i * SMALL as u64).await;
            if !done {
                return Err("a warm-up write failed".into());
            }
        }
        let sources: Vec<Vec<u8>> = (0..IN_FLIGHT).map(|i| vec![i as u8; SMALL]).collect();
        let h0 = Heap::now();
        let t0 = Instant::now();
        let mut flying = Vec::with_capacity(IN_FLIGHT);
        for (i, src) in sources.into_iter().enumerate() {
            flying.push(submit_write(&kv, src, (i * SMALL) as u64));
        }
        // Nothing was awaited yet: every batch is in flight.
        let h1 = Heap::now();
        let mut done = 0;
        for s in flying {
            done += s.await.quiesced().await.all_completed() as usize;
        }
        let took = t0.elapsed();
        let per = (h1.live_bytes - h0.live_bytes) as f64 / IN_FLIGHT as f64;
        let allocs = (h1.allocations - h0.allocations) as f64 / IN_FLIGHT as f64;
        println!(
            "1. {IN_FLIGHT} × 4 KiB write batches in flight on one shard: {done}/{IN_FLIGHT} completed, \
             {:.0} batches/s; heap per in-flight batch {per:.0} B ({allocs:.1} allocations; its 4 KiB \
             source was allocated before)",
            IN_FLIGHT as f64 / took.as_secs_f64()
        );
        if per <= 0.0 {
            println!("   (heap counters read zero: the counting allocator is not installed)");
        }
        // One alone and the 16 together take turns (this VM's speed swings
        // between runs; each pair sees the same machine), best of
        // [`ROUNDS`] each. The first turn of the 16 also faults in the
        // target's 1 GiB that the one alone never touches.
        let mut one = AlignedBuf::new(BIG);
        let mut srcs: Vec<AlignedBuf> = (0..CONCURRENT).map(|_| AlignedBuf::new(BIG)).collect();
        let (mut alone, mut together, mut all) = (Duration::MAX, Duration::MAX, 0);
        for _ in 0..ROUNDS {
            let t = Instant::now();
            let (done, back) = write_one(&kv, one, 0).await;
            alone = alone.min(t.elapsed());
            one = back;
            if !done {
                return Err("a 64 MiB write failed".into());
            }
            let t = Instant::now();
            let mut flying = Vec::with_capacity(CONCURRENT);
            for (i, src) in srcs.into_iter().enumerate() {
                flying.push(submit_write(&kv, src, (i * BIG) as u64));
            }
            let (mut back, mut completed) = (Vec::with_capacity(CONCURRENT), 0);
            for s in flying {
                let q = s.await.quiesced().await;
                completed += q.all_completed() as usize;
                back.extend(q.into_buffers());
            }
            together = together.min(t.elapsed());
            all = completed;
            srcs = back;
            if completed < CONCURRENT {
                break;
            }
        }
        println!(
            "2. {CONCURRENT} concurrent 64 MiB writes, one shard: {all}/{CONCURRENT} completed, \
             {:.2} GB/s aggregate; one alone {:.2} GB/s (best of {ROUNDS}, in turns): {:.2}×",
            gbs(CONCURRENT * BIG, together),
            gbs(BIG, alone),
            gbs(CONCURRENT * BIG, together) / gbs(BIG, alone)
        );
        e.shutdown();
        Ok::<_, Box<dyn std::error::Error>>(done == IN_FLIGHT && all == CONCURRENT)
    })?;
    // One shard and two take turns, best of [`ROUNDS`] each.
    let (mut one, mut two, mut failed) = (0f64, 0f64, false);
    for _ in 0..ROUNDS {
        let (a, b) = (shards(1, addr, token)?, shards(2, addr, token)?);
        // A round with a failed write says 0: the best of the others must
        // not hide it.
        failed |= a == 0.0 || b == 0.0;
        one = one.max(a);
        two = two.max(b);
    }
    println!(
        "3. 64 MiB writes back to back, {} s a turn: one shard {:.2} GB/s; two shards on two \
         cores, an engine each, {:.2} GB/s aggregate (best of {ROUNDS}, in turns): {:.2}× (the \
         target is one engine on the same two cores)",
        SHARD_RUN.as_secs(),
        one,
        two,
        two / one
    );
    ok &= !failed;
    Ok(ok)
}

/// `n` pinned shards, each with its own engine and connection, writing
/// 64 MiB batches into its own part of `kv` for [`SHARD_RUN`]; aggregate
/// GB/s (0 if a write failed).
fn shards(n: usize, addr: SocketAddr, token: Token) -> Result<f64, Box<dyn std::error::Error>> {
    let shards = Shards::builder()
        .count(n)
        .pin(true)
        .spawn(move |shard| async move {
            let Ok((e, kv)) = open(addr, token).await else {
                return None;
            };
            let at = (shard.index() * BIG) as u64;
            let mut src = AlignedBuf::new(BIG);
            let (t0, mut bytes) = (Instant::now(), 0usize);
            while t0.elapsed() < SHARD_RUN {
                let (done, back) = write_one(&kv, src, at).await;
                if !done {
                    return None;
                }
                src = back;
                bytes += BIG;
            }
            let took = t0.elapsed();
            e.shutdown();
            Some((bytes, took))
        })?;
    let mut total = 0.0;
    for r in shards.shutdown() {
        match r {
            Ok(Some((bytes, took))) => total += gbs(bytes, took),
            _ => return Ok(0.0),
        }
    }
    Ok(total)
}
