//! A randomized soak against a target process: mixed batches (1-64 tasks,
//! 1 B-4 MiB, reads and writes, some refused), random policies, deadlines
//! and graces, and connections torn down at random moments. Every batch must
//! reach an outcome, every -2 ticket must drain, and every buffer must come
//! back, while the target keeps running.

use std::path::Path;
use std::time::Duration;

use quiesce::batch::sim::Rng;
use quiesce::batch::{Batch, BatchOptions, FailurePolicy, Outcome, RemoteRange, Tcp};
use quiesce::runtime::{spawn_local, time, Runtime};
use quiesce::target_child::TargetChild;
use quiesce::transports::{Engine, EngineConfig};

const KV: usize = 64 << 20;
/// Bytes one batch may move, so 64 tasks of 4 MiB stay within memory.
const BATCH_BYTES: u64 = 48 << 20;
/// An outcome comes within deadline + grace + this (peers reconnect, etc.).
const SLACK: Duration = Duration::from_secs(5);

#[test]
fn two_hundred_random_batches_with_aborts_all_resolve_and_drain() {
    let t = TargetChild::spawn(Path::new(env!("CARGO_BIN_EXE_quiesce")), KV, false).unwrap();
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(EngineConfig::default()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let kv = peer.open("kv", t.tokens["kv"]).await.unwrap();
        let ro = peer.open("ro", t.tokens["ro"]).await.unwrap();
        let wo = peer.open("wo", t.tokens["wo"]).await.unwrap();
        let mut rng = Rng::new(0x50a4);
        let (mut unknown, mut aborted, mut failed) = (0, 0, 0);
        for round in 0..200 {
            let grace = Duration::from_millis(rng.below(50));
            let mut opts = BatchOptions::default()
                .policy(if rng.chance(50) {
                    FailurePolicy::FailFast
                } else {
                    FailurePolicy::Drain
                })
                .fence_grace(grace)
                .retry(rng.below(2) as u32, Duration::from_millis(1));
            let deadline = rng.chance(40).then(|| Duration::from_millis(rng.below(30)));
            if let Some(d) = deadline {
                opts = opts.deadline(d);
            }
            let mut batch = Batch::new(Tcp, opts);
            let (n, mut bytes) = (1 + rng.below(64), 0);
            for _ in 0..n {
                let max = match rng.below(3) {
                    0 => 64,
                    1 => 64 << 10,
                    _ => 4 << 20,
                };
                let len = 1 + rng.below(max);
                if bytes + len > BATCH_BYTES {
                    break;
                }
                bytes += len;
                let off = rng.below(KV as u64 - len);
                let buf = vec![round as u8; len as usize];
                let added = match rng.below(20) {
                    // Refused by the target: writes to read-only, reads of write-only.
                    0 => batch.write(buf, RemoteRange::new(&ro, 0, len.min(4096))),
                    1 => batch.read(buf, RemoteRange::new(&wo, 0, len.min(4096))),
                    2..=10 => batch.write(buf, RemoteRange::new(&kv, off, len)),
                    _ => batch.read(buf, RemoteRange::new(&kv, off, len)),
                };
                // A length that does not match the range is a typed refusal
                // that hands the buffer back; the batch goes on without it.
                if let Err(r) = added {
                    assert_eq!(r.buf.len() as u64, len);
                }
            }
            let tasks = batch.len();
            let sub = spawn_local(batch.submit());
            if rng.chance(30) {
                time::sleep(Duration::from_micros(rng.below(3000))).await;
                peer.abort();
                aborted += 1;
            }
            let limit = deadline.unwrap_or(Duration::ZERO) + grace + SLACK;
            let outcome = time::timeout(limit, sub)
                .await
                .unwrap_or_else(|_| panic!("round {round}: no outcome within {limit:?}"))
                .unwrap();
            let q = match outcome {
                Outcome::Quiesced(q) => q,
                Outcome::CompletionUnknown(ticket) => {
                    unknown += 1;
                    ticket.wait_for(SLACK).await.unwrap_or_else(|_| {
                        panic!("round {round}: the ticket never drained though the target runs")
                    })
                }
            };
            failed += !q.all_completed() as u32;
            assert_eq!(q.buffers().len(), tasks, "round {round}: every buffer comes back");
        }
        eprintln!("200 batches: {aborted} aborted, {failed} failed, {unknown} were -2 first; all resolved");
        e.shutdown();
    });
}
