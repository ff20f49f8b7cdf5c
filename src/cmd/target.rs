//! `quiesce target`: a transfer target on this machine.

use std::io::Write;
use std::net::SocketAddr;

use quiesce::runtime::Runtime;
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, Rights};

/// Segments every target exposes besides `kv`: a read-only and a write-only
/// one, so that peers can provoke refusals on purpose (the demo does).
pub const SIDE_SEGMENT_LEN: usize = 4096;

/// Serves `kv` (`size` bytes, read-write), `ro` (read-only) and `wo`
/// (write-only) until stdin closes (or forever with `--no-stdin`). Prints
/// `segment NAME ID LEN TOKEN` lines, then `listening ADDR`.
pub fn run(
    listen: SocketAddr,
    size: usize,
    watch_stdin: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let rt = Runtime::new()?;
    rt.block_on(async move {
        let engine = Engine::bind(EngineConfig {
            node: "quiesce-target".into(),
            listen,
            ..Default::default()
        })?;
        let segs = [
            engine.register("kv", AlignedBuf::new(size), Rights::READ | Rights::WRITE)?,
            engine.register("ro", AlignedBuf::new(SIDE_SEGMENT_LEN), Rights::READ)?,
            engine.register("wo", AlignedBuf::new(SIDE_SEGMENT_LEN), Rights::WRITE)?,
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
