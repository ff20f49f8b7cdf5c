//! The fence table's own tests: entries, carriers, room, and quiet.

use super::*;

/// The table, empty now, holds little room: a burst's was given back.
fn assert_room_given_back(t: &FenceTable) {
    let e = t.inner.borrow();
    assert!(
        e.index.capacity() < 1024 && e.states.capacity() < 1024,
        "index {} states {}",
        e.index.capacity(),
        e.states.capacity()
    );
}

/// A fenced entry keeps the session's connections as carriers, up to
/// its cap of connections each: the table's cap counts them too, or a
/// peer keeping every entry it may (with many connections per session)
/// made each entry dozens of times larger than the cap assumed. They
/// come back as connections forget the batches or close.
#[test]
fn carriers_count_towards_the_table_cap() {
    let t = FenceTable::default();
    for b in 0..10 {
        t.fence(1, b, 0..64);
    }
    assert_eq!(
        t.session_over_cap(1, 1000, 100).map(|(s, n, _)| (s, n)),
        Some((1, 10)),
        "10 entries, under a cap of 100, with 640 carriers"
    );
    for b in 0..10 {
        (0..60).for_each(|c| t.forget(1, b, c));
    }
    assert_eq!(t.session_over_cap(1, 1000, 100), None);
    (60..64).for_each(|c| t.closed(1, c));
    assert_eq!(t.len(), 0);
    assert_eq!(t.inner.borrow().carried, 0);
}

/// A fence is quiet (its `FenceAck` may go) only once every write of
/// its batch that was landing has stopped — writes of other batches,
/// or of the same batch id in another session, do not hold it — and
/// the last one to stop wakes it.
#[test]
fn a_fence_is_quiet_only_once_every_landing_write_of_its_batch_stopped() {
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Wake};
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let woken = Arc::new(Count(AtomicUsize::new(0)));
    let waker = Waker::from(woken.clone());
    let mut cx = Context::from_waker(&waker);
    let t = FenceTable::default();
    let (w1, w2) = (t.begin_write(1, 5), t.begin_write(1, 5));
    let (other_batch, other_session) = (t.begin_write(1, 6), t.begin_write(2, 5));
    t.fence(1, 5, [7]);
    let mut quiet = Box::pin(t.quiet(1, 5));
    assert!(
        quiet.as_mut().poll(&mut cx).is_pending(),
        "two writes landing"
    );
    drop(w1);
    assert!(
        quiet.as_mut().poll(&mut cx).is_pending(),
        "one write landing"
    );
    drop((other_batch, other_session));
    assert!(
        quiet.as_mut().poll(&mut cx).is_pending(),
        "one write landing"
    );
    let before = woken.0.load(Ordering::SeqCst);
    drop(w2);
    assert!(
        woken.0.load(Ordering::SeqCst) > before,
        "the last write did not wake the fence"
    );
    assert!(quiet.as_mut().poll(&mut cx).is_ready());
    // A batch with nothing landing is quiet at once.
    assert!(Box::pin(t.quiet(3, 3)).as_mut().poll(&mut cx).is_ready());
}

/// A burst of fences (a churning or hostile peer) leaves no room
/// behind once its entries go.
#[test]
fn a_burst_of_fences_gives_its_memory_back() {
    let t = FenceTable::default();
    for batch in 0..100_000 {
        t.fence(1, batch, [7]);
    }
    t.closed(1, 7);
    assert_eq!(t.len(), 0);
    assert_room_given_back(&t);
}

/// The same for a burst whose entries went by `Forget` (which does not
/// shrink): the connection's close gives the room back, with nothing of
/// its session left fenced (the close returned early, keeping it).
#[test]
fn a_forgotten_burst_gives_its_memory_back_at_the_close() {
    let t = FenceTable::default();
    for batch in 0..100_000 {
        t.fence(1, batch, [7]);
    }
    for batch in 0..100_000 {
        t.forget(1, batch, 7);
    }
    assert_eq!(t.len(), 0);
    t.closed(1, 7);
    assert_room_given_back(&t);
}

/// A guard's slot names its own entry while other entries come and go
/// (their slots are reused), and entries leave once they say nothing.
#[test]
fn a_guard_keeps_its_entry_while_others_come_and_go() {
    let t = FenceTable::default();
    let g1 = t.begin_write(1, 1);
    t.fence(1, 2, [7]);
    t.forget(1, 2, 7);
    assert_eq!(t.len(), 1, "a fenced batch without carriers goes");
    let g3 = t.begin_write(1, 3); // takes the slot (1, 2) left
    assert!(!g1.fenced() && !g3.fenced());
    t.fence(1, 1, [7]);
    assert!(g1.fenced() && !g3.fenced(), "the fence found its own batch");
    assert!(t.is_fenced(1, 1) && !t.is_fenced(1, 3));
    drop(g3);
    assert_eq!(t.len(), 1, "an unfenced batch goes with its last write");
    drop(g1);
    assert_eq!(
        t.fenced_in(1),
        1,
        "a fenced batch stays while it has carriers"
    );
    t.closed(1, 7);
    assert_eq!(t.len(), 0);
}

/// A guard removes its entry by the hash it kept, also after the index
/// grew under it (entries moved) and with other guards dropped in
/// between; the table ends empty.
#[test]
fn guards_remove_their_entries_by_their_kept_hash_across_growth() {
    let t = FenceTable::default();
    let mut guards: Vec<WriteGuard> = (0..200).map(|b| t.begin_write(b % 3, b)).collect();
    assert_eq!(t.len(), 200);
    t.fence(1, 4, [9]);
    assert!(guards[4].fenced() && !guards[5].fenced());
    // Every other guard first, then the rest from the end.
    let mut odd: Vec<WriteGuard> = Vec::new();
    for (i, g) in guards.drain(..).enumerate() {
        if i % 2 == 1 {
            odd.push(g);
        }
    }
    // The even ones went, but for the fenced batch 4: it has a carrier.
    assert_eq!(t.len(), 101, "dropping a guard removed exactly its entry");
    while let Some(g) = odd.pop() {
        drop(g);
    }
    assert_eq!(t.len(), 1, "only the fenced batch with a carrier stays");
    assert!(t.is_fenced(1, 4) && !t.is_fenced(1, 7));
    t.forget(1, 4, 9);
    assert_eq!(t.len(), 0);
}

/// What a connection's close and a fence's cap check cost depends on
/// the session's own fenced batches, not on the whole table: a peer
/// holding many sessions full of fenced batches (under the caps) made
/// every fence and every close of anyone walk all of them.
#[test]
fn a_close_and_a_cap_check_look_only_at_their_session() {
    let fill = |sessions: u64| {
        let t = FenceTable::default();
        for s in 1..=sessions {
            for batch in 0..4096 {
                t.fence(s, batch, [s as usize]);
            }
        }
        t
    };
    // The fastest of five: noise is slower, never faster.
    let time = |t: &FenceTable| {
        (0..5)
            .map(|_| {
                let t0 = std::time::Instant::now();
                for _ in 0..20 {
                    // Connection 0 carries nothing: nothing changes.
                    t.closed(1, 0);
                    assert!(t.session_over_cap(1, 4096, 1 << 20).is_none());
                }
                t0.elapsed()
            })
            .min()
            .unwrap()
    };
    let (alone, crowded) = (fill(1), fill(64));
    assert_eq!(crowded.len(), 64 * 4096);
    let (a, c) = (time(&alone), time(&crowded));
    assert!(c < 8 * a, "one session alone {a:?}, among 64 {c:?}");
    assert_eq!(crowded.fenced_in(1), 4096);
    crowded.closed(1, 1);
    assert_eq!((crowded.fenced_in(1), crowded.len()), (0, 63 * 4096));
    crowded.end_session(2);
    assert_eq!((crowded.fenced_in(2), crowded.len()), (0, 62 * 4096));
    assert_eq!(crowded.largest_session().map(|(_, n)| n), Some(4096));
}
