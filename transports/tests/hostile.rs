//! The target against hostile or broken peers: it keeps serving honest
//! clients whatever the others do.

mod common;

use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::{time, Runtime};
use quiesce_transports::{Engine, EngineConfig};

/// An honest client: connects, proves the token, writes 4 KiB and reads it
/// back, within `limit`.
fn honest_round_trip(t: &TargetProcess, limit: Duration) {
    let token = t.seg("kv").token;
    let addr = t.addr;
    Runtime::new().unwrap().block_on(async move {
        let work = async {
            let e = Engine::bind(EngineConfig {
                connect_timeout: limit,
                ..EngineConfig::default()
            })
            .unwrap();
            let kv = e.connect(addr).await?.open("kv", token).await?;
            let (r, _) = kv.write(0, pattern(4096, 3), 1).await;
            r?;
            let (r, back) = kv.read(0, 4096, vec![0u8; 4096], 2).await;
            r?;
            assert_eq!(back, pattern(4096, 3));
            e.shutdown();
            Ok::<(), quiesce_transports::TransferError>(())
        };
        match time::timeout(limit, work).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("the honest client failed: {e}"),
            Err(_) => panic!("the honest client got no service in {limit:?}"),
        }
    });
}

/// After the target ran out of file descriptors once (more connections than
/// RLIMIT_NOFILE allows, all closed again) it accepts and serves again.
#[test]
fn after_fd_exhaustion_the_target_serves_again() {
    let t = TargetProcess::spawn_with(&["--segment", "kv:65536:rw"], Some(64));
    let flood: Vec<std::net::TcpStream> = (0..100)
        .map(|_| std::net::TcpStream::connect(t.addr).unwrap())
        .collect();
    // Let the target accept up to its limit and hit EMFILE.
    std::thread::sleep(Duration::from_millis(300));
    drop(flood);
    let t0 = Instant::now();
    honest_round_trip(&t, Duration::from_secs(5));
    eprintln!("served again {:?} after the flood closed", t0.elapsed());
}
