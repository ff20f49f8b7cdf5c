//! A real target engine (on its own thread, io_uring or epoll) fed arbitrary
//! bytes on a fresh connection per input: it must never panic (the panic hook
//! aborts, which libFuzzer reports) and must never write its segment, since no
//! input can prove the segment's token.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use quiesce_transports::Rights;

#[path = "live_engine.rs"]
mod live_engine;

struct Target {
    addr: SocketAddr,
    check: mpsc::SyncSender<mpsc::SyncSender<bool>>,
}

fn target() -> &'static Target {
    static T: OnceLock<Target> = OnceLock::new();
    T.get_or_init(|| {
        let (tx, rx) = mpsc::channel();
        let (check_tx, check_rx) = mpsc::sync_channel::<mpsc::SyncSender<bool>>(1);
        live_engine::spawn(move |engine| async move {
            let seg = engine
                .register("kv", vec![0u8; 4096], Rights::READ | Rights::WRITE)
                .unwrap();
            tx.send(engine.local_addr()).unwrap();
            loop {
                // Answer "is the segment still all zero?" between inputs.
                if let Ok(reply) = check_rx.try_recv() {
                    let mut b = vec![0u8; 4096];
                    seg.read_at(0, &mut b);
                    let _ = reply.send(b.iter().all(|&x| x == 0));
                }
                quiesce_runtime::time::sleep(Duration::from_micros(200)).await;
            }
        });
        Target {
            addr: rx.recv().unwrap(),
            check: check_tx,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let t = target();
    let mut s = TcpStream::connect(t.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = s.write_all(data);
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
    drop(s);
    let (tx, rx) = mpsc::sync_channel(1);
    t.check.send(tx).unwrap();
    assert!(
        rx.recv().unwrap(),
        "the segment was written without a token"
    );
});
