//! Who holds a TCP connection: the check that makes a peer's claimed pid
//! trustworthy before either side attaches to its memory.
//!
//! A peer says which process it is; cross-memory attach would then read and
//! write that process's memory. A peer that named another process (one the
//! engine's user may access, which it could otherwise not reach) would turn
//! the engine into a confused deputy. So a pid is accepted only if that
//! process holds the very socket of this connection: the connection's entry
//! in `/proc/net/tcp{,6}` (this network namespace) gives the socket's inode,
//! and one of the process's descriptors (`/proc/PID/fd`) must link to it.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Why process `pid` may not be attached to for its user, if so. The
/// target copies with its own credentials for as long as the connection
/// lives, while the process may change: its child keeping the socket, it
/// may exec a setuid program, whose memory a target with more rights than
/// the initiator (root) could then reach. So only a process all of whose
/// user ids are the target's effective one attaches — a root target takes
/// root processes only — and a target that is not root but may ptrace any
/// process (`CAP_SYS_PTRACE`) takes none.
pub(crate) fn refuses_user(pid: u32) -> io::Result<Option<&'static str>> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let uids = uids(pid)?;
    if uids.len() != 4 || uids.iter().any(|&u| u != u64::from(me)) {
        return Ok(Some("the process runs as another user"));
    }
    if me != 0 {
        let mine = std::fs::read_to_string("/proc/self/status")?;
        let cap_eff = mine
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0);
        const CAP_SYS_PTRACE: u32 = 19;
        if cap_eff & (1 << CAP_SYS_PTRACE) != 0 {
            return Ok(Some(
                "this target may ptrace any process (CAP_SYS_PTRACE) without being root",
            ));
        }
    }
    Ok(None)
}

/// Whether process `pid` may write this process's memory, as a target's
/// answers to an attached initiator claim it did: it runs as this
/// process's own user (every one of its user ids), or as root. A process
/// of another user cannot, so what it says it copied never was; an
/// initiator attaches to none.
pub(crate) fn may_write_here(pid: u32) -> io::Result<bool> {
    // SAFETY: geteuid has no preconditions.
    let me = u64::from(unsafe { libc::geteuid() });
    let uids = uids(pid)?;
    Ok(uids.len() == 4 && (uids.iter().all(|&u| u == me) || uids.iter().all(|&u| u == 0)))
}

/// Process `pid`'s user ids (real, effective, saved, file system), as
/// `/proc/PID/status` lists them; empty if it lists none.
fn uids(pid: u32) -> io::Result<Vec<u64>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .map(|v| {
            v.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default())
}

/// True if process `pid` holds the socket whose local end is `local` and
/// whose remote end is `remote`.
pub(crate) fn holds_socket(pid: u32, local: SocketAddr, remote: SocketAddr) -> io::Result<bool> {
    let Some(inode) = socket_inode(local, remote)? else {
        return Ok(false);
    };
    let want = format!("socket:[{inode}]");
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(link) = std::fs::read_link(entry?.path()) else {
            continue; // closed while we looked
        };
        if link.as_os_str() == want.as_str() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The inode of the socket `local` → `remote`, from `/proc/net/tcp` or
/// `/proc/net/tcp6`.
fn socket_inode(local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u64>> {
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = match std::fs::read_to_string(table) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode …
            if f.len() < 10 {
                continue;
            }
            if same(parse_endpoint(f[1]), local) && same(parse_endpoint(f[2]), remote) {
                return Ok(f[9].parse().ok());
            }
        }
    }
    Ok(None)
}

/// Equal endpoints, an IPv4-mapped IPv6 address equal to its IPv4 one.
fn same(seen: Option<SocketAddr>, want: SocketAddr) -> bool {
    let canon = |a: SocketAddr| match a.ip() {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(a, |v4| SocketAddr::new(IpAddr::V4(v4), a.port())),
        IpAddr::V4(_) => a,
    };
    seen.is_some_and(|s| canon(s) == canon(want))
}

/// `0100007F:1F90` → 127.0.0.1:8080. The kernel prints the address as
/// 32-bit words in this host's byte order.
fn parse_endpoint(s: &str) -> Option<SocketAddr> {
    let (addr, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(addr.get(i * 8..i * 8 + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernels_endpoints() {
        let v4 = parse_endpoint("0100007F:1F90").unwrap();
        assert_eq!(v4, "127.0.0.1:8080".parse().unwrap());
        let v6 = parse_endpoint("00000000000000000000000001000000:0050").unwrap();
        assert_eq!(v6, "[::1]:80".parse().unwrap());
        assert!(parse_endpoint("zz:1").is_none());
    }

    #[test]
    fn only_the_process_holding_the_socket_is_accepted() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        let (local, remote) = (c.local_addr().unwrap(), c.peer_addr().unwrap());
        assert!(holds_socket(std::process::id(), local, remote).unwrap());
        assert!(
            holds_socket(std::process::id(), remote, local).unwrap(),
            "the accepted end"
        );
        // Another process of the same user does not hold it.
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let other = holds_socket(child.id(), local, remote);
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!other.unwrap());
        drop(a);
    }
}
