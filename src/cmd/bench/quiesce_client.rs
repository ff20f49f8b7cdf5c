//! quiesce itself, through the batch API a user calls.

use std::net::SocketAddr;

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
        let bufs: Vec<AlignedBuf> = (0..tasks).map(|_| AlignedBuf::new(task_size)).collect();
        let small = Some(AlignedBuf::new(4096));
        let out = super::batch_loop(&kvs, ros.as_ref(), case, iters, bufs, small).await?;
        engine.shutdown();
        Ok(out)
    })
}
