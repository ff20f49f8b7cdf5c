//! quiesce itself, through the batch API a user calls.

use std::net::SocketAddr;
use std::time::Duration;

use quiesce::runtime::{DriverKind, Runtime};
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, LocalMode, Peer, RemoteSegment};

use super::{Case, Sample, SegInfo};

/// An engine on its own runtime with one session to the target and its
/// `kv` segment open (`ro` too, once a fail-fast case needs it), kept across
/// runs.
pub struct Quiesce {
    kv: RemoteSegment,
    direct: bool,
    ro: Option<RemoteSegment>,
    /// `None` with `--connect` (see `Endpoint::ro`).
    ro_token: Option<quiesce::transports::Token>,
    peer: Peer,
    engine: Engine,
    /// Dropped last, after everything that lives on it.
    rt: Runtime,
}

/// How a quiesce initiator is set up.
pub struct Knobs {
    /// Slices of at least this size go with SEND_ZC.
    pub zc_threshold: Option<usize>,
    pub local: LocalMode,
    /// Small local requests through the shared-memory mailbox.
    pub mailbox: bool,
    /// How long the reactor busy-polls before it blocks.
    pub spin: Duration,
    /// `EngineConfig::tcp_congestion`.
    pub tcp_congestion: Option<String>,
    /// Single writes and reads through the transport alone
    /// (`RemoteSegment::write`/`read`), no batch: what the batch layer costs.
    pub direct: bool,
}

impl Quiesce {
    /// Builds a runtime on `driver`, binds an engine, connects and opens
    /// the segments.
    pub fn connect(
        driver: DriverKind,
        addr: SocketAddr,
        kv: &SegInfo,
        ro: Option<&SegInfo>,
        k: Knobs,
    ) -> Result<Quiesce, Box<dyn std::error::Error>> {
        let rt = Runtime::builder().driver(driver).spin(k.spin).build()?;
        let (engine, peer, kvs) = rt.block_on(async {
            let engine = Engine::bind(EngineConfig {
                node: "bench".into(),
                zc_threshold: k.zc_threshold,
                local: k.local,
                mailbox: k.mailbox,
                tcp_congestion: k.tcp_congestion,
                ..Default::default()
            })?;
            let peer = engine.connect(addr).await?;
            let kvs = peer.open("kv", kv.token).await?;
            Ok::<_, Box<dyn std::error::Error>>((engine, peer, kvs))
        })?;
        Ok(Quiesce {
            kv: kvs,
            direct: k.direct,
            ro: None,
            ro_token: ro.map(|r| r.token),
            peer,
            engine,
            rt,
        })
    }

    /// Runs `iters` iterations of `case` (one batch each).
    pub fn run(
        &mut self,
        case: Case,
        iters: usize,
    ) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
        let (tasks, task_size) = match case {
            Case::Batch { tasks, size } => (tasks, size),
            _ => (1, case.size()),
        };
        let bufs: Vec<AlignedBuf> = (0..tasks).map(|_| AlignedBuf::new(task_size)).collect();
        if self.direct {
            let buf = bufs.into_iter().next().ok_or("no buffer")?;
            let (kv, len) = (&self.kv, buf.len() as u64);
            return self.rt.block_on(super::direct_loop(
                case,
                iters,
                buf,
                len,
                |read, buf, wire| async move {
                    match read {
                        true => kv.read(0, len, buf, wire).await,
                        false => kv.write(0, buf, wire).await,
                    }
                },
            ));
        }
        let small = Some(AlignedBuf::new(4096));
        self.rt.block_on(async {
            if matches!(case, Case::FailFast(_)) && self.ro.is_none() {
                let token = self
                    .ro_token
                    .ok_or("fail-fast needs the ro segment (--compare)")?;
                self.ro = Some(self.peer.open("ro", token).await?);
            }
            let ro = self
                .ro
                .as_ref()
                .filter(|_| matches!(case, Case::FailFast(_)));
            super::batch_loop(&self.kv, ro, case, iters, bufs, small).await
        })
    }
}

impl Drop for Quiesce {
    fn drop(&mut self) {
        let engine = &self.engine;
        self.rt.block_on(async { engine.shutdown() });
    }
}
