//! `quiesce bench`: perftest-style latency and bandwidth against a target,
//! or `--compare`: the same workloads on raw blocking TCP (the limit), tokio
//! (the usual alternative), quiesce on io_uring and on epoll, interleaved in
//! one run against one target on loopback.

mod quiesce_client;
pub(crate) mod raw;
mod rdma_client;
mod tokio_client;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use quiesce::batch::{Batch, BatchOptions, FailurePolicy};
use quiesce::runtime::DriverKind;
use quiesce::scenario::{Buf, Seg};
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, Rights, Token};

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

/// The bytes of an `Auth` frame proving `segs` after `ack` (in the session
/// the target chose for the connection).
pub fn auth_frame(
    ack: &quiesce::transports::wire::HelloAck,
    nonce: [u8; 16],
    segs: &[&SegInfo],
) -> Vec<u8> {
    use quiesce::transports::wire::{AuthRequest, Header, Opcode, SegmentRef};
    let proofs = segs
        .iter()
        .map(|s| {
            let seg = SegmentRef::Id(s.id);
            let proof = s.token.prove(&ack.nonce, &nonce, ack.session, &seg);
            (seg, proof)
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

/// The loop every quiesce initiator runs, over TCP or RDMA: one batch per
/// iteration (with the refused 4 KiB probe first for fail-fast), timed from
/// submit to the quiesced outcome.
pub async fn batch_loop<S: Seg, B: Buf>(
    kv: &S,
    ro: Option<&S>,
    case: Case,
    iters: usize,
    mut bufs: Vec<B>,
    mut small: Option<B>,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    let task_size = match case {
        Case::Batch { size, .. } => size,
        _ => case.size(),
    };
    let mut out = Vec::with_capacity(iters);
    for _ in 0..iters {
        let opts = match case {
            Case::FailFast(_) => BatchOptions::default().policy(FailurePolicy::FailFast),
            _ => BatchOptions::default(),
        };
        let mut batch = Batch::new(kv.transport(), opts);
        if let Some(ro) = ro {
            let small = small.take().expect("returned by the last round");
            batch
                .write(small, ro.range(0, 4096))
                .map_err(|r| r.reason)?;
        }
        for (i, b) in bufs.drain(..).enumerate() {
            let range = kv.range((i * task_size) as u64, task_size as u64);
            match case {
                Case::Read(_) => batch.read(b, range),
                _ => batch.write(b, range),
            }
            .map_err(|r| r.reason)?;
        }
        let t0 = Instant::now();
        let q = batch.submit().await.quiesced().await;
        let took = t0.elapsed();
        let fence = q.fence_time();
        match case {
            Case::FailFast(_) => assert!(!q.all_completed(), "the refused write must fail"),
            _ => assert!(q.all_completed(), "{:?}", q.tasks()),
        }
        let mut back = q.into_buffers();
        if ro.is_some() {
            small = Some(back.remove(0));
        }
        bufs = back;
        out.push(Sample {
            took,
            bytes: case.bytes(),
            fence,
        });
    }
    Ok(out)
}

/// One workload.
#[derive(Debug, Clone, Copy)]
pub enum Case {
    Write(usize),
    Read(usize),
    Batch {
        tasks: usize,
        size: usize,
    },
    /// [4 KiB write the target refuses + a valid write of this size], fail-fast.
    FailFast(usize),
}

impl Case {
    /// Bytes of local buffer one iteration needs.
    pub fn size(&self) -> usize {
        match *self {
            Case::Write(s) | Case::Read(s) | Case::FailFast(s) => s,
            Case::Batch { tasks, size } => tasks * size,
        }
    }

    /// Payload bytes one iteration asks to move.
    pub fn bytes(&self) -> u64 {
        self.size() as u64
    }

    pub fn name(&self) -> String {
        let sz = |s: usize| {
            if s >= 1 << 20 {
                format!("{}m", s >> 20)
            } else {
                format!("{}k", s >> 10)
            }
        };
        match *self {
            Case::Write(s) => format!("write_{}", sz(s)),
            Case::Read(s) => format!("read_{}", sz(s)),
            Case::Batch { tasks, size } => format!("batch_{tasks}x{}", sz(size)),
            Case::FailFast(s) => format!("fail_fast_{}", sz(s)),
        }
    }

    fn default_iters(&self) -> usize {
        match self.size() {
            s if s <= 4096 => 2000,
            s if s <= 64 << 10 => 1000,
            s if s <= 1 << 20 => 200,
            s if s <= 4 << 20 => 50,
            _ => 8,
        }
    }
}

/// One iteration.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub took: Duration,
    pub bytes: u64,
    /// quiesce: from the failure to the safe outcome (the fence).
    pub fence: Option<Duration>,
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
}

fn summarize(samples: &[Sample], cpu: Duration) -> Summary {
    let mut h = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3).expect("histogram bounds");
    let (mut total, mut bytes) = (Duration::ZERO, 0u64);
    for s in samples {
        h.saturating_record(s.took.as_nanos() as u64);
        total += s.took;
        bytes += s.bytes;
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

/// A target engine on its own thread, for `--compare`.
fn start_target(kv_len: usize) -> (SocketAddr, SegInfo, SegInfo) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("bench-target".into())
        .spawn(move || {
            let rt = quiesce::runtime::Runtime::new().expect("target runtime");
            rt.block_on(async move {
                let cfg = EngineConfig {
                    node: "bench-target".into(),
                    max_frame: 128 << 20,
                    ..Default::default()
                };
                let e = Engine::bind(cfg).expect("bind");
                let kv = e
                    .register("kv", AlignedBuf::new(kv_len), Rights::READ | Rights::WRITE)
                    .expect("kv");
                let ro = e
                    .register("ro", AlignedBuf::new(4096), Rights::READ)
                    .expect("ro");
                tx.send((
                    e.local_addr(),
                    SegInfo {
                        id: kv.id(),
                        token: kv.token(),
                    },
                    SegInfo {
                        id: ro.id(),
                        token: ro.token(),
                    },
                ))
                .expect("send");
                std::future::pending::<()>().await;
            });
        })
        .expect("target thread");
    rx.recv().expect("target started")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Impl {
    Raw,
    Tokio,
    Uring,
    Epoll,
    Rdma { busy_poll: bool, direct: bool },
}

impl Impl {
    fn name(&self) -> &'static str {
        match self {
            Impl::Raw => "raw-std",
            Impl::Tokio => "tokio",
            Impl::Uring => "quiesce-io_uring",
            Impl::Epoll => "quiesce-epoll",
            Impl::Rdma { direct: false, .. } => "quiesce-rdma",
            Impl::Rdma { direct: true, .. } => "quiesce-rdma-direct",
        }
    }
}

type Run<'a> = (&'a SocketAddr, &'a SegInfo, &'a SegInfo);

fn run_impl(
    im: Impl,
    (addr, kv, ro): Run<'_>,
    case: Case,
    iters: usize,
    zc: Option<usize>,
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    Ok(match im {
        Impl::Raw => raw::Raw::connect(*addr, kv, ro)?.run(case, iters)?,
        Impl::Tokio => tokio_client::run(*addr, kv, ro, case, iters)?,
        Impl::Uring => quiesce_client::run(DriverKind::IoUring, *addr, kv, ro, case, iters, zc)?,
        Impl::Epoll => quiesce_client::run(DriverKind::Epoll, *addr, kv, ro, case, iters, zc)?,
        Impl::Rdma { busy_poll, direct } => {
            rdma_client::run(*addr, kv, ro, case, iters, busy_poll, direct)?
        }
    })
}

/// Options of `quiesce bench`.
pub struct BenchArgs {
    pub compare: bool,
    pub connect: Option<SocketAddr>,
    pub token: Option<Token>,
    pub ro_token: Option<Token>,
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
}

pub fn run(a: BenchArgs) -> Result<bool, Box<dyn std::error::Error>> {
    if a.transport == "rdma" && a.compare {
        return Err(
            "--compare runs the TCP initiators; for RDMA, perftest is the baseline \
             (scripts/softroce-vm.sh bench runs both)"
                .into(),
        );
    }
    if a.compare {
        compare(&a)
    } else {
        single(&a)
    }
}

fn progress(msg: &str) {
    eprint!("\r\x1b[2K{msg}");
}

/// Runs the quiesce client against `--connect`, perftest style.
fn single(a: &BenchArgs) -> Result<bool, Box<dyn std::error::Error>> {
    let rdma = a.transport == "rdma";
    // RDMA without --connect: a `quiesce target --transport rdma` child.
    let child = match (rdma, a.connect) {
        (true, None) => {
            let size = a.sizes.iter().max().copied().unwrap_or(1 << 20) * a.batch.max(1);
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
    let ro = SegInfo {
        id: 2,
        token: child
            .as_ref()
            .map(|c| c.tokens["ro"])
            .or(a.ro_token)
            .unwrap_or(token),
    };
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
        (other, _) => return Err(format!("--impl {other:?}: one of quiesce, raw, tokio").into()),
    };
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
        let samples = run_impl(im, (&addr, &kv, &ro), case, iters, a.zc_threshold)?;
        let s = summarize(&samples, thread_cpu() - cpu0);
        progress("");
        eprintln!();
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
        json.push((case.name(), im.name(), s, 1.0));
    }
    write_json(a, &json)?;
    Ok(true)
}

fn compare(a: &BenchArgs) -> Result<bool, Box<dyn std::error::Error>> {
    let cases = [
        Case::Write(4 << 10),
        Case::Write(64 << 10),
        Case::Write(1 << 20),
        Case::Write(64 << 20),
        Case::Read(4 << 10),
        Case::Batch {
            tasks: 64,
            size: 64 << 10,
        },
        Case::FailFast(64 << 20),
    ];
    let impls = [Impl::Raw, Impl::Tokio, Impl::Uring, Impl::Epoll];
    let (addr, kv, ro) = start_target(96 << 20);
    println!("quiesce bench --compare: target on {addr} (in this process, io_uring); {} rounds, interleaved", a.rounds);
    let mut rows = Vec::new();
    for case in cases {
        let iters = a.iters.unwrap_or(case.default_iters());
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); impls.len()];
        let mut cpu = vec![Duration::ZERO; impls.len()];
        for round in 0..a.rounds {
            for (i, im) in impls.iter().enumerate() {
                progress(&format!(
                    "{} round {}/{} {}…",
                    case.name(),
                    round + 1,
                    a.rounds,
                    im.name()
                ));
                let c0 = thread_cpu();
                samples[i].extend(run_impl(
                    *im,
                    (&addr, &kv, &ro),
                    case,
                    iters,
                    a.zc_threshold,
                )?);
                cpu[i] += thread_cpu() - c0;
            }
        }
        progress("");
        let sums: Vec<Summary> = samples
            .iter()
            .zip(&cpu)
            .map(|(s, c)| summarize(s, *c))
            .collect();
        for (i, im) in impls.iter().enumerate() {
            let ratio = if matches!(case, Case::Write(_) | Case::Read(_)) && case.size() <= 4096
                || matches!(case, Case::FailFast(_))
            {
                sums[i].p50 / sums[0].p50
            } else {
                sums[i].gbps / sums[0].gbps
            };
            rows.push((case.name(), im.name(), sums[i].clone(), ratio));
        }
    }
    eprintln!();
    let mut t = String::new();
    writeln!(
        t,
        "{:<14} {:<17} {:>9} {:>9} {:>8} {:>10} {:>12} {:>9}",
        "case", "impl", "p50 µs", "p99 µs", "Gb/s", "CPU ms/GB", "fence p50 µs", "× raw"
    )?;
    for (case, im, s, ratio) in &rows {
        let fence = s
            .fence_p50
            .map(|f| format!("{f:.0}"))
            .unwrap_or_else(|| "-".into());
        writeln!(
            t,
            "{case:<14} {im:<17} {:>9.1} {:>9.1} {:>8.2} {:>10.1} {fence:>12} {ratio:>9.2}",
            s.p50, s.p99, s.gbps, s.cpu_ms_per_gb
        )?;
    }
    print!("{t}");
    println!(
        "(× raw: p50 latency ratio for 4 KiB cases and fail_fast, throughput ratio otherwise)"
    );
    goals(&rows);
    write_json(a, &rows)?;
    Ok(true)
}

type Row = (String, &'static str, Summary, f64);

fn goals(rows: &[Row]) {
    let get = |case: &str, im: &str| rows.iter().find(|r| r.0 == case && r.1 == im).map(|r| &r.2);
    let verdict = |ok: bool| if ok { "MET" } else { "MISSED" };
    let (Some(w4r), Some(w4q)) = (
        get("write_4k", "raw-std"),
        get("write_4k", "quiesce-io_uring"),
    ) else {
        return;
    };
    let r = w4q.p50 / w4r.p50;
    println!(
        "goal write_4k p50 <= 1.1x raw: {} ({r:.2})",
        verdict(r <= 1.1)
    );
    if let (Some(a), Some(b)) = (
        get("write_64m", "raw-std"),
        get("write_64m", "quiesce-io_uring"),
    ) {
        let r = b.gbps / a.gbps;
        println!(
            "goal write_64m >= 1.0x raw throughput: {} ({r:.2})",
            verdict(r >= 1.0)
        );
    }
    if let (Some(a), Some(b)) = (
        get("batch_64x64k", "raw-std"),
        get("batch_64x64k", "quiesce-io_uring"),
    ) {
        let r = b.gbps / a.gbps;
        println!(
            "goal batch_64x64k >= 0.9x raw throughput: {} ({r:.2})",
            verdict(r >= 0.9)
        );
    }
    let cases: Vec<&String> = rows
        .iter()
        .map(|r| &r.0)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let better = |case: &str, a: &Summary, b: &Summary| {
        if case.starts_with("fail_fast") || case.ends_with("_4k") {
            a.p50 <= b.p50
        } else {
            a.gbps >= b.gbps
        }
    };
    let mut uring_vs_epoll = Vec::new();
    let mut vs_tokio = Vec::new();
    for c in &cases {
        if let (Some(u), Some(e), Some(t)) = (
            get(c, "quiesce-io_uring"),
            get(c, "quiesce-epoll"),
            get(c, "tokio"),
        ) {
            if !better(c, u, e) {
                uring_vs_epoll.push(c.as_str());
            }
            if !better(c, u, t) {
                vs_tokio.push(c.as_str());
            }
        }
    }
    println!(
        "goal io_uring not slower than epoll on any case: {} {:?}",
        verdict(uring_vs_epoll.is_empty()),
        uring_vs_epoll
    );
    println!(
        "goal quiesce faster than tokio on every case: {} {:?}",
        verdict(vs_tokio.is_empty()),
        vs_tokio
    );
    if let Some(f) = get("fail_fast_64m", "quiesce-io_uring").and_then(|s| s.fence_p50) {
        println!(
            "goal fail_fast_64m <= 5 ms from failure to safe outcome: {} ({:.2} ms)",
            verdict(f <= 5000.0),
            f / 1e3
        );
    }
}

fn write_json(a: &BenchArgs, rows: &[Row]) -> std::io::Result<()> {
    let Some(path) = &a.json else { return Ok(()) };
    let mut s = String::from("{\"cases\":[");
    for (i, (case, im, sum, ratio)) in rows.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(
            s,
            "{{\"name\":\"{case}\",\"impl\":\"{im}\",\"p50_us\":{:.3},\"p99_us\":{:.3},\"gbps\":{:.4},\"ratio_vs_raw\":{:.4},\"cpu_ms_per_gb\":{:.2},\"iters\":{}}}",
            sum.p50, sum.p99, sum.gbps, ratio, sum.cpu_ms_per_gb, sum.n
        );
    }
    s.push_str("]}\n");
    std::fs::write(path, s)
}
