//! The counting allocator counts what this thread allocates and frees.

use quiesce_runtime::heap::{CountingAlloc, Heap};

#[global_allocator]
static HEAP: CountingAlloc = CountingAlloc;

#[test]
fn counts_allocations_frees_and_live_bytes() {
    // One test in this binary: no other thread allocates meanwhile (the
    // harness's own threads are idle while it runs).
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
