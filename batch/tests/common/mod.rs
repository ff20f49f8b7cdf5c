//! A target engine on a shard of its own, for the sync API's tests:
//! segments `kv` (read-write, [`KV`] bytes) and `ro` (read-only, 4 KiB), and
//! commands that freeze its thread, read its counters, or read `kv`.

#![allow(dead_code)] // each test binary uses its own part

use std::future::Future;
use std::sync::mpsc;
use std::time::Duration;

use quiesce_runtime::shard::{channel, Sender, Shards};
use quiesce_transports::{Engine, EngineConfig, EngineStats, Rights, Token};

/// `kv`'s length.
pub const KV: usize = 8 << 20;

enum Cmd {
    /// Freezes the target's thread.
    Stall(Duration),
    Stats(mpsc::Sender<EngineStats>),
    /// The bytes of `kv` at an offset.
    Peek(u64, usize, mpsc::Sender<Vec<u8>>),
    /// Revokes a range of `kv` (answered once it resolved).
    Revoke(std::ops::Range<u64>, mpsc::Sender<()>),
}

/// The target; shut down on drop.
pub struct Target {
    pub addr: std::net::SocketAddr,
    /// `kv`'s token.
    pub kv: Token,
    /// `ro`'s token.
    pub ro: Token,
    cmds: Sender<Cmd>,
    shards: Option<Shards<()>>,
}

impl Target {
    pub fn start() -> Target {
        let (cmd_tx, cmd_rx) = channel::<Cmd>();
        let cmd_rx = std::sync::Mutex::new(Some(cmd_rx));
        let (tx, rx) = mpsc::channel();
        let shards = Shards::builder()
            .count(1)
            .pin(false)
            .spawn(move |shard| {
                let tx = tx.clone();
                let mut cmds = cmd_rx.lock().unwrap().take().unwrap();
                async move {
                    let e = Engine::bind(EngineConfig::default()).unwrap();
                    let kv = e
                        .register("kv", vec![0u8; KV], Rights::READ | Rights::WRITE)
                        .unwrap();
                    let ro = e.register("ro", vec![0u8; 4096], Rights::READ).unwrap();
                    tx.send((e.local_addr(), kv.token(), ro.token())).unwrap();
                    let serve = async {
                        while let Some(c) = cmds.recv().await {
                            match c {
                                Cmd::Stall(d) => std::thread::sleep(d),
                                Cmd::Stats(r) => {
                                    let _ = r.send(e.stats());
                                }
                                Cmd::Peek(at, n, r) => {
                                    let mut v = vec![0u8; n];
                                    assert!(kv.read_at(at, &mut v));
                                    let _ = r.send(v);
                                }
                                Cmd::Revoke(range, r) => {
                                    kv.revoke(range).await.expect("the revoke resolves");
                                    let _ = r.send(());
                                }
                            }
                        }
                    };
                    let stop = shard.shutdown_requested();
                    let mut serve = std::pin::pin!(serve);
                    let mut stop = std::pin::pin!(stop);
                    std::future::poll_fn(|cx| {
                        if serve.as_mut().poll(cx).is_ready() || stop.as_mut().poll(cx).is_ready() {
                            std::task::Poll::Ready(())
                        } else {
                            std::task::Poll::Pending
                        }
                    })
                    .await;
                    e.shutdown();
                }
            })
            .unwrap();
        let (addr, kv, ro) = rx.recv().unwrap();
        Target {
            addr,
            kv,
            ro,
            cmds: cmd_tx,
            shards: Some(shards),
        }
    }

    /// Freezes the target's thread for `d`; it is asleep once this returns.
    pub fn stall(&self, d: Duration) {
        self.cmds.send(Cmd::Stall(d)).ok().unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }

    pub fn stats(&self) -> EngineStats {
        let (tx, rx) = mpsc::channel();
        self.cmds.send(Cmd::Stats(tx)).ok().unwrap();
        rx.recv().unwrap()
    }

    /// Revokes `range` of `kv`; returns once it resolved.
    pub fn revoke(&self, range: std::ops::Range<u64>) {
        let (tx, rx) = mpsc::channel();
        self.cmds.send(Cmd::Revoke(range, tx)).ok().unwrap();
        rx.recv().unwrap()
    }

    /// `n` bytes of `kv` at `at`.
    pub fn peek(&self, at: u64, n: usize) -> Vec<u8> {
        let (tx, rx) = mpsc::channel();
        self.cmds.send(Cmd::Peek(at, n, tx)).ok().unwrap();
        rx.recv().unwrap()
    }

    /// Waits (up to 5 s) until the target has `n` sessions with a
    /// connection; how many it has then.
    pub fn wait_sessions(&self, n: u64) -> u64 {
        let until = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let s = self.stats().sessions;
            if s == n || std::time::Instant::now() > until {
                return s;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(s) = self.shards.take() {
            s.shutdown();
        }
    }
}
