//! quiesce itself, through the batch API a user calls.

use std::net::SocketAddr;
use std::time::Instant;

use quiesce::batch::{Batch, BatchOptions, FailurePolicy, RemoteRange, Tcp};
use quiesce::runtime::{DriverKind, Runtime};
use quiesce::transports::{AlignedBuf, Engine, EngineConfig};

use super::{Case, Sample, SegInfo};

/// Runs `iters` iterations of `case` on a quiesce runtime with `driver`.
pub fn run(
    driver: DriverKind,
    addr: SocketAddr,
    kv: &SegInfo,
    ro: &SegInfo,
    case: Case,
    iters: usize,
    zc_threshold: Option<usize>,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    let rt = Runtime::builder().driver(driver).build()?;
    rt.block_on(async {
        let engine = Engine::bind(EngineConfig {
            node: "bench".into(),
            zc_threshold,
            ..Default::default()
        })?;
        let peer = engine.connect(addr).await?;
        let kvs = peer.open("kv", kv.token).await?;
        let ros = match case {
            Case::FailFast(_) => Some(peer.open("ro", ro.token).await?),
            _ => None,
        };
        let size = case.size();
        let (tasks, task_size) = match case {
            Case::Batch { tasks, size } => (tasks, size),
            _ => (1, size),
        };
        let mut bufs: Vec<AlignedBuf> = (0..tasks).map(|_| AlignedBuf::new(task_size)).collect();
        let mut small = Some(AlignedBuf::new(4096));
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let opts = match case {
                Case::FailFast(_) => BatchOptions::default().policy(FailurePolicy::FailFast),
                _ => BatchOptions::default(),
            };
            let mut batch = Batch::new(Tcp, opts);
            if let Some(ros) = &ros {
                let small = small.take().expect("returned by the last round");
                batch
                    .write(small, RemoteRange::new(ros, 0, 4096))
                    .map_err(|r| r.reason)?;
            }
            for (i, b) in bufs.drain(..).enumerate() {
                let range = RemoteRange::new(&kvs, (i * task_size) as u64, task_size as u64);
                match case {
                    Case::Read(_) => batch.read(b, range),
                    _ => batch.write(b, range),
                }
                .map_err(|r| r.reason)?;
            }
            let t0 = Instant::now();
            let q = batch.submit().await.quiesced().await;
            let took = t0.elapsed();
            let fence = q.fence_time();
            match case {
                Case::FailFast(_) => assert!(!q.all_completed(), "the refused write must fail"),
                _ => assert!(q.all_completed(), "{:?}", q.tasks()),
            }
            let mut back = q.into_buffers();
            if let Case::FailFast(_) = case {
                small = Some(back.remove(0));
            }
            bufs = back;
            out.push(Sample {
                took,
                bytes: case.bytes(),
                fence,
            });
        }
        engine.shutdown();
        Ok(out)
    })
}
