//! The sync API on RDMA verbs (what the Python binding's `protocol="rdma"`
//! runs on): lent memory is served over RDMA and registered for local
//! posts; a batch from lent memory lands by peer address; a buffer outside
//! lent memory is refused before anything is posted; the seed scenario's
//! -1 leaves nothing reading the source; reclaim waits until nothing holds
//! the memory. Each test needs a device: `scripts/softroce-vm.sh test` runs
//! them in a guest with Soft-RoCE (they are `#[ignore]`d elsewhere).

use std::time::Duration;

use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{Direction, SyncEngine, SyncTask};
use quiesce_batch::{BatchOptions, FailurePolicy, TaskStatus, SYNC_FAILED, SYNC_OK};
use quiesce_transports::rdma::RdmaConfig;
use quiesce_transports::{Token, TransferError};

const MIB: usize = 1 << 20;

fn engine() -> SyncEngine {
    SyncEngine::start_rdma(RdmaConfig::default(), Duration::from_micros(50)).expect("rdma engine")
}

fn token() -> Token {
    Token::derive(b"a secret both sides hold", "node")
}

/// Memory lent to an engine (a boxed slice that outlives it in each test).
fn lend(e: &SyncEngine, name: &str, mem: &mut [u8]) -> u64 {
    let base = mem.as_mut_ptr() as u64;
    // SAFETY: every test keeps `mem` alive until after the engine stopped or
    // `reclaim` answered true.
    unsafe { e.lend(name, base, mem.len() as u64, token()).unwrap() };
    base
}

fn task(segment: u32, offset: u64, mem: &mut [u8]) -> SyncTask<RawBuf> {
    // SAFETY: the caller's memory outlives the batch (its outcome is 0 or -1
    // in every test, and the engines stop before it is freed).
    let buf = unsafe { RawBuf::new(mem.as_mut_ptr(), mem.len()) };
    SyncTask {
        segment,
        offset,
        buf,
    }
}

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn lent_memory_is_written_and_read_over_rdma_by_peer_address() {
    let (target, init) = (engine(), engine());
    let mut remote = vec![0u8; 4 * MIB].into_boxed_slice();
    let mut local = vec![0x5au8; 2 * MIB].into_boxed_slice();
    let rbase = lend(&target, "kv", &mut remote);
    let lbase = lend(&init, "local", &mut local);
    let at = init
        .open_at(target.local_addr(), rbase + MIB as u64, token())
        .unwrap();
    assert_eq!((at.base, at.len), (rbase, 4 * MIB as u64));
    let first = init.open_first(target.local_addr(), token()).unwrap();
    assert_eq!(first.base, rbase);
    let (src, dst) = local.split_at_mut(MIB);
    let out = init
        .run(
            vec![
                (Direction::Write, task(at.segment, MIB as u64, src)),
                (Direction::Read, task(at.segment, 0, dst)),
            ],
            BatchOptions::default(),
        )
        .unwrap();
    assert_eq!(out.code, SYNC_OK, "{:?}", out.tasks);
    assert_eq!(init.reclaim(lbase, Duration::from_secs(5)), Ok(true));
    assert_eq!(target.reclaim(rbase, Duration::from_secs(5)), Ok(true));
    assert!(remote[MIB..2 * MIB].iter().all(|&b| b == 0x5a));
    assert!(remote[..MIB].iter().all(|&b| b == 0));
    assert!(local[MIB..].iter().all(|&b| b == 0), "the read");
}

#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn a_buffer_outside_lent_memory_is_refused_before_anything_is_posted() {
    let (target, init) = (engine(), engine());
    let mut remote = vec![0u8; MIB].into_boxed_slice();
    let rbase = lend(&target, "kv", &mut remote);
    let at = init.open_at(target.local_addr(), rbase, token()).unwrap();
    let mut stray = vec![7u8; 4096];
    let out = init
        .batch(
            Direction::Write,
            vec![task(at.segment, 0, &mut stray)],
            BatchOptions::default(),
        )
        .unwrap();
    assert_eq!(out.code, SYNC_FAILED);
    assert!(
        matches!(
            out.tasks[0].status,
            TaskStatus::Failed(TransferError::Unregistered { .. })
        ),
        "{:?}",
        out.tasks[0]
    );
    assert!(out.remote_confirmed, "nothing was posted");
    assert_eq!(target.reclaim(rbase, Duration::from_secs(5)), Ok(true));
    assert!(remote.iter().all(|&b| b == 0));
}

/// [4 KiB to a range the target withdrew, 64 MiB valid], fail-fast: -1,
/// then the source is rewritten at once and none of it reaches the target.
#[test]
#[ignore = "needs an RDMA device: scripts/softroce-vm.sh test"]
fn the_seed_scenario_over_rdma_leaves_nothing_reading_the_source() {
    let (target, init) = (engine(), engine());
    let mut small = vec![0u8; 4096].into_boxed_slice();
    let mut big = vec![0u8; 64 * MIB].into_boxed_slice();
    let mut local = vec![0u8; 64 * MIB + 4096].into_boxed_slice();
    let sbase = lend(&target, "small", &mut small);
    let bbase = lend(&target, "big", &mut big);
    let lbase = lend(&init, "local", &mut local);
    let s = init.open_at(target.local_addr(), sbase, token()).unwrap();
    let b = init.open_at(target.local_addr(), bbase, token()).unwrap();
    assert_eq!(target.reclaim(sbase, Duration::from_secs(5)), Ok(true));
    let mut corrupted = 0;
    for _ in 0..5 {
        local.fill(0xaa);
        let (probe, src) = local.split_at_mut(4096);
        let opts = BatchOptions::default()
            .policy(FailurePolicy::FailFast)
            .deadline(Duration::from_secs(10));
        let out = init
            .run(
                vec![
                    (Direction::Write, task(s.segment, 0, probe)),
                    (Direction::Write, task(b.segment, 0, src)),
                ],
                opts,
            )
            .unwrap();
        assert_eq!(out.code, SYNC_FAILED, "{:?}", out.tasks);
        local.fill(0xbb);
        std::thread::sleep(Duration::from_millis(100));
        if big.contains(&0xbb) {
            corrupted += 1;
        }
    }
    assert_eq!(corrupted, 0, "rounds with bytes written after -1");
    assert_eq!(init.reclaim(lbase, Duration::from_secs(5)), Ok(true));
    assert_eq!(target.reclaim(bbase, Duration::from_secs(5)), Ok(true));
}
