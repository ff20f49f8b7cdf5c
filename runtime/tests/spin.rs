//! `Builder::spin`: the reactor busy-polls before it blocks, so work that
//! arrives meanwhile is taken without a park (and its wake-up); idle, it
//! still blocks.

mod common;

use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::net::{TcpListener, TcpStream};
use quiesce_runtime::shard::{channel, Receiver};
use quiesce_runtime::{stats, time, Runtime};

/// A channel whose only value another thread sends 5 ms from now.
fn sent_from_another_thread(v: u32) -> (Receiver<u32>, std::thread::JoinHandle<()>) {
    let (tx, rx) = channel::<u32>();
    let th = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(5));
        tx.send(v).unwrap();
    });
    (rx, th)
}

fn spinning(d: Duration) -> Runtime {
    Runtime::builder().spin(d).build().expect("runtime")
}

#[test]
fn a_wake_from_another_thread_while_spinning_needs_no_park() {
    let rt = spinning(Duration::from_secs(2));
    rt.block_on(async {
        let before = stats().parks;
        let (mut rx, th) = sent_from_another_thread(7);
        assert_eq!(rx.recv().await, Some(7));
        assert_eq!(
            stats().parks,
            before,
            "the reactor parked although it spins"
        );
        th.join().unwrap();
    });
}

#[test]
fn a_completion_while_spinning_needs_no_park() {
    let rt = spinning(Duration::from_secs(2));
    rt.block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let th = std::thread::spawn(move || {
            use std::io::Write;
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            s.write_all(b"ping").unwrap();
            std::thread::sleep(Duration::from_millis(50));
        });
        let (s, _) = l.accept().await.unwrap();
        let before = stats().parks;
        let (r, buf) = s.read(vec![0u8; 4]).await;
        assert_eq!(r.unwrap(), 4);
        assert_eq!(&buf, b"ping");
        assert_eq!(
            stats().parks,
            before,
            "the reactor parked although it spins"
        );
        drop::<TcpStream>(s);
        th.join().unwrap();
    });
}

#[test]
fn an_idle_spinning_runtime_still_blocks_and_its_timers_fire() {
    let idle = spinning(Duration::from_millis(1));
    idle.block_on(async {
        let before = stats().parks;
        let t0 = Instant::now();
        time::sleep(Duration::from_millis(50)).await;
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert!(stats().parks > before, "an idle runtime never blocked");
    });
    // Without spin, the same wake costs a park.
    rt().block_on(async {
        let before = stats().parks;
        let (mut rx, th) = sent_from_another_thread(7);
        assert_eq!(rx.recv().await, Some(7));
        assert!(stats().parks > before);
        th.join().unwrap();
    });
}

/// The spin uses part of the wait for the nearest timer, and the park after
/// it waits only for the rest: a 100 ms sleep on a runtime spinning 200 ms
/// fires after about 100 ms, not 200 (spin to the deadline, then park for
/// the whole timeout again).
#[test]
fn a_timer_is_not_late_by_the_spin() {
    spinning(Duration::from_millis(200)).block_on(async {
        let t0 = Instant::now();
        time::sleep(Duration::from_millis(100)).await;
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(100));
        assert!(took < Duration::from_millis(180), "fired after {took:?}");
    });
}
