//! `quiesce bench`: perftest-style latency and bandwidth against a target,
//! or `--compare` (compare.rs): the same workloads on raw blocking TCP (the
//! limit), tokio (the usual alternative), quiesce on io_uring and on epoll,
//! interleaved finely in one run against one target process on loopback.

mod compare;
mod instructions;
mod paired;
mod quiesce_client;
pub(crate) mod raw;
mod rdma_client;
mod scale;
mod tokio_client;
mod workload;

pub use workload::{allocations, batch_loop, direct_loop, Case, Sample};

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use hdrhistogram::Histogram;
use quiesce::runtime::DriverKind;
use quiesce::transports::{LocalMode, Token};

/// A segment as a client needs it.
#[derive(Debug, Clone, Copy)]
pub struct SegInfo {
    pub id: u64,
    pub token: Token,
}

/// The bytes of a `Hello` frame asking for a new session, for the
/// hand-written initiators (one connection each).
pub fn hello_frame(nonce: [u8; 16], node: &str) -> Vec<u8> {
    use quiesce::transports::wire::{Header, Hello, Opcode, VERSION};
    let hello = Hello {
        version_min: VERSION,
        version_max: VERSION,
        session: 0,
        shards: 1,
        nonce,
        node: node.into(),
    }
    .encode()
    .expect("a short node name");
    let mut out = Header {
        length: hello.len() as u64,
        ..Header::new(Opcode::Hello)
    }
    .encode()
    .to_vec();
    out.extend_from_slice(&hello);
    out
}

/// The segments a raw or tokio client proves: `kv`, and `ro` if its token
/// is known (without it, its id 0 names no segment: a write there is
/// refused all the same, and nothing wrong is proven).
pub fn proven<'a>(kv: &'a SegInfo, ro: Option<&'a SegInfo>) -> Vec<&'a SegInfo> {
    std::iter::once(kv).chain(ro).collect()
}

/// The bytes of an `Auth` frame proving `segs` after `ack` (in the session
/// the target chose for the connection).
pub fn auth_frame(
    ack: &quiesce::transports::wire::HelloAck,
    nonce: [u8; 16],
    segs: &[&SegInfo],
) -> Vec<u8> {
    use quiesce::transports::wire::{AuthRequest, GrantReceipt, Header, Opcode, SegmentRef};
    let proofs = segs
        .iter()
        .map(|s| {
            let seg = SegmentRef::Id(s.id);
            let proof = s.token.prove(&ack.nonce, &nonce, ack.session, &seg);
            (seg, proof, GrantReceipt::NONE)
        })
        .collect();
    let auth = AuthRequest {
        join: [0; 32],
        proofs,
    }
    .encode()
    .expect("few proofs");
    let mut out = Header {
        length: auth.len() as u64,
        ..Header::new(Opcode::Auth)
    }
    .encode()
    .to_vec();
    out.extend_from_slice(&auth);
    out
}

/// The hand-written initiators' check of an `AuthAck` payload: every
/// proof accepted, or an error naming the refused one (a benchmark against
/// segments it may not use would time refusals).
pub fn auth_accepted(payload: &[u8], proofs: &[&SegInfo]) -> std::io::Result<()> {
    use quiesce::transports::wire::{AuthAck, Status};
    let ack = AuthAck::decode(payload).map_err(std::io::Error::other)?;
    if ack.results.len() != proofs.len() {
        return Err(std::io::Error::other(
            "the target answered another number of proofs",
        ));
    }
    match ack
        .results
        .iter()
        .zip(proofs)
        .find(|((st, _), _)| *st != Status::Ok)
    {
        Some(((st, _), seg)) => Err(std::io::Error::other(format!(
            "the target refused the token of segment {}: {st:?}",
            seg.id
        ))),
        None => Ok(()),
    }
}

/// A hand-written initiator's answer to a write or read it expected to
/// succeed: anything but `Ok` is an error, never a sample.
pub fn expect_ok(st: quiesce::transports::wire::Status) -> std::io::Result<()> {
    match st {
        quiesce::transports::wire::Status::Ok => Ok(()),
        st => Err(std::io::Error::other(format!("the target refused: {st:?}"))),
    }
}

/// The answer to the fail-fast case's write to the read-only segment: a
/// refusal, or the case measures nothing.
pub fn expect_refused(st: quiesce::transports::wire::Status) -> std::io::Result<()> {
    match st {
        quiesce::transports::wire::Status::Ok => Err(std::io::Error::other(
            "the target took the write the fail-fast case needs refused",
        )),
        _ => Ok(()),
    }
}

/// A write frame as the hand-written initiators send it: the bytes for the
/// first send (header, plus the payload when it is small), and the payload
/// for a second send when it is not.
pub fn write_frame(task: u64, segment: u64, offset: u64, data: &[u8]) -> (Vec<u8>, &[u8]) {
    use quiesce::transports::wire::{Header, Opcode};
    let h = Header {
        task,
        segment,
        offset,
        length: data.len() as u64,
        ..Header::new(Opcode::Write)
    };
    let mut head = h.encode().to_vec();
    if data.len() <= 16 * 1024 {
        head.extend_from_slice(data);
        (head, &[])
    } else {
        (head, data)
    }
}

/// Summary of many samples.
#[derive(Debug, Clone)]
struct Summary {
    n: usize,
    min: f64,
    p50: f64,
    avg: f64,
    p99: f64,
    p999: f64,
    max: f64,
    gbps: f64,
    cpu_ms_per_gb: f64,
    fence_p50: Option<f64>,
    /// Heap allocations per iteration on the initiator.
    allocs: f64,
}

fn summarize(samples: &[Sample], cpu: Duration) -> Summary {
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("histogram bounds");
    let (mut total, mut bytes, mut allocs) = (Duration::ZERO, 0u64, 0u64);
    for s in samples {
        h.saturating_record(s.took.as_nanos() as u64);
        total += s.took;
        bytes += s.bytes;
        allocs += s.allocs;
    }
    let us = |ns: u64| ns as f64 / 1e3;
    let mut fences: Vec<f64> = samples
        .iter()
        .filter_map(|s| s.fence.map(|d| d.as_secs_f64() * 1e6))
        .collect();
    fences.sort_by(f64::total_cmp);
    Summary {
        n: samples.len(),
        min: us(h.min()),
        p50: us(h.value_at_quantile(0.5)),
        avg: h.mean() / 1e3,
        p99: us(h.value_at_quantile(0.99)),
        p999: us(h.value_at_quantile(0.999)),
        max: us(h.max()),
        gbps: bytes as f64 * 8.0 / total.as_secs_f64().max(1e-9) / 1e9,
        cpu_ms_per_gb: cpu.as_secs_f64() * 1e3 / (bytes as f64 / 1e9).max(1e-12),
        fence_p50: (!fences.is_empty()).then(|| fences[fences.len() / 2]),
        allocs: allocs as f64 / samples.len().max(1) as f64,
    }
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a live timespec the call fills.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Impl {
    Raw,
    Tokio,
    Uring,
    Epoll,
    /// quiesce's local transport (cross-memory attach, small requests
    /// through the shared-memory mailbox; io_uring).
    Local,
    /// The local transport with small requests on the socket.
    LocalSocket,
    /// quiesce over TCP without the batch layer (`RemoteSegment::write`
    /// and `read` called directly; single transfers only).
    Direct(DriverKind),
    Rdma {
        busy_poll: bool,
        direct: bool,
    },
}

impl Impl {
    fn name(&self) -> &'static str {
        match self {
            Impl::Raw => "raw-std",
            Impl::Tokio => "tokio",
            Impl::Uring => "quiesce-io_uring",
            Impl::Epoll => "quiesce-epoll",
            Impl::Local => "quiesce-local",
            Impl::LocalSocket => "quiesce-local-socket",
            Impl::Direct(_) => "quiesce-direct",
            Impl::Rdma { direct: false, .. } => "quiesce-rdma",
            Impl::Rdma { direct: true, .. } => "quiesce-rdma-direct",
        }
    }
}

/// Where the target listens and the segments a client proves.
#[derive(Debug, Clone, Copy)]
struct Endpoint {
    addr: SocketAddr,
    kv: SegInfo,
    /// The read-only segment, whose writes the target refuses (the
    /// fail-fast case's first task). `None` with `--connect`: only
    /// `--compare`, which starts the target, knows its token, and only its
    /// fail-fast case writes there.
    ro: Option<SegInfo>,
}

/// One initiator, connected once and kept across runs, so that runs can
/// alternate finely without paying a connection each.
enum Client {
    Raw(raw::Raw),
    Tokio(tokio_client::Tokio),
    Quiesce(quiesce_client::Quiesce),
    /// RDMA sets up its engine per run (single mode only).
    Rdma {
        t: Endpoint,
        busy_poll: bool,
        direct: bool,
    },
}

impl Client {
    fn connect(im: Impl, t: &Endpoint, s: &Setup) -> Result<Client, Box<dyn std::error::Error>> {
        let (zc, spin, congestion) = (s.zc_threshold, s.spin, s.tcp_congestion.as_deref());
        Ok(match im {
            Impl::Raw => Client::Raw(raw::Raw::connect(
                t.addr,
                &t.kv,
                t.ro.as_ref(),
                !spin.is_zero(),
                congestion,
            )?),
            Impl::Tokio => Client::Tokio(tokio_client::Tokio::connect(
                t.addr,
                &t.kv,
                t.ro.as_ref(),
                congestion,
            )?),
            Impl::Uring | Impl::Epoll | Impl::Local | Impl::LocalSocket | Impl::Direct(_) => {
                let driver = match im {
                    Impl::Epoll => DriverKind::Epoll,
                    Impl::Direct(d) => d,
                    _ => DriverKind::IoUring,
                };
                let local = match im {
                    Impl::Local | Impl::LocalSocket => LocalMode::Required,
                    _ => LocalMode::Off,
                };
                let knobs = quiesce_client::Knobs {
                    zc_threshold: zc,
                    local,
                    mailbox: im != Impl::LocalSocket,
                    spin,
                    tcp_congestion: s.tcp_congestion.clone(),
                    direct: matches!(im, Impl::Direct(_)),
                };
                Client::Quiesce(quiesce_client::Quiesce::connect(
                    driver,
                    t.addr,
                    &t.kv,
                    t.ro.as_ref(),
                    knobs,
                )?)
            }
            Impl::Rdma { busy_poll, direct } => Client::Rdma {
                t: *t,
                busy_poll,
                direct,
            },
        })
    }

    fn run(&mut self, case: Case, iters: usize) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
        Ok(match self {
            Client::Raw(c) => c.run(case, iters)?,
            Client::Tokio(c) => c.run(case, iters)?,
            Client::Quiesce(c) => c.run(case, iters)?,
            Client::Rdma {
                t,
                busy_poll,
                direct,
            } => rdma_client::run(
                t.addr,
                &t.kv,
                t.ro.as_ref(),
                case,
                iters,
                *busy_poll,
                *direct,
            )?,
        })
    }
}

/// One line of results.
#[derive(Debug, Clone)]
struct Row {
    case: String,
    im: &'static str,
    s: Summary,
    /// Against raw std: p50 latency for 4 KiB cases and fail-fast,
    /// throughput otherwise; none in a single run (nothing compared).
    ratio: Option<f64>,
    /// Heap allocations per iteration in the target process.
    target_allocs: Option<f64>,
    /// User-space instructions per iteration on the initiator (callgrind).
    instructions: Option<f64>,
    /// `--compare`: each turn's figure ([`paired::turn_figure`]).
    turns: Vec<f64>,
}

/// Options of `quiesce bench`.
pub struct BenchArgs {
    pub compare: bool,
    /// Many transfers at once (`scale.rs`).
    pub scale: bool,
    pub connect: Option<SocketAddr>,
    pub token: Option<Token>,
    pub transport: String,
    /// rdma: busy-poll the completion queue.
    pub busy_poll: bool,
    pub op: String,
    pub sizes: Vec<usize>,
    pub iters: Option<usize>,
    pub batch: usize,
    pub rounds: usize,
    pub json: Option<std::path::PathBuf>,
    pub driver: DriverKind,
    /// Single mode: which initiator to run (`quiesce`, `raw`, `tokio`).
    pub initiator: String,
    /// quiesce: send slices of at least this many bytes with SEND_ZC.
    pub zc_threshold: Option<usize>,
    /// `--compare`: the target on a thread of this process, not its own.
    pub same_process: bool,
    /// `--compare`: count instructions per iteration under callgrind.
    pub instructions: bool,
    /// `--compare`: the cases to run, by name (all when empty).
    pub cases: Vec<String>,
    /// How long quiesce's reactors (initiators, and `--compare`'s target)
    /// busy-poll before they block.
    pub spin: Duration,
    /// Every initiator's TCP congestion control (and `--compare`'s
    /// target's); `None`: the system's default.
    pub tcp_congestion: Option<String>,
}

impl BenchArgs {
    fn setup(&self) -> Setup {
        Setup {
            zc_threshold: self.zc_threshold,
            spin: self.spin,
            tcp_congestion: self.tcp_congestion.clone(),
        }
    }
}

/// What every initiator of a run is set up with.
#[derive(Clone)]
struct Setup {
    /// quiesce: send slices of at least this many bytes with SEND_ZC.
    zc_threshold: Option<usize>,
    /// How long quiesce's reactors busy-poll (raw spins when non-zero).
    spin: Duration,
    /// `TCP_CONGESTION` on every connection; `None`: the system's default.
    tcp_congestion: Option<String>,
}

pub fn run(a: BenchArgs) -> Result<bool, Box<dyn std::error::Error>> {
    if a.transport == "rdma" && a.compare {
        return Err(
            "--compare runs the TCP initiators; for RDMA, perftest is the baseline \
             (scripts/softroce-vm.sh bench runs both)"
                .into(),
        );
    }
    let largest = a.sizes.iter().max().copied().unwrap_or(0);
    if largest
        .checked_mul(a.batch)
        .is_none_or(|n| n > isize::MAX as usize)
    {
        return Err(format!(
            "--batch {} of --size {largest}: too large for a buffer",
            a.batch
        )
        .into());
    }
    if a.op == "read" && a.batch > 1 {
        return Err("--batch runs writes; --op read measures single reads".into());
    }
    if a.scale && a.transport == "rdma" {
        return Err("--scale runs over TCP only".into());
    }
    if a.scale {
        scale::scale()
    } else if a.compare {
        compare::compare(&a)
    } else {
        single(&a)
    }
}

/// A progress line, rewritten in place; only on a terminal (in a file or a
/// pipe the escape codes would be noise).
fn progress(msg: &str) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprint!("\r\x1b[2K{msg}");
    }
}

/// Runs the quiesce client against `--connect`, perftest style.
fn single(a: &BenchArgs) -> Result<bool, Box<dyn std::error::Error>> {
    let rdma = a.transport == "rdma";
    // RDMA without --connect: a `quiesce target --transport rdma` child.
    let child = match (rdma, a.connect) {
        (true, None) => {
            let size = a.sizes.iter().max().copied().unwrap_or(1 << 20) * a.batch;
            Some(quiesce::target_child::TargetChild::spawn(
                &std::env::current_exe()?,
                size,
                true,
            )?)
        }
        _ => None,
    };
    let addr = match &child {
        Some(c) => c.addr,
        None => a.connect.ok_or("--connect ADDR (or --compare)")?,
    };
    let token = match &child {
        Some(c) => c.tokens["kv"],
        None => a.token.ok_or("--token HEX (printed by `quiesce target`)")?,
    };
    // Segment ids as `quiesce target` registers them: kv, ro, wo.
    let kv = SegInfo { id: 1, token };
    let ro = child.as_ref().map(|c| SegInfo {
        id: 2,
        token: c.tokens["ro"],
    });
    let im = match (a.initiator.as_str(), a.driver) {
        ("direct", _) if rdma => Impl::Rdma {
            busy_poll: a.busy_poll,
            direct: true,
        },
        _ if rdma => Impl::Rdma {
            busy_poll: a.busy_poll,
            direct: false,
        },
        ("raw", _) => Impl::Raw,
        ("tokio", _) => Impl::Tokio,
        ("quiesce", DriverKind::Epoll) => Impl::Epoll,
        ("quiesce", _) => Impl::Uring,
        ("local", _) => Impl::Local,
        ("local-socket", _) => Impl::LocalSocket,
        ("direct", d) => Impl::Direct(d),
        (other, _) => {
            return Err(format!(
                "--impl {other:?}: one of quiesce, direct, local, local-socket, raw, tokio"
            )
            .into())
        }
    };
    if matches!(im, Impl::Local | Impl::LocalSocket) {
        quiesce::target_child::allow_any_ptracer();
    }
    let mut client = Client::connect(im, &Endpoint { addr, kv, ro }, &a.setup())?;
    println!("{} {}s against {addr}", im.name(), a.op);
    println!(
        "{:>10} {:>8} {:>10} {:>12} {:>10} {:>10} {:>11} {:>10} {:>10} {:>11}",
        "#bytes",
        "#iters",
        "t_min[us]",
        "t_typical[us]",
        "t_avg[us]",
        "t_p99[us]",
        "t_p99.9[us]",
        "t_max[us]",
        "MB/s",
        "CPU[ms/GB]"
    );
    let mut json = Vec::new();
    for &size in &a.sizes {
        let case = match (a.op.as_str(), a.batch) {
            ("read", _) => Case::Read(size),
            (_, k) if k > 1 => Case::Batch { tasks: k, size },
            _ => Case::Write(size),
        };
        let iters = a.iters.unwrap_or(case.default_iters());
        progress(&format!("{} × {iters}…", case.name()));
        let cpu0 = thread_cpu();
        let samples = client.run(case, iters)?;
        let s = summarize(&samples, thread_cpu() - cpu0);
        progress("");
        println!(
            "{:>10} {:>8} {:>10.2} {:>12.2} {:>10.2} {:>10.2} {:>11.2} {:>10.2} {:>10.1} {:>11.1}",
            case.size(),
            s.n,
            s.min,
            s.p50,
            s.avg,
            s.p99,
            s.p999,
            s.max,
            s.gbps * 1e3 / 8.0,
            s.cpu_ms_per_gb
        );
        json.push(Row {
            case: case.name(),
            im: im.name(),
            s,
            ratio: None,
            target_allocs: None,
            instructions: None,
            turns: Vec::new(),
        });
    }
    write_json(a, &json)?;
    Ok(true)
}

fn write_json(a: &BenchArgs, rows: &[Row]) -> std::io::Result<()> {
    let Some(path) = &a.json else { return Ok(()) };
    let opt = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.2}"));
    let mut s = String::from("{\"cases\":[");
    for (i, r) in rows.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(
            s,
            "{{\"name\":\"{}\",\"impl\":\"{}\",\"min_us\":{:.3},\"p50_us\":{:.3},\"p99_us\":{:.3},\"gbps\":{:.4},\"ratio_vs_raw\":{},\"cpu_ms_per_gb\":{:.2},\"allocs_per_op\":{:.2},\"target_allocs_per_op\":{},\"instructions_per_op\":{},\"iters\":{}}}",
            r.case, r.im, r.s.min, r.s.p50, r.s.p99, r.s.gbps, r.ratio.map_or("null".into(), |v| format!("{v:.4}")), r.s.cpu_ms_per_gb,
            r.s.allocs, opt(r.target_allocs), opt(r.instructions), r.s.n
        );
    }
    s.push_str("]}\n");
    std::fs::write(path, s)
}
