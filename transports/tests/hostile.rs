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

/// Before it proved a token a peer can do nothing but the handshake: a
/// Fence or a QpConnect is refused, the connection closed, nothing stored.
#[test]
fn an_unauthenticated_fence_or_qp_connect_is_refused_and_stores_nothing() {
    use quiesce_transports::wire::{Header, Op, QpConnect, QpWire, Status};
    use quiesce_transports::Rights;
    let t = ShardTarget::start(
        EngineConfig::default(),
        &[("kv", 4096, Rights::READ | Rights::WRITE)],
    );
    let before = t.stats();
    let mut c = RawClient::connect(t.addr);
    c.send(
        &Header {
            batch: 77,
            ..Header::new(Op::Fence)
        },
        &[],
    );
    let h = c.recv().expect("an answer before the close");
    assert_eq!(
        h.op,
        Op::Status,
        "an unauthenticated fence was served: {h:?}"
    );
    assert_eq!(h.status(), Ok(Status::Forbidden));
    assert!(c.recv().is_none(), "the connection is closed");
    let st = t.stats();
    assert_eq!(
        st.fence_entries, before.fence_entries,
        "nothing stored: {st:?}"
    );

    let mut c = RawClient::connect(t.addr);
    let p = QpConnect {
        qp: QpWire::default(),
    }
    .encode();
    c.send(
        &Header {
            length: p.len() as u64,
            ..Header::new(Op::QpConnect)
        },
        &p,
    );
    let h = c.recv().expect("an answer before the close");
    assert_eq!(
        h.op,
        Op::Status,
        "an unauthenticated QpConnect was served: {h:?}"
    );
    assert_eq!(h.status(), Ok(Status::Forbidden));
    assert!(c.recv().is_none(), "the connection is closed");
    // Both connections are gone, none of them counted as authenticated.
    std::thread::sleep(Duration::from_millis(50));
    let st = t.stats();
    assert_eq!((st.connections, st.unauthenticated), (0, 0), "{st:?}");
}
