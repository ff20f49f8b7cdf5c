//! The limit: a `std::net` initiator speaking the same frames on a single
//! stream, with nothing else (no slicing, no fencing, no buffers moved
//! anywhere). It blocks, or — when quiesce's initiators spin (`--spin-us`)
//! — spins on a non-blocking socket, so that neither side of a comparison
//! pays a wake-up the other does not.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::Instant;

use quiesce::transports::wire::{Header, HelloAck, Opcode, Status, HEADER_LEN};

use super::{Case, Sample, SegInfo};

/// One connection that has said hello and proven the tokens.
pub struct Raw {
    s: TcpStream,
    kv: u64,
    ro: u64,
    next: u64,
}

/// `read_exact` that also retries `WouldBlock` (a spinning client's socket).
fn read_full(s: &mut TcpStream, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` that also retries `WouldBlock` (a spinning client's socket).
fn write_full(s: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_header(s: &mut TcpStream) -> std::io::Result<Header> {
    let mut b = [0u8; HEADER_LEN];
    read_full(s, &mut b)?;
    Header::decode(&b).map_err(std::io::Error::other)
}

impl Raw {
    /// Connects and proves the tokens; `spin`: the data path then busy-polls
    /// a non-blocking socket instead of blocking.
    pub fn connect(
        addr: SocketAddr,
        kv: &SegInfo,
        ro: Option<&SegInfo>,
        spin: bool,
        congestion: Option<&str>,
    ) -> std::io::Result<Raw> {
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        if let Some(name) = congestion {
            quiesce::runtime::net::set_tcp_congestion(s.as_fd(), name)?;
        }
        let nonce = [7u8; 16];
        s.write_all(&super::hello_frame(nonce, "raw"))?;
        let h = read_header(&mut s)?;
        let mut p = vec![0u8; h.length as usize];
        s.read_exact(&mut p)?;
        let ack = HelloAck::decode(&p).map_err(std::io::Error::other)?;
        let proofs = super::proven(kv, ro);
        s.write_all(&super::auth_frame(&ack, nonce, &proofs))?;
        let h = read_header(&mut s)?;
        let mut p = vec![0u8; h.length as usize];
        s.read_exact(&mut p)?;
        super::auth_accepted(&p, &proofs)?;
        s.set_nonblocking(spin)?;
        Ok(Raw {
            s,
            kv: kv.id,
            ro: ro.map_or(0, |r| r.id),
            next: 1,
        })
    }

    /// Sends the header of a write of `len` bytes to `kv` at `offset`; the
    /// payload follows through [`send_payload`](Self::send_payload).
    pub(crate) fn send_write_header(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
        let h = Header {
            task: self.next,
            segment: self.kv,
            offset,
            length: len,
            ..Header::new(Opcode::Write)
        };
        self.next += 1;
        write_full(&mut self.s, &h.encode())
    }

    /// Sends payload bytes of the write whose header went last.
    pub(crate) fn send_payload(&mut self, data: &[u8]) -> std::io::Result<()> {
        write_full(&mut self.s, data)
    }

    /// The `ro` segment's id (the one whose writes are refused).
    pub(crate) fn ro(&self) -> u64 {
        self.ro
    }

    /// Sends one write frame (header, then payload; small ones in one send).
    pub(crate) fn send_write(&mut self, seg: u64, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let (head, rest) = super::write_frame(self.next, seg, offset, data);
        self.next += 1;
        write_full(&mut self.s, &head)?;
        if !rest.is_empty() {
            write_full(&mut self.s, rest)?;
        }
        Ok(())
    }

    pub(crate) fn status(&mut self) -> std::io::Result<Status> {
        let h = read_header(&mut self.s)?;
        h.status().map_err(std::io::Error::other)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.send_write(self.kv, offset, data)?;
        super::expect_ok(self.status()?)
    }

    pub(crate) fn read(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let h = Header {
            task: self.next,
            segment: self.kv,
            offset,
            length: buf.len() as u64,
            ..Header::new(Opcode::Read)
        };
        self.next += 1;
        write_full(&mut self.s, &h.encode())?;
        let r = read_header(&mut self.s)?;
        if r.op != Opcode::ReadData {
            return Err(std::io::Error::other(format!(
                "read refused: {:?}",
                r.status()
            )));
        }
        read_full(&mut self.s, buf)
    }

    /// Runs `iters` iterations of `case`; one sample per iteration.
    pub fn run(&mut self, case: Case, iters: usize) -> std::io::Result<Vec<Sample>> {
        let size = case.size();
        let mut buf = vec![0x5au8; size];
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let a0 = super::allocations();
            let t0 = Instant::now();
            match case {
                Case::Write(_) => self.write(0, &buf)?,
                Case::Read(_) => self.read(0, &mut buf)?,
                Case::Batch { tasks, size } => {
                    // Pipelined on the one stream: all frames, then all answers.
                    for i in 0..tasks {
                        self.send_write(self.kv, (i * size) as u64, &buf[..size])?;
                    }
                    for _ in 0..tasks {
                        super::expect_ok(self.status()?)?;
                    }
                }
                Case::FailFast(_) => {
                    // No fence exists here: the only safe moment is when the
                    // large write has been sent and answered, whatever the
                    // small one's fate.
                    self.send_write(self.ro, 0, &buf[..4096])?;
                    self.send_write(self.kv, 0, &buf)?;
                    super::expect_refused(self.status()?)?;
                    super::expect_ok(self.status()?)?;
                }
            }
            out.push(Sample::unfenced(case, t0, a0));
        }
        Ok(out)
    }
}
