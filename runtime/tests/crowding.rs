//! A spinning reactor whose core another thread keeps taking moves itself
//! to another core (runtime/src/crowding.rs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use quiesce_runtime::shard::channel;
use quiesce_runtime::{stats, Runtime};

/// The cores this thread may run on.
fn allowed() -> libc::cpu_set_t {
    // SAFETY: an all-zero cpu_set_t is an empty set; the call fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is live and its size is passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(r, 0);
    set
}

fn set_affinity(set: &libc::cpu_set_t) {
    // SAFETY: `set` is live and its size is passed.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) };
    assert_eq!(r, 0);
}

fn only(core: usize) -> libc::cpu_set_t {
    // SAFETY: as in `allowed`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET writes into the live set; `core` is below CPU_SETSIZE.
    unsafe { libc::CPU_SET(core, &mut set) };
    set
}

fn current_core() -> usize {
    // SAFETY: no arguments.
    let c = unsafe { libc::sched_getcpu() };
    usize::try_from(c).expect("sched_getcpu")
}

/// Two threads that yield in a loop, pinned to `core`.
fn crowd(core: usize, stop: &Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                set_affinity(&only(core));
                while !stop.load(Ordering::Relaxed) {
                    std::thread::yield_now();
                }
            })
        })
        .collect()
}

/// A reactor spinning on a core where two other threads take turns with it
/// moves to another core its affinity allows — and keeps that affinity —
/// within the 300 ms it waits; allowed on that core only, it stays (taking
/// turns is then the fastest hand-over there is).
#[test]
fn a_spinning_reactor_moves_off_a_core_it_shares() {
    let own = allowed();
    // SAFETY: CPU_COUNT and CPU_ISSET read the live set.
    let cores: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &own) })
        .collect();
    let home = cores[0];
    for pinned in [false, true] {
        if !pinned && cores.len() < 2 {
            continue;
        }
        // Start on `home`, with the affinity under test.
        set_affinity(&only(home));
        let rt = Runtime::builder()
            .spin(Duration::from_secs(10))
            .build()
            .expect("runtime");
        let stop = Arc::new(AtomicBool::new(false));
        let hogs = crowd(home, &stop);
        if !pinned {
            set_affinity(&own);
        }
        let (before, after, core) = rt.block_on(async {
            let before = stats();
            let (tx, mut rx) = channel::<u32>();
            let th = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                tx.send(1).unwrap();
            });
            assert_eq!(rx.recv().await, Some(1));
            th.join().unwrap();
            (before, stats(), current_core())
        });
        stop.store(true, Ordering::Relaxed);
        hogs.into_iter().for_each(|h| h.join().unwrap());
        let now = allowed();
        // SAFETY: CPU_EQUAL reads the two live sets.
        let kept = unsafe { libc::CPU_EQUAL(&now, &if pinned { only(home) } else { own }) };
        assert!(kept, "the thread's affinity changed");
        if pinned {
            assert_eq!(after.crowded, before.crowded, "pinned, it moved");
            assert_eq!(core, home);
        } else {
            assert!(after.crowded > before.crowded, "it never moved: {after:?}");
            // Not at every poll: once per 1 ms at most, doubling while moving
            // does not help (here one move frees it).
            assert!(after.crowded - before.crowded <= 30, "{after:?}");
            assert_ne!(core, home, "still on the crowded core");
        }
        set_affinity(&own);
    }
}
