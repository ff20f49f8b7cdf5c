//! A private etcd server: one member, its own ports and data directory,
//! stopped and removed on drop. The tests start one each (no mock of etcd
//! anywhere); `quiesce` can start one for a dev cluster.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
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

fn free_port(ip: IpAddr) -> io::Result<u16> {
    Ok(TcpListener::bind(SocketAddr::new(ip, 0))?
        .local_addr()?
        .port())
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
    pub fn start() -> io::Result<LocalEtcd> {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        Self::start_with(ip, free_port(ip)?, free_port(ip)?, &[])
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
                    return Err(io::Error::other(format!(
                        "etcd exited ({status}): {}",
                        self.log_tail()
                    )));
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
