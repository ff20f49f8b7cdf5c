//! State that grows with the number of batches must not: after many failed
//! (fenced) batches on one session, the target's fence table and the
//! initiator's own fence set are back to (nearly) empty.

use quiesce_batch::{Batch, BatchOptions, FailurePolicy, RemoteRange, Tcp};
use quiesce_runtime::Runtime;
use quiesce_transports::{Engine, EngineConfig, Rights};

#[test]
fn three_hundred_fenced_batches_leave_no_fence_state_behind() {
    Runtime::new().unwrap().block_on(async {
        // Target and initiator on one runtime: the target's tasks run
        // whenever the initiator waits.
        let target = Engine::bind(EngineConfig::default()).unwrap();
        let kv = target
            .register("kv", vec![0u8; 8 << 20], Rights::READ | Rights::WRITE)
            .unwrap();
        let ro = target.register("ro", vec![0u8; 4096], Rights::READ).unwrap();
        let init = Engine::bind(EngineConfig::default()).unwrap();
        let peer = init.connect(target.local_addr()).await.unwrap();
        let kv = peer.open("kv", kv.token()).await.unwrap();
        let ro = peer.open("ro", ro.token()).await.unwrap();
        let mut peak = (0, 0);
        for round in 0..300 {
            let mut b = Batch::new(Tcp, BatchOptions::default().policy(FailurePolicy::FailFast));
            b.write(vec![1u8; 4096], RemoteRange::new(&ro, 0, 4096))
                .ok()
                .unwrap();
            b.write(vec![2u8; 8 << 20], RemoteRange::new(&kv, 0, 8 << 20))
                .ok()
                .unwrap();
            let q = b.submit().await.quiesced().await;
            assert!(!q.all_completed(), "round {round}: the refused task fails");
            assert!(q.fence_time().is_some(), "round {round}: the batch fenced");
            let now = (target.stats().fence_entries, peer.fenced_batches());
            peak = (peak.0.max(now.0), peak.1.max(now.1));
        }
        // Let the last forgets arrive.
        for _ in 0..100 {
            quiesce_runtime::yield_now().await;
        }
        let end = (target.stats().fence_entries, peer.fenced_batches());
        eprintln!("fence entries at the target, fenced batches at the initiator: peak {peak:?}, end {end:?}");
        assert!(peak.0 <= 8 && peak.1 <= 8, "fence state grows with the batches: peak {peak:?}");
        assert_eq!(end, (0, 0), "fence state left behind");
        init.shutdown();
        target.shutdown();
    });
}
