//! The counting allocator counts what this process allocates and frees.
//!
//! Its own `main` (`harness = false`): the counters are process-wide, and
//! libtest's main thread allocates while a test runs, which made the exact
//! equalities below flaky under load.

use quiesce_runtime::heap::{CountingAlloc, Heap};

#[global_allocator]
static HEAP: CountingAlloc = CountingAlloc;

fn main() {
    counts_allocations_frees_and_live_bytes();
    println!("test counts_allocations_frees_and_live_bytes ... ok");
}

fn counts_allocations_frees_and_live_bytes() {
    let before = Heap::now();
    let v: Vec<u8> = Vec::with_capacity(1 << 20);
    let mid = Heap::now();
    assert_eq!(mid.allocations - before.allocations, 1);
    assert!(
        mid.live_bytes - before.live_bytes >= 1 << 20,
        "{before:?} → {mid:?}"
    );
    drop(std::hint::black_box(v));
    let after = Heap::now();
    assert_eq!(after.frees - before.frees, 1);
    assert_eq!(after.live_bytes, before.live_bytes);
    assert_eq!(after.live(), before.live());
}
