//! Memory the caller owns, lent to the engine as a segment: remote writes
//! land in it, and it is handed back (`on_release`) only when nothing can
//! touch it — not while a write is still landing, even after deregistration.

mod common;

use std::cell::Cell;
use std::rc::Rc;
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use quiesce_runtime::time::sleep;
use quiesce_runtime::Runtime;
use quiesce_transports::wire::{Header, Opcode};
use quiesce_transports::{Engine, ForeignMemory, Rights};

const LEN: usize = 1 << 20;

/// A write that is landing holds the memory: deregistering (and dropping
/// every handle) does not hand it back; revoking the segment first cancels
/// the write, and the memory comes back once its receive is reaped. The
/// bytes of the completed write are in the caller's memory.
#[test]
fn foreign_memory_comes_back_only_when_no_write_can_land() {
    let mut owned = vec![0u8; LEN].into_boxed_slice();
    let ptr = owned.as_mut_ptr();
    let released = Rc::new(Cell::new(false));
    Runtime::new().unwrap().block_on(async {
        let engine = Engine::bind(tcp()).unwrap();
        let r = released.clone();
        // `owned` is dropped after `block_on` returns, and the assertions
        // below check that `on_release` ran before.
        // SAFETY: `owned` outlives the lending; nothing else writes it.
        let mem = unsafe { ForeignMemory::new(ptr, LEN, move || r.set(true)) };
        let seg = engine
            .register("kv", mem, Rights::READ | Rights::WRITE)
            .unwrap();
        assert_eq!(seg.base(), ptr as u64);
        let (addr, id, token) = (engine.local_addr(), seg.id(), seg.token());

        // A peer that writes 4 KiB whole, then starts 64 KiB and stalls.
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (sent_tx, sent_rx) = mpsc::channel::<()>();
        let peer = std::thread::spawn(move || {
            let mut c = RawClient::connect(addr);
            assert_eq!(
                c.auth_status(id, token),
                quiesce_transports::wire::Status::Ok
            );
            let write = |offset: u64, len: u64| Header {
                batch: 1,
                task: 1,
                segment: id,
                offset,
                length: len,
                ..Header::new(Opcode::Write)
            };
            c.send(&write(0, 4096), &pattern(4096, 7));
            let st = c.recv().expect("a status");
            assert_eq!(st.length, 4096);
            c.send(&write(8192, 64 << 10), &pattern(1000, 8));
            sent_tx.send(()).unwrap();
            let _ = go_rx.recv();
            drop(c);
        });
        while sent_rx.try_recv().is_err() {
            sleep(Duration::from_millis(1)).await;
        }
        sleep(Duration::from_millis(50)).await;
        assert_eq!(engine.stats().bytes_landed, 4096);

        // Deregistered, every handle gone: the landing write still holds it.
        let revoker = seg.clone();
        assert!(engine.deregister(id));
        drop(seg);
        sleep(Duration::from_millis(50)).await;
        assert!(!released.get(), "handed back while a write was landing");

        // The owner's revoke cancels the write; once reaped, it comes back.
        revoker.revoke(0..LEN as u64).await.unwrap();
        drop(revoker);
        for _ in 0..100 {
            if released.get() {
                break;
            }
            sleep(Duration::from_millis(5)).await;
        }
        assert!(released.get(), "not handed back once nothing could land");
        go_tx.send(()).unwrap();
        peer.join().unwrap();
        engine.shutdown();
    });
    assert!(released.get());
    assert!(
        owned[..4096] == pattern(4096, 7)[..],
        "the write's bytes are not in the caller's memory"
    );
}
