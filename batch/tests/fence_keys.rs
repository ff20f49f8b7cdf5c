//! Fence bookkeeping keys a peer by its identity, not its address: two
//! engines (two sessions) at one target are two peers, each fenced and
//! confirmed on its own. Merged, a fence acknowledged in one session would
//! mark the other session's tasks fenced — bytes still queued there could
//! land after the outcome said they would not.

mod common;

use std::collections::HashSet;

use common::Target;
use quiesce_batch::{PeerKey, RemoteRange, Tcp, Transport};
use quiesce_runtime::Runtime;
use quiesce_transports::{Engine, EngineConfig};

#[test]
// A key hashes its peer's identity, which the peer's inner state never changes.
#[allow(clippy::mutable_key_type)]
fn two_engines_at_one_target_are_two_fence_keys() {
    let target = Target::start();
    Runtime::new().unwrap().block_on(async {
        let (e1, e2) = (
            Engine::bind(EngineConfig::default()).unwrap(),
            Engine::bind(EngineConfig::default()).unwrap(),
        );
        let p1 = e1.connect(target.addr).await.unwrap();
        let p2 = e2.connect(target.addr).await.unwrap();
        let a = p1.open("kv", target.kv).await.unwrap();
        let b = p1.open("ro", target.ro).await.unwrap();
        let c = p2.open("kv", target.kv).await.unwrap();
        let key = |s| Tcp.peer(&RemoteRange::new(s, 0, 1));
        let keys: HashSet<PeerKey> = [key(&a), key(&b), key(&c)].into_iter().collect();
        assert_eq!(
            keys.len(),
            2,
            "one key per peer: the same peer once, two engines' peers twice"
        );
        assert!(key(&a) == key(&b) && key(&a) != key(&c));
        e1.shutdown();
        e2.shutdown();
    });
}
