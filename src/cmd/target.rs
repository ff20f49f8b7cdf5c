//! `quiesce target`: a transfer target on this machine.

use std::io::Write;
use std::net::SocketAddr;

use quiesce::runtime::Runtime;
use quiesce::transports::rdma::{RdmaConfig, RdmaEngine};
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, Rights};

/// Segments every target exposes besides `kv`: a read-only and a write-only
/// one, so that peers can provoke refusals on purpose (the demo does).
pub const SIDE_SEGMENT_LEN: usize = 4096;

/// Serves `kv` (`size` bytes, read-write), `ro` (read-only) and `wo`
/// (write-only) until stdin closes (or forever with `--no-stdin`). Prints
/// `segment NAME ID LEN TOKEN` lines, then `listening ADDR`. With `rdma`,
/// the segments are also RDMA memory regions whose access flags follow their
/// rights (the engine fails with "no RDMA device" where there is none).
pub fn run(
    listen: SocketAddr,
    size: usize,
    watch_stdin: bool,
    rdma: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let rt = Runtime::new()?;
    rt.block_on(async move {
        let config = EngineConfig {
            node: "quiesce-target".into(),
            listen,
            ..Default::default()
        };
        let rdma = match rdma {
            true => Some(RdmaEngine::bind(RdmaConfig {
                control: config.clone(),
                ..Default::default()
            })?),
            false => None,
        };
        let engine = match &rdma {
            Some(r) => r.control().clone(),
            None => Engine::bind(config)?,
        };
        let register = |name: &str, len: usize, rights: Rights| match &rdma {
            Some(r) => r.register(name, AlignedBuf::new(len), rights),
            None => engine.register(name, AlignedBuf::new(len), rights),
        };
        let segs = [
            register("kv", size, Rights::READ | Rights::WRITE)?,
            register("ro", SIDE_SEGMENT_LEN, Rights::READ)?,
            register("wo", SIDE_SEGMENT_LEN, Rights::WRITE)?,
        ];
        let mut out = std::io::stdout().lock();
        for s in &segs {
            writeln!(
                out,
                "segment {} {} {} {}",
                s.name(),
                s.id(),
                s.len(),
                s.token()
            )?;
        }
        writeln!(out, "listening {}", engine.local_addr())?;
        out.flush()?;
        drop(out);
        if watch_stdin {
            use std::os::fd::AsFd;
            let stdin =
                quiesce::runtime::fd::Fd::new(std::io::stdin().as_fd().try_clone_to_owned()?)?;
            loop {
                let (r, _) = stdin.read(vec![0u8; 64]).await;
                if !matches!(r, Ok(n) if n > 0) {
                    break;
                }
            }
        } else {
            std::future::pending::<()>().await;
        }
        engine.shutdown();
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}
