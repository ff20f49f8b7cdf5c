//! `quiesce target`: a transfer target on this machine.

use std::io::Write;
use std::net::SocketAddr;

use quiesce::directory::{check_name, Directory, NodeRecord, SegmentRecord};
use quiesce::runtime::Runtime;
use quiesce::transports::rdma::{RdmaConfig, RdmaEngine};
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, Rights};

/// Segments every target exposes besides `kv`: a read-only and a write-only
/// one, so that peers can provoke refusals on purpose (the demo does).
pub const SIDE_SEGMENT_LEN: usize = 4096;

/// How `quiesce target` runs.
pub struct Options {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Size of `kv`.
    pub size: usize,
    /// Stop when stdin closes, and take commands on it.
    pub watch_stdin: bool,
    /// Serve the segments over RDMA too.
    pub rdma: bool,
    /// Acknowledge fences without applying them (demonstrations).
    pub ignore_fences: bool,
    /// The largest frame peers may send.
    pub max_frame: u64,
    /// Publish the endpoint and segments in this directory, as this node.
    pub directory: Option<(String, String)>,
    /// How long the reactor busy-polls before it blocks.
    pub spin: std::time::Duration,
    /// `EngineConfig::tcp_congestion`.
    pub tcp_congestion: Option<String>,
}

/// Serves `kv` (`size` bytes, read-write), `ro` (read-only) and `wo`
/// (write-only) until stdin closes (or forever with `--no-stdin`). Prints
/// `segment NAME ID LEN TOKEN` lines, then `listening ADDR`. Reads commands
/// on stdin, one a line: `revoke NAME [START END]` revokes the range (the
/// whole segment by default) and answers `revoked NAME` once it resolved
/// (or `error …`); `heap` answers `heap BYTES ALLOCATIONS MADE` (bytes and
/// allocations live now, allocations made so far). With `rdma`,
/// the segments are also RDMA memory regions whose access flags follow their
/// rights (the engine fails with "no RDMA device" where there is none).
pub fn run(o: Options) -> Result<(), Box<dyn std::error::Error>> {
    let Options {
        listen,
        size,
        watch_stdin,
        rdma,
        ignore_fences,
        max_frame,
        directory,
        spin,
        tcp_congestion,
    } = o;
    let published = match &directory {
        Some((url, node)) => {
            check_name(node)?;
            if listen.ip().is_unspecified() {
                return Err(format!(
                    "--directory needs an address peers can reach: --listen {listen} is a wildcard"
                )
                .into());
            }
            Some((Directory::open(url)?, node.clone()))
        }
        None => None,
    };
    let rt = Runtime::builder().spin(spin).build()?;
    rt.block_on(async move {
        let config = EngineConfig {
            node: "quiesce-target".into(),
            listen,
            ignore_fences,
            max_frame,
            tcp_congestion,
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
        if let Some((dir, node)) = &published {
            publish(dir, node, &engine, &segs, rdma.is_some())?;
        }
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
            // A private open: the description of the stdin it was given is
            // its parent's too (a terminal, a pipe), and must stay blocking.
            let stdin = quiesce::runtime::fd::Fd::reopen_for_reading(std::io::stdin().as_fd())?;
            let mut pending = Vec::new();
            loop {
                let (r, buf) = stdin.read(vec![0u8; 256]).await;
                let n = match r {
                    Ok(n) if n > 0 => n,
                    _ => break,
                };
                pending.extend_from_slice(&buf[..n]);
                while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=end).collect();
                    let reply = command(&segs, &String::from_utf8_lossy(&line)).await;
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "{reply}")?;
                    out.flush()?;
                }
            }
        } else {
            std::future::pending::<()>().await;
        }
        engine.shutdown();
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}

/// Publishes this target and its segments, and waits until the directory
/// holds them (so a peer that reads `listening` can resolve it).
fn publish(
    dir: &Directory,
    node: &str,
    engine: &Engine,
    segs: &[quiesce::transports::Segment],
    rdma: bool,
) -> Result<(), quiesce::directory::DirectoryError> {
    dir.publish_node(&NodeRecord {
        node: node.to_string(),
        addr: engine.local_addr(),
        fabric: if rdma { "rdma" } else { "tcp" }.into(),
    })?;
    for s in segs {
        dir.publish_segment(&SegmentRecord {
            node: node.to_string(),
            name: s.name().to_string(),
            id: s.id(),
            base: s.base(),
            len: s.len(),
            read: s.rights().contains(Rights::READ),
            write: s.rights().contains(Rights::WRITE),
        })?;
    }
    dir.flush(std::time::Duration::from_secs(10))
}

/// Runs one stdin command; returns the line to answer.
async fn command(segs: &[quiesce::transports::Segment], line: &str) -> String {
    let w: Vec<&str> = line.split_whitespace().collect();
    let (name, range) = match w.as_slice() {
        ["heap"] => {
            let h = quiesce::runtime::heap::Heap::now();
            return format!("heap {} {} {}", h.live_bytes, h.live(), h.allocations);
        }
        ["revoke", name] => (*name, None),
        ["revoke", name, start, end] => match (start.parse::<u64>(), end.parse::<u64>()) {
            (Ok(s), Ok(e)) => (*name, Some(s..e)),
            _ => return format!("error bad range in {line:?}"),
        },
        _ => return format!("error unknown command {line:?}"),
    };
    let Some(seg) = segs.iter().find(|s| s.name() == name) else {
        return format!("error no segment {name:?}");
    };
    match seg.revoke(range.unwrap_or(0..seg.len())).await {
        Ok(()) => format!("revoked {name}"),
        Err(e) => format!("error {e}"),
    }
}
