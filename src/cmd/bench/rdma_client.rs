//! quiesce over RDMA verbs, through the batch API a user calls.

use std::net::SocketAddr;
use std::time::Duration;

use quiesce::runtime::Runtime;
use quiesce::transports::rdma::{RdmaConfig, RdmaEngine};
use quiesce::transports::Region;

use super::{Case, Sample, SegInfo};

/// Runs `iters` iterations of `case` against the RDMA target at `addr`.
pub fn run(
    addr: SocketAddr,
    kv: &SegInfo,
    ro: Option<&SegInfo>,
    case: Case,
    iters: usize,
    busy_poll: bool,
    direct: bool,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    let rt = Runtime::new()?;
    rt.block_on(async {
        let engine = RdmaEngine::bind(RdmaConfig {
            busy_poll,
            ..Default::default()
        })?;
        let (tasks, task_size) = match case {
            Case::Batch { tasks, size } => (tasks, size),
            _ => (1, case.size()),
        };
        let region = Region::new(tasks * task_size + 4096);
        let _registration = engine.register_region(&region)?;
        let peer = engine.connect(addr).await?;
        let kvs = peer.open("kv", kv.token).await?;
        let ros = match case {
            Case::FailFast(_) => {
                let ro = ro.ok_or("fail-fast needs the ro segment (--compare)")?;
                Some(peer.open("ro", ro.token).await?)
            }
            _ => None,
        };
        let mut bufs = (0..tasks)
            .map(|i| region.lease(i * task_size..(i + 1) * task_size))
            .collect::<Result<Vec<_>, _>>()?;
        let probe_at = tasks * task_size;
        let small = Some(region.lease(probe_at..probe_at + 4096)?);
        if direct {
            // The transport alone (`RdmaSegment::write`/`read`), no batch:
            // shows what the batch layer costs.
            let buf = bufs.pop().ok_or("no buffer")?;
            let len = buf.len() as u64;
            let kvs = &kvs;
            let out = super::direct_loop(case, iters, buf, len, |read, buf, wire| async move {
                match read {
                    true => kvs.read(0, len, buf, wire).await,
                    false => kvs.write(0, buf, wire).await,
                }
            })
            .await?;
            engine.shutdown(Duration::from_secs(5));
            return Ok(out);
        }
        let out = super::batch_loop(&kvs, ros.as_ref(), case, iters, bufs, small).await?;
        engine.shutdown(Duration::from_secs(5));
        Ok(out)
    })
}
