//! A cluster of network namespaces on one machine, for tests across
//! "hosts": each host is a namespace with one veth link to a bridge in a
//! switch namespace of its own (the machine's own namespace is never
//! touched). A host's egress takes a delay with jitter (a user-space delay
//! line, [`Cluster::delay`]: this kernel has no `tc netem`), random loss (nftables)
//! and a rate limit (tbf); links go down and up (partitions: nothing
//! answers, nothing resets). Needs root and iproute2 (iptables for delays);
//! only addresses inside `10.214.N.0/24` are used, N from the process id
//! (each cluster's bridge is its own, so two clusters never meet).

use std::collections::HashMap;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::Mutex;

mod delay;

use delay::DelayLine;
pub use delay::{Delay, DelayStats};

/// One namespace of the cluster.
pub struct Host {
    /// Its namespace's name (`ip netns`).
    pub netns: String,
    /// Its address on the cluster's link.
    pub ip: IpAddr,
    /// Its end of the link (inside `netns`).
    dev: String,
    /// The bridge's end (inside the switch namespace).
    port: String,
}

/// Hosts joined by a bridge; removed on drop.
pub struct Cluster {
    switch: String,
    /// The hosts, in the order they were asked for.
    pub hosts: Vec<Host>,
    /// Delay lines on hosts' egress, by host.
    delays: Mutex<HashMap<usize, DelayLine>>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

impl Cluster {
    /// Whether this process may build one and shape its links (root,
    /// iproute2's ip and tc, nft for loss, iptables for delays).
    pub fn available() -> bool {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let tool = |t: &str| {
            Command::new(t)
                .arg("-V")
                .output()
                .is_ok_and(|o| o.status.success())
        };
        root && tool("ip") && tool("tc") && tool("nft") && tool("iptables")
    }

    /// `n` hosts, `10.214.N.1` … `10.214.N.n`, all links up.
    pub fn new(n: usize) -> Result<Cluster, String> {
        assert!((1..=200).contains(&n));
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = format!("{}x{k}", std::process::id());
        // Each cluster has a bridge of its own: the same subnet in two never meets.
        let net = (std::process::id() % 200 + 20) as u8;
        let switch = format!("qzsw{pid}");
        let mut c = Cluster {
            switch: switch.clone(),
            hosts: Vec::new(),
            delays: Mutex::default(),
        };
        ip(&["netns", "add", &switch])?;
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let h = Host {
                netns: format!("qzh{pid}-{i}"),
                ip: IpAddr::V4(Ipv4Addr::new(10, 214, net, i as u8 + 1)),
                dev: format!("qzh{i}"),
                port: format!("qzp{i}"),
            };
            ip(&["netns", "add", &h.netns])?;
            // Ours from now on: a step below that fails drops `c`, whose
            // Drop deletes every namespace in `hosts`.
            c.hosts.push(h);
            let h = c.hosts.last().expect("just pushed");
            ip(&[
                "-n", &switch, "link", "add", &h.port, "type", "veth", "peer", "name", &h.dev,
                "netns", &h.netns,
            ])?;
            ip(&["-n", &switch, "link", "set", &h.port, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &h.port, "up"])?;
            let cidr = format!("{}/24", h.ip);
            ip(&["-n", &h.netns, "addr", "add", &cidr, "dev", &h.dev])?;
            ip(&["-n", &h.netns, "link", "set", &h.dev, "up"])?;
            ip(&["-n", &h.netns, "link", "set", "lo", "up"])?;
        }
        Ok(c)
    }

    /// Moves the calling thread into host `i`'s namespace (threads it
    /// spawns afterwards are there too).
    pub fn enter(&self, i: usize) {
        let f = File::open(format!("/var/run/netns/{}", self.hosts[i].netns))
            .expect("the host's namespace");
        // SAFETY: setns takes a valid namespace fd (open for the call) and a flag.
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
    }

    /// `ip netns exec NS` for host `i`, ready for the program and its
    /// arguments (the program is exec'd, so signals reach it).
    pub fn launcher(&self, i: usize) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[i].netns]);
        c
    }

    /// Host `i`'s link to the bridge down (a partition of that host: its
    /// packets vanish, nothing resets) or up again.
    pub fn link(&self, i: usize, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        ip(&[
            "-n",
            &self.switch,
            "link",
            "set",
            &self.hosts[i].port,
            state,
        ])
    }

    /// Delays every packet host `i` sends on its link by `profile` (base ±
    /// jitter, so packets are reordered too), as `tc netem delay` would;
    /// `None` releases what is held and stops, answering what the line did.
    pub fn delay(&self, i: usize, profile: Option<Delay>) -> Result<Option<DelayStats>, String> {
        let h = &self.hosts[i];
        let iptables = |add: bool| {
            let mut args = vec![
                "netns".to_string(),
                "exec".into(),
                h.netns.clone(),
                "iptables".into(),
            ];
            args.extend(DelayLine::rule(&h.dev, add));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            ip(&args)
        };
        let mut lines = self.delays.lock().unwrap_or_else(|e| e.into_inner());
        let stopped = match lines.remove(&i) {
            Some(line) => {
                // No new packet is queued once the rule is gone; then the
                // held ones are released.
                iptables(false)?;
                Some(line.stop()?)
            }
            None => None,
        };
        if let Some(d) = profile {
            let line = DelayLine::start(&h.netns, d)?;
            iptables(true)?;
            lines.insert(i, line);
        }
        Ok(stopped)
    }

    /// Limits host `i`'s egress to `rate` (`"2gbit"`, tbf); `None` removes
    /// it.
    pub fn shape(&self, i: usize, rate: Option<&str>) -> Result<(), String> {
        self.qdisc(
            i,
            rate.map(|r| format!("tbf rate {r} burst 1mbit latency 50ms")),
        )
    }

    fn qdisc(&self, i: usize, spec: Option<String>) -> Result<(), String> {
        let h = &self.hosts[i];
        let mut args: Vec<&str> = vec!["netns", "exec", &h.netns, "tc", "qdisc"];
        match &spec {
            Some(q) => {
                args.extend(["replace", "dev", &h.dev, "root"]);
                args.extend(q.split_whitespace());
            }
            None => args.extend(["del", "dev", &h.dev, "root"]),
        }
        match (ip(&args), &spec) {
            // Deleting where nothing is set is fine.
            (Err(_), None) | (Ok(()), _) => Ok(()),
            (Err(e), Some(_)) => Err(e),
        }
    }
}

impl Cluster {
    /// Drops `percent` % of the packets host `i` receives, at random
    /// (nftables `numgen random`: works where the kernel has no netem);
    /// `None` stops dropping.
    pub fn loss(&self, i: usize, percent: Option<u32>) -> Result<(), String> {
        let ns = &self.hosts[i].netns;
        let nft = |rule: &str| ip(&["netns", "exec", ns, "nft", rule]);
        let _ = nft("delete table inet qzloss");
        if let Some(p) = percent {
            nft("add table inet qzloss")?;
            nft("add chain inet qzloss in { type filter hook input priority 0; policy accept; }")?;
            nft(&format!(
                "add rule inet qzloss in meta l4proto tcp numgen random mod 100 < {p} drop"
            ))?;
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Their threads live in the hosts' namespaces: stopped first, each
        // rule removed before its line releases what it holds.
        let delayed: Vec<usize> = self
            .delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect();
        for i in delayed {
            let _ = self.delay(i, None);
        }
        // Deleting a namespace deletes the veth ends in it, and so the pairs.
        for h in &self.hosts {
            let _ = ip(&["netns", "del", &h.netns]);
        }
        let _ = ip(&["netns", "del", &self.switch]);
    }
}
