//! An engine dropped without `shutdown()` releases what it holds: its
//! listener and its served connections.

use std::time::Duration;

use quiesce_runtime::{time, Runtime};
use quiesce_transports::{Engine, EngineConfig, Rights, TransferError};

#[test]
fn a_dropped_engine_closes_its_listener_and_its_connections() {
    Runtime::new().unwrap().block_on(async {
        let target = Engine::bind(EngineConfig::default()).unwrap();
        let kv = target
            .register("kv", vec![0u8; 65536], Rights::READ | Rights::WRITE)
            .unwrap();
        let addr = target.local_addr();
        let init = Engine::bind(EngineConfig::default()).unwrap();
        let seg = init
            .connect(addr)
            .await
            .unwrap()
            .open("kv", kv.token())
            .await
            .unwrap();
        let (r, _) = seg.write(0, vec![1u8; 4096], 1).await;
        r.unwrap();
        drop(kv);
        drop(target);
        time::sleep(Duration::from_millis(50)).await;
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "the dropped engine still listens"
        );
        let (r, _) = seg.write(0, vec![2u8; 4096], 2).await;
        assert!(
            matches!(r, Err(TransferError::ConnectionLost(_))),
            "the dropped engine still serves: {r:?}"
        );
        init.shutdown();
    });
}

/// Two connects to one address at once (two batches' first transfers) make
/// one peer: two would be two sessions at the target, each fenced apart,
/// while the batch layer knows a peer by its address and fences one.
#[test]
fn two_connects_at_once_make_one_peer() {
    Runtime::new().unwrap().block_on(async {
        let target = Engine::bind(EngineConfig::default()).unwrap();
        let addr = target.local_addr();
        let init = Engine::bind(EngineConfig::default()).unwrap();
        let connect = |e: &Engine| {
            let e = e.clone();
            quiesce_runtime::spawn_local(async move { e.connect(addr).await.unwrap() })
        };
        let (a, b) = (connect(&init), connect(&init));
        let (a, b) = (a.await.unwrap(), b.await.unwrap());
        time::sleep(Duration::from_millis(50)).await;
        assert_eq!(target.stats().connections, 1, "two peers for one address");
        assert_eq!(a.addr(), b.addr());
        init.shutdown();
        target.shutdown();
    });
}

/// A configuration that cannot work is refused at bind, with what is
/// wrong — not a panic at the first transfer.
#[test]
fn an_engine_config_that_cannot_work_is_refused_at_bind() {
    quiesce_runtime::Runtime::new().unwrap().block_on(async {
        for (cfg, why) in [
            (
                EngineConfig {
                    connections_per_peer: 0,
                    ..Default::default()
                },
                "connections_per_peer",
            ),
            (
                EngineConfig {
                    slice_size: 0,
                    ..Default::default()
                },
                "slice_size",
            ),
            (
                // It travels in every hello: each connection failed.
                EngineConfig {
                    node: "n".repeat(256),
                    ..Default::default()
                },
                "node name",
            ),
        ] {
            let e = quiesce_transports::Engine::bind(cfg.clone())
                .err()
                .unwrap_or_else(|| panic!("bound with a bad {why}"));
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
            assert!(e.to_string().contains(why), "{e}");
            assert!(quiesce_transports::Engine::initiator(cfg).is_err());
        }
    });
}
