//! `EngineConfig::tcp_congestion`: a name the kernel does not have is
//! refused when the engine is made, in either role, with a typed error.

use std::io::ErrorKind;

use quiesce_runtime::Runtime;
use quiesce_transports::{Engine, EngineConfig};

#[test]
fn an_unknown_congestion_control_is_refused_when_the_engine_is_made() {
    Runtime::new().unwrap().block_on(async {
        let config = EngineConfig {
            tcp_congestion: Some("no-such-cc".into()),
            ..EngineConfig::default()
        };
        let e = Engine::bind(config.clone()).err().expect("bind refused");
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        assert!(e.to_string().contains("no-such-cc"), "{e}");
        let e = Engine::initiator(config).err().expect("initiator refused");
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        let ok = EngineConfig {
            tcp_congestion: Some("reno".into()),
            ..EngineConfig::default()
        };
        Engine::bind(ok).unwrap();
    });
}
