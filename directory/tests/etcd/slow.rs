//! The directory over a slow link to etcd (a proxy that holds what it
//! forwards).

use std::time::{Duration, Instant};

use quiesce_directory::{EtcdDirectory, EtcdOptions};

use super::{directory, etcd, node, segment, TTL};

/// A TCP proxy to `to` that holds each chunk it forwards for `delay_ms`
/// (read anew for each chunk): a link to etcd that can turn slow.
fn slow_proxy(
    to: std::net::SocketAddr,
    delay_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> std::net::SocketAddr {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let Ok(u) = TcpStream::connect(to) else {
                continue;
            };
            let pairs = [(c.try_clone().unwrap(), u.try_clone().unwrap()), (u, c)];
            for (mut from, mut into) in pairs {
                let delay = delay_ms.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 1 << 16];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => {
                                let _ = into.shutdown(Shutdown::Both);
                                return;
                            }
                            Ok(n) => n,
                        };
                        let d = delay.load(std::sync::atomic::Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(d));
                        if into.write_all(&buf[..n]).is_err() {
                            let _ = from.shutdown(Shutdown::Both);
                            return;
                        }
                    }
                });
            }
        }
    });
    addr
}

/// A session setup that takes longer than the lease's TTL (thousands of
/// entries written back over a slow link to etcd) keeps its lease alive
/// meanwhile: the entries it writes stay. The lease had one keep-alive, at
/// its grant: it expired mid-setup, etcd deleted what the setup had
/// written under it, and the node's entries were gone again.
#[test]
fn a_session_setup_longer_than_the_ttl_keeps_its_lease() {
    let Some(mut e) = etcd() else { return };
    const N: u64 = 2000;
    let delay = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let proxy = slow_proxy(e.endpoint().parse().unwrap(), delay.clone());
    let target = EtcdDirectory::start(EtcdOptions {
        ttl_secs: TTL,
        op_timeout: Duration::from_secs(5),
        ..EtcdOptions::from_url(&format!("etcd://{proxy}/slow")).unwrap()
    })
    .unwrap();
    target.publish_node(&node("t", 7007)).unwrap();
    for i in 0..N {
        target
            .publish_segment(&segment("t", &format!("s{i}"), i + 1, 4096))
            .unwrap();
    }
    target.flush(Duration::from_secs(60)).unwrap();
    // About 60 transactions of 200+ ms each: several TTLs.
    delay.store(50, std::sync::atomic::Ordering::Relaxed);
    e.wipe();
    e.restart().unwrap();
    let fresh = directory(&e, "slow");
    let count = || fresh.segments("t").map(|s| s.len()).unwrap_or(0);
    let t0 = Instant::now();
    while count() < N as usize {
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "{} of {N} entries came back in 90 s (TTL {TTL} s)",
            count()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let took = t0.elapsed();
    std::thread::sleep(Duration::from_secs(2 * TTL as u64 + 1));
    assert_eq!(
        count(),
        N as usize,
        "entries went again after a {took:?} setup (TTL {TTL} s)"
    );
}
