//! A delay line for one host's egress: what `tc netem delay D J` does, in
//! user space, for kernels built without netem (this project's CI kernel:
//! `CONFIG_NET_SCH_NETEM` is unset). An iptables `NFQUEUE` rule in the
//! host's namespace hands every packet the host sends on its link to a
//! thread here, over an `nfnetlink_queue` socket made inside that
//! namespace; the thread holds each packet for `base ± jitter` (uniform)
//! and releases it with an accept verdict when its time comes — each in its
//! own time, so jitter reorders packets, as netem's does. Only the packets'
//! ids cross to user space (copy mode `META`), GSO packets stay whole, and
//! the rule has `--queue-bypass`: with no thread bound, packets pass.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A delay profile: every packet waits `base ± jitter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delay {
    /// The mean delay.
    pub base: Duration,
    /// Each packet's delay is drawn uniformly from `base - jitter ..= base + jitter`.
    pub jitter: Duration,
}

/// What a delay line did, once stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DelayStats {
    /// Packets held and released.
    pub packets: u64,
    /// Packets released before one that arrived earlier (reordered).
    pub reordered: u64,
}

/// The queue number the rules and the threads use (queues are per namespace).
const QUEUE: u16 = 7;
/// Packets the kernel holds for the queue before it drops more.
const QUEUE_MAXLEN: u32 = 1 << 16;
/// Longest the thread sleeps between looks at its stop flag.
const TICK: Duration = Duration::from_millis(5);

// nfnetlink_queue's uapi (linux/netfilter/nfnetlink_queue.h, nfnetlink.h).
const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQA_CFG_MASK: u16 = 4;
const NFQA_CFG_FLAGS: u16 = 5;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_META: u8 = 1;
const NFQA_CFG_F_GSO: u32 = 1 << 2;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NF_ACCEPT: u32 = 1;

/// A running delay line; stopped (every held packet released) on drop.
pub(crate) struct DelayLine {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<io::Result<DelayStats>>>,
}

impl DelayLine {
    /// Starts the thread in the namespace `netns` (its `/var/run/netns`
    /// name), bound to the queue; returns once it listens.
    pub(crate) fn start(netns: &str, delay: Delay) -> Result<DelayLine, String> {
        let ns = File::open(format!("/var/run/netns/{netns}"))
            .map_err(|e| format!("namespace {netns}: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("delay-{netns}"))
            .spawn(move || {
                // It moves only this thread into the namespace.
                // SAFETY: setns takes a namespace fd, open for the call, and a flag.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    let e = io::Error::last_os_error();
                    let _ = ready_tx.send(Err(format!("setns: {e}")));
                    return Err(e);
                }
                let q = match Queue::bind(QUEUE) {
                    Ok(q) => q,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("nfnetlink_queue: {e}")));
                        return Err(e);
                    }
                };
                let _ = ready_tx.send(Ok(()));
                q.run(delay, &flag)
            })
            .map_err(|e| e.to_string())?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(DelayLine {
                stop,
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err("the delay line's thread died".into()),
        }
    }

    /// Releases every held packet and stops.
    pub(crate) fn stop(mut self) -> Result<DelayStats, String> {
        self.halt()
    }

    fn halt(&mut self) -> Result<DelayStats, String> {
        self.stop.store(true, Ordering::Release);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(r)) => r.map_err(|e| e.to_string()),
            Some(Err(_)) => Err("the delay line's thread panicked".into()),
            None => Ok(DelayStats::default()),
        }
    }

    /// `iptables` arguments that add (or delete) the rule feeding the
    /// queue from `dev`'s egress.
    pub(crate) fn rule(dev: &str, add: bool) -> Vec<String> {
        let q = QUEUE.to_string();
        let op = if add { "-A" } else { "-D" };
        [
            "-t",
            "mangle",
            op,
            "OUTPUT",
            "-o",
            dev,
            "-j",
            "NFQUEUE",
            "--queue-num",
            &q,
            "--queue-bypass",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

/// An `nfnetlink_queue` socket bound to one queue.
struct Queue {
    fd: OwnedFd,
    queue: u16,
}

/// Appends a netlink attribute (padded to 4 bytes).
fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// Appends a netlink message of nfnetlink_queue type `msg` for `queue`;
/// `attrs` writes its attributes.
fn message(buf: &mut Vec<u8>, msg: u16, flags: u16, queue: u16, attrs: impl FnOnce(&mut Vec<u8>)) {
    let start = buf.len();
    buf.extend_from_slice(&[0u8; 16]); // nlmsghdr, length filled below
    buf.extend_from_slice(&[libc::AF_UNSPEC as u8, 0]); // nfgenmsg: family, version 0
    buf.extend_from_slice(&queue.to_be_bytes()); // res_id
    attrs(buf);
    let len = (buf.len() - start) as u32;
    let kind = (NFNL_SUBSYS_QUEUE << 8) | msg;
    buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    buf[start + 4..start + 6].copy_from_slice(&kind.to_ne_bytes());
    buf[start + 6..start + 8].copy_from_slice(&(libc::NLM_F_REQUEST as u16 | flags).to_ne_bytes());
}

impl Queue {
    fn bind(queue: u16) -> io::Result<Queue> {
        // SAFETY: plain socket(2) call; the fd is owned below.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_NETFILTER,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Room for bursts of packet notices: a lost notice would leave its
        // packet held for good.
        let size: libc::c_int = 16 << 20;
        // SAFETY: setsockopt reads `size` for the given length.
        unsafe {
            libc::setsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        let q = Queue { fd, queue };
        let mut m = Vec::new();
        let ack = libc::NLM_F_ACK as u16;
        message(&mut m, NFQNL_MSG_CONFIG, ack, queue, |b| {
            // nfqnl_msg_config_cmd: command, pad, pf (big-endian)
            let pf = (libc::AF_INET as u16).to_be_bytes();
            attr(b, NFQA_CFG_CMD, &[NFQNL_CFG_CMD_BIND, 0, pf[0], pf[1]]);
        });
        q.send(&m)?;
        q.ack()?;
        m.clear();
        message(&mut m, NFQNL_MSG_CONFIG, ack, queue, |b| {
            // nfqnl_msg_config_params: copy_range (big-endian), copy_mode
            let mut p = 0u32.to_be_bytes().to_vec();
            p.push(NFQNL_COPY_META);
            attr(b, NFQA_CFG_PARAMS, &p);
            attr(b, NFQA_CFG_QUEUE_MAXLEN, &QUEUE_MAXLEN.to_be_bytes());
            attr(b, NFQA_CFG_MASK, &NFQA_CFG_F_GSO.to_be_bytes());
            attr(b, NFQA_CFG_FLAGS, &NFQA_CFG_F_GSO.to_be_bytes());
        });
        q.send(&m)?;
        q.ack()?;
        Ok(q)
    }

    fn send(&self, m: &[u8]) -> io::Result<()> {
        // To the kernel: the socket's default destination.
        // SAFETY: send reads `m.len()` bytes from `m`, which lives for the call.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), m.as_ptr().cast(), m.len(), 0) };
        match n {
            n if n as usize == m.len() => Ok(()),
            n if n < 0 => Err(io::Error::last_os_error()),
            _ => Err(io::Error::other("short netlink send")),
        }
    }

    /// Receives into `buf`; `Ok(None)` when nothing is waiting.
    fn recv<'a>(&self, buf: &'a mut [u8]) -> io::Result<Option<&'a [u8]>> {
        // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(None),
                // The kernel dropped notices (the socket's buffer was full):
                // their packets stay held until the line stops (the queue
                // is flushed when the socket closes). Keep serving the rest.
                Some(libc::ENOBUFS) => {
                    eprintln!("delay line: nfnetlink_queue notices lost (ENOBUFS)");
                    Ok(Some(&buf[..0]))
                }
                _ => Err(e),
            };
        }
        Ok(Some(&buf[..n as usize]))
    }

    /// Waits for the kernel's answer to a request sent with `NLM_F_ACK`.
    fn ack(&self) -> io::Result<()> {
        let mut buf = vec![0u8; 8192];
        let until = Instant::now() + Duration::from_secs(2);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "nfnetlink_queue did not answer a configuration request",
                ));
            }
            self.wait(Some(left))?;
            let Some(m) = self.recv(&mut buf)? else {
                continue;
            };
            for (kind, body) in messages(m) {
                if kind == libc::NLMSG_ERROR as u16 && body.len() >= 4 {
                    let code = i32::from_ne_bytes(body[..4].try_into().expect("4 bytes"));
                    return match code {
                        0 => Ok(()),
                        c => Err(io::Error::from_raw_os_error(-c)),
                    };
                }
            }
        }
    }

    /// Waits until the socket is readable or `timeout` passed.
    fn wait(&self, timeout: Option<Duration>) -> io::Result<()> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let tp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: one pollfd, a timespec (or null) alive for the call, no mask.
        let r = unsafe { libc::ppoll(&mut p, 1, tp, std::ptr::null()) };
        match r {
            r if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted => {
                Err(io::Error::last_os_error())
            }
            _ => Ok(()),
        }
    }

    /// Holds each packet for its delay and releases it, until `stop`; then
    /// releases whatever is held.
    fn run(self, delay: Delay, stop: &AtomicBool) -> io::Result<DelayStats> {
        let mut held: BinaryHeap<Reverse<(Instant, u32)>> = BinaryHeap::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut out = Vec::with_capacity(1 << 12);
        let mut rng = Rng::seeded();
        let mut stats = DelayStats::default();
        let mut last_released: Option<u32> = None;
        let spread = delay.jitter.as_nanos() as u64 * 2;
        loop {
            let now = Instant::now();
            let next = held
                .peek()
                .map(|Reverse((at, _))| at.saturating_duration_since(now));
            self.wait(Some(next.map_or(TICK, |n| n.min(TICK))))?;
            while let Some(m) = self.recv(&mut buf)? {
                let arrived = Instant::now();
                for (kind, body) in messages(m) {
                    if kind != (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET {
                        continue;
                    }
                    if let Some(id) = packet_id(body) {
                        let wait = (delay.base + Duration::from_nanos(rng.below(spread + 1)))
                            .saturating_sub(delay.jitter);
                        held.push(Reverse((arrived + wait, id)));
                    }
                }
            }
            let stopping = stop.load(Ordering::Acquire);
            let now = Instant::now();
            out.clear();
            while let Some(Reverse((at, id))) = held.peek().copied() {
                if at > now && !stopping {
                    break;
                }
                held.pop();
                stats.packets += 1;
                // Ids grow with arrival: a smaller id after a larger one was
                // overtaken.
                if last_released.is_some_and(|l| id < l) {
                    stats.reordered += 1;
                }
                last_released = Some(last_released.map_or(id, |l| l.max(id)));
                message(&mut out, NFQNL_MSG_VERDICT, 0, self.queue, |b| {
                    let mut v = NF_ACCEPT.to_be_bytes().to_vec();
                    v.extend_from_slice(&id.to_be_bytes());
                    attr(b, NFQA_VERDICT_HDR, &v);
                });
                if out.len() > 1 << 12 {
                    self.send(&out)?;
                    out.clear();
                }
            }
            if !out.is_empty() {
                self.send(&out)?;
            }
            if stopping {
                return Ok(stats);
            }
        }
    }
}

/// The netlink messages in `buf`: (type, payload after the header).
fn messages(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 16 {
            return None;
        }
        let len = u32::from_ne_bytes(buf[..4].try_into().ok()?) as usize;
        if len < 16 || len > buf.len() {
            return None;
        }
        let kind = u16::from_ne_bytes(buf[4..6].try_into().ok()?);
        let body = &buf[16..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, body))
    })
}

/// The packet id of a `NFQNL_MSG_PACKET` payload (nfgenmsg, then attributes).
fn packet_id(body: &[u8]) -> Option<u32> {
    let mut a = body.get(4..)?;
    while a.len() >= 4 {
        let len = u16::from_ne_bytes(a[..2].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(a[2..4].try_into().ok()?) & 0x3fff;
        if len < 4 || len > a.len() {
            return None;
        }
        if kind == NFQA_PACKET_HDR && len >= 8 {
            return Some(u32::from_be_bytes(a[4..8].try_into().ok()?));
        }
        a = &a[len.next_multiple_of(4).min(a.len())..];
    }
    None
}

/// xorshift64*: each delay line draws its own jitter.
struct Rng(u64);

impl Rng {
    fn seeded() -> Rng {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Rng(t | 1)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}
