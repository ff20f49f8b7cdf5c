//! A lane whose target restarted: it recovers as the engine's thread does.

use std::time::Duration;

use quiesce_batch::sync::SyncEngine;
use quiesce_batch::SYNC_OK;
use quiesce_transports::EngineConfig;

use super::write;

/// What [`target_at`]'s thread is told.
enum Told {
    /// Register `kv` (answered once it is).
    Register(std::sync::mpsc::Sender<()>),
    Stop,
}

/// A target at `addr` (node "again") on a thread of its own, serving `kv`
/// over the `len` bytes at `ptr` with `token` — registered at once if
/// `now`, else when told — until told to stop. Two in a row at one address
/// are one target restarted: same node, segment id, memory and token.
fn target_at(
    addr: std::net::SocketAddr,
    ptr: usize,
    len: usize,
    token: quiesce_transports::Token,
    now: bool,
) -> (std::sync::mpsc::Sender<Told>, std::thread::JoinHandle<()>) {
    use quiesce_transports::{Engine, ForeignMemory, Rights};
    let (tx, rx) = std::sync::mpsc::channel();
    let (up, is_up) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        quiesce_runtime::Runtime::new()
            .unwrap()
            .block_on(async move {
                let cfg = EngineConfig {
                    listen: addr,
                    node: "again".into(),
                    ..EngineConfig::default()
                };
                let e = Engine::bind(cfg).unwrap();
                let register = |e: &Engine| {
                    // SAFETY: the test leaks the memory (it outlives every
                    // engine), and only engines write it.
                    let mem = unsafe { ForeignMemory::new(ptr as *mut u8, len, || {}) };
                    let rw = Rights::READ | Rights::WRITE;
                    e.register_with_token("kv", mem, rw, token).unwrap()
                };
                let mut kv = now.then(|| register(&e));
                up.send(()).unwrap();
                loop {
                    match rx.try_recv() {
                        Ok(Told::Register(done)) => {
                            kv = Some(register(&e));
                            done.send(()).unwrap();
                        }
                        Ok(Told::Stop) | Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
                        Err(std::sync::mpsc::TryRecvError::Empty) => {
                            quiesce_runtime::time::sleep(Duration::from_millis(5)).await
                        }
                    }
                }
                drop(kv);
                e.shutdown();
            });
    });
    is_up.recv().unwrap();
    (tx, thread)
}

/// A lane recovers a segment its target lost and got back, as the engine's
/// thread does. The target restarts (same node, segment id, memory and
/// token) without the segment, so a write finds it gone; once the segment
/// is back and opened again — under the same handle — a small write runs
/// on the lane and lands. The lane kept the opening the restart had made
/// useless and answered -1 for good, while the same write with lanes off
/// answered 0.
#[test]
fn a_lane_reopens_a_segment_its_restarted_target_registered_again() {
    let len = 1 << 20;
    let ptr = Box::leak(vec![0u8; len].into_boxed_slice()).as_mut_ptr() as usize;
    let token = quiesce_transports::Token::random();
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (first, thread) = target_at(addr, ptr, len, token, true);
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(addr, "kv", token).unwrap();
    assert_eq!(write(&e, kv, 0, vec![1u8; 4096]), SYNC_OK);

    first.send(Told::Stop).unwrap();
    thread.join().unwrap();
    let (again, thread) = target_at(addr, ptr, len, token, false);
    assert_ne!(
        write(&e, kv, 0, vec![2u8; 4096]),
        SYNC_OK,
        "a write to a target without the segment"
    );
    let (done, registered) = std::sync::mpsc::channel();
    again.send(Told::Register(done)).unwrap();
    registered.recv().unwrap();
    assert_eq!(e.open(addr, "kv", token).unwrap(), kv, "the same handle");

    e.caller_lanes(false);
    assert_eq!(write(&e, kv, 0, vec![3u8; 4096]), SYNC_OK, "lanes off");
    e.caller_lanes(true);
    assert_eq!(write(&e, kv, 0, vec![4u8; 4096]), SYNC_OK, "on the lane");
    // SAFETY: the leaked memory lives for the process.
    let landed = unsafe { std::slice::from_raw_parts(ptr as *const u8, 4096) };
    assert!(landed.iter().all(|&b| b == 4), "the lane's write landed");
    drop(e);
    again.send(Told::Stop).unwrap();
    thread.join().unwrap();
}
