//! The usual alternative: the same protocol on tokio (`current_thread`),
//! written the way a service would (one stream, `write_all`/`read_exact`).

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::Instant;

use quiesce::transports::wire::{Header, HelloAck, Opcode, Status, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{Case, Sample, SegInfo};

struct Conn {
    s: TcpStream,
    kv: u64,
    ro: u64,
    next: u64,
}

async fn read_header(s: &mut TcpStream) -> std::io::Result<Header> {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).await?;
    Header::decode(&b).map_err(std::io::Error::other)
}

impl Conn {
    async fn connect(
        addr: SocketAddr,
        kv: &SegInfo,
        ro: Option<&SegInfo>,
        congestion: Option<&str>,
    ) -> std::io::Result<Conn> {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        if let Some(name) = congestion {
            quiesce::runtime::net::set_tcp_congestion(s.as_fd(), name)?;
        }
        let nonce = [3u8; 16];
        s.write_all(&super::hello_frame(nonce, "tokio")).await?;
        let h = read_header(&mut s).await?;
        let mut p = vec![0u8; h.length as usize];
        s.read_exact(&mut p).await?;
        let ack = HelloAck::decode(&p).map_err(std::io::Error::other)?;
        let proofs = super::proven(kv, ro);
        s.write_all(&super::auth_frame(&ack, nonce, &proofs))
            .await?;
        let h = read_header(&mut s).await?;
        let mut p = vec![0u8; h.length as usize];
        s.read_exact(&mut p).await?;
        super::auth_accepted(&p, &proofs)?;
        Ok(Conn {
            s,
            kv: kv.id,
            ro: ro.map_or(0, |r| r.id),
            next: 1,
        })
    }

    async fn send_write(&mut self, seg: u64, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let (head, rest) = super::write_frame(self.next, seg, offset, data);
        self.next += 1;
        self.s.write_all(&head).await?;
        if !rest.is_empty() {
            self.s.write_all(rest).await?;
        }
        Ok(())
    }

    async fn status(&mut self) -> std::io::Result<Status> {
        read_header(&mut self.s)
            .await?
            .status()
            .map_err(std::io::Error::other)
    }
}

/// One connection on its own `current_thread` runtime, kept across runs.
pub struct Tokio {
    rt: tokio::runtime::Runtime,
    c: Conn,
}

impl Tokio {
    /// Starts the runtime, connects, says hello and proves the tokens.
    pub fn connect(
        addr: SocketAddr,
        kv: &SegInfo,
        ro: Option<&SegInfo>,
        congestion: Option<&str>,
    ) -> std::io::Result<Tokio> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let c = rt.block_on(Conn::connect(addr, kv, ro, congestion))?;
        Ok(Tokio { rt, c })
    }

    /// Runs `iters` iterations of `case`; one sample per iteration.
    pub fn run(&mut self, case: Case, iters: usize) -> std::io::Result<Vec<Sample>> {
        let c = &mut self.c;
        self.rt.block_on(async {
            let size = case.size();
            let mut buf = vec![0x5au8; size];
            let mut out = Vec::with_capacity(iters);
            for _ in 0..iters {
                let a0 = super::allocations();
                let t0 = Instant::now();
                match case {
                    Case::Write(_) => {
                        c.send_write(c.kv, 0, &buf).await?;
                        super::expect_ok(c.status().await?)?;
                    }
                    Case::Read(_) => {
                        let h = Header {
                            task: c.next,
                            segment: c.kv,
                            length: size as u64,
                            ..Header::new(Opcode::Read)
                        };
                        c.next += 1;
                        c.s.write_all(&h.encode()).await?;
                        let r = read_header(&mut c.s).await?;
                        if r.op != Opcode::ReadData {
                            let st = r.status().map_err(std::io::Error::other)?;
                            return Err(std::io::Error::other(format!("read refused: {st:?}")));
                        }
                        c.s.read_exact(&mut buf).await?;
                    }
                    Case::Batch { tasks, size } => {
                        for i in 0..tasks {
                            c.send_write(c.kv, (i * size) as u64, &buf[..size]).await?;
                        }
                        for _ in 0..tasks {
                            super::expect_ok(c.status().await?)?;
                        }
                    }
                    Case::FailFast(_) => {
                        c.send_write(c.ro, 0, &buf[..4096]).await?;
                        c.send_write(c.kv, 0, &buf).await?;
                        super::expect_refused(c.status().await?)?;
                        super::expect_ok(c.status().await?)?;
                    }
                }
                out.push(Sample::unfenced(case, t0, a0));
            }
            Ok(out)
        })
    }
}
