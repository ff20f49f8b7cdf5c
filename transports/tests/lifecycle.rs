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
