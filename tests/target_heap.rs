//! The target's data path allocates nothing per request once warm: a
//! `quiesce target` process, 4 KiB and 64 KiB writes and reads through the
//! batch API, and the target's own heap counters (its `heap` stdin command)
//! around them. Counts, not times: the machine's noise cannot move them.

use std::path::Path;

use quiesce::batch::{Batch, BatchOptions, RemoteRange, Tcp};
use quiesce::runtime::Runtime;
use quiesce::target_child::TargetChild;
use quiesce::transports::{AlignedBuf, Engine, EngineConfig};

const WRITES: u64 = 500;

#[test]
fn a_warm_target_allocates_nothing_per_write_or_read() {
    let mut t =
        TargetChild::spawn(Path::new(env!("CARGO_BIN_EXE_quiesce")), 1 << 20, false).unwrap();
    // What one `heap` command costs the target itself: the least of a few
    // (the first may include a one-off, which would make a later count
    // look negative).
    let mut last = t.heap().unwrap().2;
    let mut probe = u64::MAX;
    for _ in 0..3 {
        let now = t.heap().unwrap().2;
        probe = probe.min(now - last);
        last = now;
    }
    let rt = Runtime::new().unwrap();
    let (e, kv) = rt.block_on(async {
        let e = Engine::bind(EngineConfig::default()).unwrap();
        let peer = e.connect(t.addr).await.unwrap();
        let kv = peer.open("kv", t.tokens["kv"]).await.unwrap();
        (e, kv)
    });
    for (size, write) in [
        (4usize << 10, true),
        (64 << 10, true),
        (4 << 10, false),
        (64 << 10, false),
    ] {
        let mut buf = AlignedBuf::from_slice(&vec![5u8; size]);
        let run = |n: u64, buf: AlignedBuf| {
            rt.block_on(async {
                let mut buf = buf;
                for _ in 0..n {
                    let mut b = Batch::new(Tcp, BatchOptions::default());
                    let range = RemoteRange::new(&kv, 0, size as u64);
                    match write {
                        true => b.write(buf, range),
                        false => b.read(buf, range),
                    }
                    .ok()
                    .unwrap();
                    let q = b.submit().await.quiesced().await;
                    assert!(q.all_completed(), "{:?}", q.tasks());
                    buf = q.into_buffers().next_back().unwrap();
                }
                buf
            })
        };
        // Warm: pools, slabs and maps reach their working sizes.
        buf = run(100, buf);
        let before = t.heap().unwrap().2;
        run(WRITES, buf);
        let made = t.heap().unwrap().2.saturating_sub(before + probe);
        // A handful for the odd map growth is not per write; one per write
        // (an Rc, a Vec, a boxed future) would be WRITES.
        assert!(
            made < WRITES / 10,
            "{size}-byte {}: the target made {made} allocations for {WRITES} of them",
            if write { "writes" } else { "reads" }
        );
    }
    rt.block_on(async { e.shutdown() });
}
