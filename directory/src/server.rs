//! A private etcd server: one member, its own ports and data directory,
//! stopped and removed on drop. The tests start one each (no mock of etcd
//! anywhere); `quiesce` can start one for a dev cluster.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a fresh etcd gets to answer `/health`.
const READY_WITHIN: Duration = Duration::from_secs(20);

/// A running (or stopped) private etcd.
pub struct LocalEtcd {
    ip: IpAddr,
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    wrapper: Vec<String>,
    child: Option<Child>,
}

/// Ports the kernel may give a connecting socket
/// (`/proc/sys/net/ipv4/ip_local_port_range`; Linux's default when that
/// cannot be read).
fn ephemeral_ports() -> RangeInclusive<u16> {
    let read = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok();
    let mut ports = read
        .as_deref()
        .unwrap_or("")
        .split_whitespace()
        .map(|p| p.parse::<u16>().ok());
    match (ports.next().flatten(), ports.next().flatten()) {
        (Some(lo), Some(hi)) if lo <= hi => lo..=hi,
        _ => 32768..=60999,
    }
}

/// The lowest port [`free_port`] picks: below it lie the ports services
/// are configured on.
const LOWEST_PICKED: u16 = 10_000;

/// A port nothing on `ip` is bound to now, outside the ephemeral range: a
/// port the kernel chose (binding port 0) can be handed to any connecting
/// socket between this probe and etcd's bind, or while etcd is stopped for
/// a restart, and etcd then exits with "address already in use". Each probe
/// in this process tries a port no earlier probe tried, starting from one
/// that depends on the process id, so two etcds started at once get two.
fn free_port(ip: IpAddr) -> io::Result<u16> {
    static PROBES: AtomicU32 = AtomicU32::new(0);
    let eph = ephemeral_ports();
    let below = LOWEST_PICKED..(*eph.start()).max(LOWEST_PICKED);
    let above = eph.end().saturating_add(1).max(LOWEST_PICKED)..u16::MAX;
    let count = below.len() as u32 + above.len() as u32;
    if count == 0 {
        // The whole range is ephemeral: the kernel's choice is the best left.
        return Ok(TcpListener::bind(SocketAddr::new(ip, 0))?
            .local_addr()?
            .port());
    }
    let start = std::process::id().wrapping_mul(7_919);
    for _ in 0..count.min(4_096) {
        let i = start.wrapping_add(PROBES.fetch_add(1, Ordering::Relaxed)) % count;
        let port = match i.checked_sub(below.len() as u32) {
            None => below.start + i as u16,
            Some(j) => above.start + j as u16,
        };
        if TcpListener::bind(SocketAddr::new(ip, port)).is_ok() {
            return Ok(port);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!("no free port on {ip} outside the ephemeral range {eph:?}"),
    ))
}

/// The etcd binary: `QUIESCE_ETCD`, else `etcd` on the path.
fn binary() -> String {
    std::env::var("QUIESCE_ETCD").unwrap_or_else(|_| "etcd".into())
}

impl LocalEtcd {
    /// Whether an etcd binary can be run here.
    pub fn available() -> bool {
        Command::new(binary())
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts etcd on free ports of 127.0.0.1 and waits until it is healthy.
    /// Ports taken between the probe and etcd's bind (by another process's
    /// explicit bind) are given up for fresh ones, a few times.
    pub fn start() -> io::Result<LocalEtcd> {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let mut tries = 0;
        loop {
            tries += 1;
            match Self::start_with(ip, free_port(ip)?, free_port(ip)?, &[]) {
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && tries < 4 => {}
                done => return done,
            }
        }
    }

    /// Starts etcd listening on `ip` (client `client_port`, peer
    /// `peer_port`), run through `wrapper` (e.g. `["ip", "netns", "exec",
    /// "ns1"]`; empty to run it directly). `ip` must be reachable from the
    /// calling process: readiness is checked from here.
    pub fn start_with(
        ip: IpAddr,
        client_port: u16,
        peer_port: u16,
        wrapper: &[&str],
    ) -> io::Result<LocalEtcd> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "quiesce-etcd-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let mut e = LocalEtcd {
            ip,
            client_port,
            peer_port,
            dir,
            wrapper: wrapper.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        e.restart()?;
        Ok(e)
    }

    /// `ip:port` of its client endpoint.
    pub fn endpoint(&self) -> String {
        SocketAddr::new(self.ip, self.client_port).to_string()
    }

    /// The directory URL for `prefix`: `etcd://ip:port/prefix`.
    pub fn url(&self, prefix: &str) -> String {
        format!("etcd://{}/{prefix}", self.endpoint())
    }

    /// Starts it again (after [`LocalEtcd::stop`] or [`LocalEtcd::wipe`]) on
    /// the same ports, and waits until it is healthy.
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        let client = format!("http://{}", self.endpoint());
        let peer = format!("http://{}", SocketAddr::new(self.ip, self.peer_port));
        let log = std::fs::File::create(self.dir.join("etcd.log"))?;
        let mut cmd = match self.wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(binary());
                c
            }
            None => Command::new(binary()),
        };
        cmd.arg("--name=quiesce-test")
            .arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=quiesce-test={peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.child = Some(cmd.spawn()?);
        let started = Instant::now();
        while started.elapsed() < READY_WITHIN {
            if self.healthy() {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    let tail = self.log_tail();
                    let kind = if tail.contains("address already in use") {
                        io::ErrorKind::AddrInUse
                    } else {
                        io::ErrorKind::Other
                    };
                    return Err(io::Error::new(
                        kind,
                        format!("etcd exited ({status}): {tail}"),
                    ));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(io::Error::other(format!(
            "etcd not healthy within {READY_WITHIN:?}: {}",
            self.log_tail()
        )))
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    /// Whether `/health` answers `true`.
    pub fn healthy(&self) -> bool {
        let addr = SocketAddr::new(self.ip, self.client_port);
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let req = format!("GET /health HTTP/1.0\r\nHost: {}\r\n\r\n", self.endpoint());
        let mut body = String::new();
        s.write_all(req.as_bytes()).is_ok()
            && s.read_to_string(&mut body).is_ok()
            && body.contains("\"health\":\"true\"")
    }

    /// Kills it (SIGKILL) and waits; the data directory stays.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills it and removes its data: a restart comes back empty.
    pub fn wipe(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(self.dir.join("data"));
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picked_ports_are_distinct_and_outside_the_ephemeral_range() {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let eph = ephemeral_ports();
        if *eph.start() <= LOWEST_PICKED && *eph.end() == u16::MAX {
            eprintln!("skipped: every port from {LOWEST_PICKED} up is ephemeral here");
            return;
        }
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let port = free_port(ip).unwrap();
            assert!(!eph.contains(&port), "{port} is in {eph:?}");
            assert!(seen.insert(port), "{port} picked twice");
        }
    }
}
