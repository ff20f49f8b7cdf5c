//! Helpers for the transport tests: a target in another process, a target on
//! another shard of this process, and a raw protocol client.
#![allow(dead_code)]

pub mod fake;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use quiesce_runtime::shard::{channel, Sender, Shards};
use quiesce_transports::wire::{
    AuthAck, AuthRequest, GrantReceipt, Header, Hello, HelloAck, Opcode, SegmentRef, HEADER_LEN,
    VERSION,
};
use quiesce_transports::{Engine, EngineConfig, LocalMode, Rights, Token};

/// Settings for the TCP tests: the local transport off in both roles, so a
/// target on loopback is reached over TCP (`local.rs` tests the other road).
pub fn tcp() -> EngineConfig {
    EngineConfig {
        local: LocalMode::Off,
        ..EngineConfig::default()
    }
}

/// What a target says about one of its segments.
#[derive(Debug, Clone)]
pub struct SegInfo {
    pub id: u64,
    pub len: u64,
    pub token: Token,
    /// Its virtual address at the target (0 where not known).
    pub base: u64,
}

/// `quiesce-test-target` running as a child process.
pub struct TargetProcess {
    pub child: Child,
    pub addr: SocketAddr,
    pub segments: HashMap<String, SegInfo>,
}

impl TargetProcess {
    pub fn spawn(args: &[&str]) -> TargetProcess {
        Self::spawn_with(args, None)
    }

    /// As [`spawn`](Self::spawn), with `RLIMIT_NOFILE` set to `nofile`.
    pub fn spawn_with(args: &[&str], nofile: Option<u64>) -> TargetProcess {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_quiesce-test-target"));
        cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped());
        if let Some(n) = nofile {
            // SAFETY: setrlimit is async-signal-safe and touches only `lim`.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().expect("start quiesce-test-target");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut segments = HashMap::new();
        let addr = loop {
            let line = lines.next().expect("target exited early").unwrap();
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["segment", name, id, len, token] => {
                    segments.insert(
                        name.to_string(),
                        SegInfo {
                            id: id.parse().unwrap(),
                            len: len.parse().unwrap(),
                            token: token.parse().unwrap(),
                            base: 0,
                        },
                    );
                }
                ["listening", addr] => break addr.parse().unwrap(),
                _ => panic!("unexpected target output {line:?}"),
            }
        };
        TargetProcess {
            child,
            addr,
            segments,
        }
    }

    pub fn seg(&self, name: &str) -> &SegInfo {
        &self.segments[name]
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `sig` to the target process; for SIGSTOP, returns once every
    /// thread of it has stopped. The kernel wakes one thread for a stop
    /// signal and that one stops the rest, so right after kill(2) the
    /// target's reactor thread can still answer for a while.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) takes no pointers.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
        if sig == libc::SIGSTOP {
            quiesce_runtime::process::wait_stopped(self.pid() as u32, Duration::from_secs(10))
                .unwrap();
        }
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Commands for an in-process target on its own shard.
pub enum Cmd {
    /// Block the target's thread for a while (say when it starts).
    Stall {
        for_: Duration,
        started: mpsc::Sender<()>,
    },
    /// Copy `len` bytes at `offset` of segment `name` out of the target's memory.
    Snapshot {
        name: String,
        offset: u64,
        len: usize,
        reply: mpsc::Sender<Vec<u8>>,
    },
    /// Deregister segment `name`.
    Deregister {
        name: String,
        reply: mpsc::Sender<bool>,
    },
    /// Report the engine's stats.
    Stats {
        reply: mpsc::Sender<quiesce_transports::EngineStats>,
    },
    /// Revoke `range` of segment `name`; answer once it resolved.
    Revoke {
        name: String,
        range: std::ops::Range<u64>,
        reply: mpsc::Sender<Result<(), quiesce_transports::RevokeError>>,
    },
}

/// A target engine on another thread (a shard of this process).
pub struct ShardTarget {
    pub addr: SocketAddr,
    pub segments: HashMap<String, SegInfo>,
    cmds: Sender<Cmd>,
    shards: Option<Shards<()>>,
}

impl ShardTarget {
    pub fn start(cfg: EngineConfig, segs: &[(&str, usize, Rights)]) -> ShardTarget {
        let (cmd_tx, cmd_rx) = channel::<Cmd>();
        let cmd_rx = std::sync::Arc::new(std::sync::Mutex::new(Some(cmd_rx)));
        let (ready_tx, ready_rx) = mpsc::channel();
        let segs: Vec<(String, usize, Rights)> = segs
            .iter()
            .map(|(n, l, r)| (n.to_string(), *l, *r))
            .collect();
        let shards = Shards::builder()
            .count(1)
            .pin(false)
            .name("target-shard")
            .spawn(move |shard| {
                let (cfg, segs, ready_tx) = (cfg.clone(), segs.clone(), ready_tx.clone());
                let mut rx = cmd_rx.lock().unwrap().take().unwrap();
                async move {
                    let engine = Engine::bind(cfg).unwrap();
                    let mut info = HashMap::new();
                    let mut handles = HashMap::new();
                    for (name, len, rights) in segs {
                        let seg = engine.register(&name, vec![0u8; len], rights).unwrap();
                        info.insert(
                            name.clone(),
                            SegInfo {
                                id: seg.id(),
                                len: seg.len(),
                                token: seg.token(),
                                base: seg.base(),
                            },
                        );
                        handles.insert(name, seg);
                    }
                    ready_tx.send((engine.local_addr(), info)).unwrap();
                    let serve = async {
                        while let Some(cmd) = rx.recv().await {
                            match cmd {
                                Cmd::Snapshot {
                                    name,
                                    offset,
                                    len,
                                    reply,
                                } => {
                                    let mut v = vec![0u8; len];
                                    assert!(handles[&name].read_at(offset, &mut v));
                                    let _ = reply.send(v);
                                }
                                Cmd::Deregister { name, reply } => {
                                    let _ = reply.send(engine.deregister(handles[&name].id()));
                                }
                                Cmd::Stats { reply } => {
                                    let _ = reply.send(engine.stats());
                                }
                                Cmd::Revoke { name, range, reply } => {
                                    let _ = reply.send(handles[&name].revoke(range).await);
                                }
                                Cmd::Stall { for_, started } => {
                                    // Freeze the whole shard, like SIGSTOP would a process.
                                    let _ = started.send(());
                                    std::thread::sleep(for_);
                                }
                            }
                        }
                    };
                    let stop = shard.shutdown_requested();
                    futures_select(serve, stop).await;
                    engine.shutdown();
                }
            })
            .unwrap();
        let (addr, segments) = ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        ShardTarget {
            addr,
            segments,
            cmds: cmd_tx,
            shards: Some(shards),
        }
    }

    pub fn seg(&self, name: &str) -> &SegInfo {
        &self.segments[name]
    }

    pub fn snapshot(&self, name: &str, offset: u64, len: usize) -> Vec<u8> {
        let (tx, rx) = mpsc::channel();
        self.cmds
            .send(Cmd::Snapshot {
                name: name.into(),
                offset,
                len,
                reply: tx,
            })
            .ok()
            .unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    }

    pub fn deregister(&self, name: &str) -> bool {
        let (tx, rx) = mpsc::channel();
        self.cmds
            .send(Cmd::Deregister {
                name: name.into(),
                reply: tx,
            })
            .ok()
            .unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    }

    /// Freezes the target's shard for `d`; returns once the freeze began.
    pub fn stall(&self, d: Duration) {
        let (tx, rx) = mpsc::channel();
        self.cmds
            .send(Cmd::Stall {
                for_: d,
                started: tx,
            })
            .ok()
            .unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    }

    /// Revokes `range` of segment `name` at the target (its owner's call);
    /// returns once the revoke resolved there.
    pub fn revoke(
        &self,
        name: &str,
        range: std::ops::Range<u64>,
    ) -> Result<(), quiesce_transports::RevokeError> {
        let (tx, rx) = mpsc::channel();
        self.cmds
            .send(Cmd::Revoke {
                name: name.into(),
                range,
                reply: tx,
            })
            .ok()
            .unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    }

    pub fn stats(&self) -> quiesce_transports::EngineStats {
        let (tx, rx) = mpsc::channel();
        self.cmds.send(Cmd::Stats { reply: tx }).ok().unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    }
}

impl Drop for ShardTarget {
    fn drop(&mut self) {
        if let Some(s) = self.shards.take() {
            for r in s.shutdown() {
                r.unwrap();
            }
        }
    }
}

/// Runs `a` and `b` until either finishes.
pub async fn futures_select(
    a: impl std::future::Future<Output = ()>,
    b: impl std::future::Future<Output = ()>,
) {
    let mut a = std::pin::pin!(a);
    let mut b = std::pin::pin!(b);
    std::future::poll_fn(|cx| {
        if a.as_mut().poll(cx).is_ready() || b.as_mut().poll(cx).is_ready() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(131)
                .wrapping_add(seed ^ (i >> 12) as u8)
        })
        .collect()
}

/// A fresh engine connected to `addr`, with segment `name` opened.
pub async fn open_segment(
    addr: SocketAddr,
    name: &str,
    token: Token,
) -> (Engine, quiesce_transports::RemoteSegment) {
    let e = Engine::bind(EngineConfig::default()).unwrap();
    let seg = e
        .connect(addr)
        .await
        .unwrap()
        .open(name, token)
        .await
        .unwrap();
    (e, seg)
}

/// A blocking client that speaks the wire protocol by hand, to send what a
/// well-behaved initiator never would.
pub struct RawClient {
    pub s: std::net::TcpStream,
    pub ack: HelloAck,
    nonce: [u8; 16],
    /// The session's key if this connection created it.
    pub key: Option<[u8; 16]>,
    join: [u8; 32],
}

impl RawClient {
    /// A connection in a new session.
    pub fn connect(addr: SocketAddr) -> RawClient {
        Self::connect_in(addr, None)
    }

    /// A connection joining `session` (its id and key), or a new one.
    pub fn connect_in(addr: SocketAddr, session: Option<(u64, [u8; 16])>) -> RawClient {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let nonce = [9u8; 16];
        let hello = Hello {
            version_min: VERSION,
            version_max: VERSION,
            session: session.map_or(0, |(id, _)| id),
            shards: 1,
            nonce,
            node: "raw".into(),
        }
        .encode()
        .unwrap();
        send(
            &mut s,
            &Header {
                length: hello.len() as u64,
                ..Header::new(Opcode::Hello)
            },
            &hello,
        );
        let h = recv_header(&mut s).expect("hello ack");
        assert_eq!(h.op, Opcode::HelloAck);
        let mut p = vec![0u8; h.length as usize];
        s.read_exact(&mut p).unwrap();
        let ack = HelloAck::decode(&p).unwrap();
        let (key, join) = if ack.session_key != [0; 16] {
            (Some(ack.session_key), [0; 32])
        } else {
            let (_, k) = session.expect("the target joined a session nobody asked for");
            (None, join_proof(&k, &ack.nonce, &nonce, ack.session))
        };
        RawClient {
            s,
            ack,
            nonce,
            key,
            join,
        }
    }

    /// The session id and key, to join it from another connection.
    pub fn session(&self) -> (u64, [u8; 16]) {
        (
            self.ack.session,
            self.key.expect("this connection created its session"),
        )
    }

    /// Proves `token` for segment `id`.
    pub fn auth(&mut self, id: u64, token: Token) -> AuthAck {
        self.auth_ref(SegmentRef::Id(id), token)
    }

    /// The target's verdict on `token` for segment `id`.
    pub fn auth_status(&mut self, id: u64, token: Token) -> quiesce_transports::wire::Status {
        self.auth(id, token).results[0].0
    }

    /// Proves `token` for `seg` (by id or by name).
    pub fn auth_ref(&mut self, seg: SegmentRef, token: Token) -> AuthAck {
        self.auth_granted(seg, token, GrantReceipt::NONE)
    }

    /// Proves `token` for `seg`, asking for the grant `grant` names.
    pub fn auth_granted(&mut self, seg: SegmentRef, token: Token, grant: GrantReceipt) -> AuthAck {
        let proof = prove(&token, &self.ack.nonce, &self.nonce, self.ack.session, &seg);
        let p = AuthRequest {
            join: self.join,
            proofs: vec![(seg, proof, grant)],
        }
        .encode()
        .unwrap();
        send(
            &mut self.s,
            &Header {
                length: p.len() as u64,
                ..Header::new(Opcode::Auth)
            },
            &p,
        );
        let h = recv_header(&mut self.s).unwrap();
        assert_eq!(h.op, Opcode::AuthAck);
        let mut b = vec![0u8; h.length as usize];
        self.s.read_exact(&mut b).unwrap();
        AuthAck::decode(&b).unwrap()
    }

    /// Sends one `Auth` proving each token for its segment reference (the
    /// answer is left to `recv`).
    pub fn send_auth(&mut self, refs: &[(SegmentRef, Token)]) {
        let frame = self.auth_frame(refs);
        self.s.write_all(&frame).unwrap();
    }

    /// The bytes of an `Auth` frame proving each token for its segment
    /// reference on this connection.
    pub fn auth_frame(&self, refs: &[(SegmentRef, Token)]) -> Vec<u8> {
        let proofs = refs
            .iter()
            .map(|(seg, token)| {
                let p = prove(token, &self.ack.nonce, &self.nonce, self.ack.session, seg);
                (seg.clone(), p, GrantReceipt::NONE)
            })
            .collect();
        let p = AuthRequest {
            join: self.join,
            proofs,
        }
        .encode()
        .unwrap();
        let h = Header {
            length: p.len() as u64,
            ..Header::new(Opcode::Auth)
        };
        let mut v = h.encode().to_vec();
        v.extend_from_slice(&p);
        v
    }

    pub fn send(&mut self, h: &Header, payload: &[u8]) {
        send(&mut self.s, h, payload)
    }

    pub fn recv(&mut self) -> Option<Header> {
        recv_header(&mut self.s)
    }
}

pub fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// The proof a real initiator computes (HMAC-SHA256 over the documented
/// message, PROTOCOL.md §4.3), written out independently of the library.
pub fn prove(
    token: &Token,
    target_nonce: &[u8; 16],
    my_nonce: &[u8; 16],
    session: u64,
    seg: &SegmentRef,
) -> [u8; 32] {
    let key: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&token.to_string()[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let reference = match seg {
        SegmentRef::Id(id) => [&[0u8][..], &id.to_le_bytes()].concat(),
        SegmentRef::Name(n) => [&[1u8, n.len() as u8][..], n.as_bytes()].concat(),
        SegmentRef::Address(a) => [&[2u8][..], &a.to_le_bytes()].concat(),
        SegmentRef::First => vec![3u8],
    };
    hmac(
        &key,
        &[
            b"quiesce-auth-v2",
            target_nonce,
            my_nonce,
            &session.to_le_bytes(),
            &reference,
        ],
    )
}

/// The join proof of PROTOCOL.md §4.3.
pub fn join_proof(
    key: &[u8; 16],
    target_nonce: &[u8; 16],
    my_nonce: &[u8; 16],
    session: u64,
) -> [u8; 32] {
    hmac(
        key,
        &[
            b"quiesce-join-v1",
            target_nonce,
            my_nonce,
            &session.to_le_bytes(),
        ],
    )
}

pub fn send(s: &mut std::net::TcpStream, h: &Header, payload: &[u8]) {
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    s.write_all(&v).unwrap();
}

/// The next header, or `None` if the target closed the connection.
pub fn recv_header(s: &mut std::net::TcpStream) -> Option<Header> {
    let mut b = [0u8; HEADER_LEN];
    match s.read_exact(&mut b) {
        Ok(()) => Some(Header::decode(&b).unwrap()),
        Err(_) => None,
    }
}
