//! `quiesce bench --compare`: raw std TCP (the limit), tokio, quiesce on
//! io_uring and on epoll, against one target — a `quiesce target` process by
//! default, so that no implementation pays a cross-thread wake-up inside its
//! own process.
//!
//! This VM's wake-up latency is bimodal from one stretch of time to the next,
//! so whole-run medians of one implementation after another swing 2×. Here
//! each implementation keeps one connection on its own thread, and they take
//! turns in chunks of a few milliseconds (the first of each turn rotating),
//! so every figure of a case samples the same machine states. Beside the
//! times: heap allocations per iteration on the initiator (the binary's
//! counting allocator) and in the target (its `heap` command around each
//! chunk), and user-space instructions per iteration (instructions.rs) —
//! figures that the noise does not move.

use std::fmt::Write as _;
use std::sync::mpsc;
use std::time::Duration;

use quiesce::runtime::DriverKind;
use quiesce::target_child::TargetChild;
use quiesce::transports::{AlignedBuf, Engine, EngineConfig, Rights};

use super::{
    instructions, paired, progress, summarize, thread_cpu, write_json, BenchArgs, Case, Client,
    Endpoint, Impl, Row, Sample, SegInfo, Setup, Summary,
};

/// What one chunk gives back.
struct Chunk {
    samples: Vec<Sample>,
    cpu: Duration,
}

/// One implementation's connection on its own thread, running chunks on
/// request.
struct Worker {
    jobs: Option<mpsc::Sender<(Case, usize)>>,
    done: mpsc::Receiver<Result<Chunk, String>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn start(im: Impl, t: Endpoint, setup: Setup) -> Result<Worker, Box<dyn std::error::Error>> {
        let (jobs, job_rx) = mpsc::channel::<(Case, usize)>();
        let (done_tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("bench-{}", im.name()))
            .spawn(move || {
                let mut client = match Client::connect(im, &t, &setup) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = done_tx.send(Err(format!("{}: connect: {e}", im.name())));
                        return;
                    }
                };
                let _ = done_tx.send(Ok(Chunk {
                    samples: Vec::new(),
                    cpu: Duration::ZERO,
                }));
                for (case, iters) in job_rx {
                    let c0 = thread_cpu();
                    let r = client.run(case, iters).map(|samples| Chunk {
                        samples,
                        cpu: thread_cpu() - c0,
                    });
                    let failed = r.is_err();
                    let _ =
                        done_tx.send(r.map_err(|e| format!("{} {}: {e}", im.name(), case.name())));
                    if failed {
                        return;
                    }
                }
            })?;
        let w = Worker {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        };
        w.done.recv().map_err(|_| "worker died")??;
        Ok(w)
    }

    fn run(&self, case: Case, iters: usize) -> Result<Chunk, Box<dyn std::error::Error>> {
        self.jobs
            .as_ref()
            .ok_or("stopped")?
            .send((case, iters))
            .map_err(|_| "worker gone")?;
        Ok(self.done.recv().map_err(|_| "worker died")??)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The target the initiators share.
enum Target {
    /// `quiesce target` in its own process (the default).
    Process(Box<TargetChild>),
    /// An engine on a thread of this process (`--same-process`): the old
    /// setup, where every implementation also pays a wake-up across threads.
    Thread,
}

impl Target {
    /// Allocations the target process has made, if it is one.
    fn allocations(&mut self) -> Result<Option<u64>, Box<dyn std::error::Error>> {
        match self {
            Target::Process(c) => Ok(Some(c.heap()?.2)),
            Target::Thread => Ok(None),
        }
    }
}

/// A target engine on its own thread (`--same-process`).
fn start_thread_target(kv_len: usize, tcp_congestion: Option<String>) -> Endpoint {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("bench-target".into())
        .spawn(move || {
            let rt = quiesce::runtime::Runtime::new().expect("target runtime");
            rt.block_on(async move {
                let cfg = EngineConfig {
                    node: "bench-target".into(),
                    max_frame: 128 << 20,
                    tcp_congestion,
                    ..Default::default()
                };
                let e = Engine::bind(cfg).expect("bind");
                let kv = e
                    .register("kv", AlignedBuf::new(kv_len), Rights::READ | Rights::WRITE)
                    .expect("kv");
                let ro = e
                    .register("ro", AlignedBuf::new(4096), Rights::READ)
                    .expect("ro");
                let seg = |s: &quiesce::transports::Segment| SegInfo {
                    id: s.id(),
                    token: s.token(),
                };
                tx.send(Endpoint {
                    addr: e.local_addr(),
                    kv: seg(&kv),
                    ro: Some(seg(&ro)),
                })
                .expect("send");
                std::future::pending::<()>().await;
            });
        })
        .expect("target thread");
    rx.recv().expect("target started")
}

const KV_LEN: usize = 96 << 20;
const IMPLS: [Impl; 7] = [
    Impl::Raw,
    Impl::Tokio,
    Impl::Uring,
    Impl::Epoll,
    Impl::Local,
    Impl::LocalSocket,
    Impl::Direct(DriverKind::IoUring),
];

/// Whether `im` runs `case`: the transport alone (`quiesce-direct`, what
/// quiesce-io_uring costs without its batch layer) makes single transfers
/// only.
fn runs(im: Impl, case: Case) -> bool {
    !matches!(im, Impl::Direct(_)) || matches!(case, Case::Write(_) | Case::Read(_))
}

pub(super) fn compare(a: &BenchArgs) -> Result<bool, Box<dyn std::error::Error>> {
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
    if let Some(unknown) = a
        .cases
        .iter()
        .find(|n| !cases.iter().any(|c| c.name() == **n))
    {
        let known: Vec<String> = cases.iter().map(|c| c.name()).collect();
        return Err(format!("--cases: no case {unknown:?} (cases: {})", known.join(", ")).into());
    }
    let cases: Vec<Case> = cases
        .into_iter()
        .filter(|c| a.cases.is_empty() || a.cases.contains(&c.name()))
        .collect();
    let exe = std::env::current_exe()?;
    if let Some(name) = &a.tcp_congestion {
        quiesce::runtime::net::check_tcp_congestion(name)?;
    }
    // Where a thread runs decides its wake-up cost on this VM: a reply to a
    // thread on the same vCPU is a context switch (~15 µs round trip), one
    // to the other vCPU an IPI to a halted vCPU (~60 µs). Left to the
    // scheduler, each implementation's thread lands where it lands and the
    // figures differ by 4× for that alone. So the target (started while this
    // thread is pinned, so it inherits the CPU) runs on the last CPU and
    // every initiator on CPU 0: each pays the cross-CPU wake-up a target on
    // another core or host costs.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinned = cpus >= 2 && quiesce::runtime::shard::pin_current_thread(cpus - 1).is_ok();
    let (mut target, t) = if a.same_process {
        (
            Target::Thread,
            start_thread_target(KV_LEN, a.tcp_congestion.clone()),
        )
    } else {
        // Raw and tokio send a 64 MiB write as one frame.
        let spin = a.spin.as_micros().to_string();
        let mut extra = vec!["--max-frame", "128M", "--spin-us", &spin];
        if let Some(name) = &a.tcp_congestion {
            extra.extend(["--tcp-congestion", name]);
        }
        let c = TargetChild::spawn_with(&exe, KV_LEN, false, &extra)?;
        let seg = |n: &str| SegInfo {
            id: c.ids[n],
            token: c.tokens[n],
        };
        let t = Endpoint {
            addr: c.addr,
            kv: seg("kv"),
            ro: Some(seg("ro")),
        };
        (Target::Process(Box::new(c)), t)
    };
    if pinned {
        quiesce::runtime::shard::pin_current_thread(0)?;
    }
    // What one `heap` command costs the target, taken off each chunk's.
    let probe = match (target.allocations()?, target.allocations()?) {
        (Some(x), Some(y)) => y - x,
        _ => 0,
    };
    let workers = IMPLS
        .iter()
        .map(|im| Worker::start(*im, t, a.setup()))
        .collect::<Result<Vec<_>, _>>()?;
    println!(
        "quiesce bench --compare: target on {} ({}{}); {} × the default iterations per case, \
         in turns of a few ms",
        t.addr,
        match target {
            Target::Process(_) => "its own process, io_uring",
            Target::Thread => "a thread of this process, io_uring",
        },
        if pinned {
            format!(", on CPU {}; initiators on CPU 0", cpus - 1)
        } else {
            ", unpinned".into()
        },
        a.rounds
    );
    println!("TCP congestion control: {}", congestion_in_use(a));
    let mut rows = Vec::new();
    for case in cases {
        let total = a.iters.unwrap_or(case.default_iters()) * a.rounds;
        let chunk = case.chunk().min(total).max(1);
        // The implementations that run this case, by index.
        let active: Vec<usize> = (0..IMPLS.len()).filter(|&i| runs(IMPLS[i], case)).collect();
        // One turn each to warm up, not counted.
        for &i in &active {
            workers[i].run(case, chunk)?;
        }
        let by_latency = by_latency(&case.name());
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); IMPLS.len()];
        let mut turns: Vec<Vec<f64>> = vec![Vec::new(); IMPLS.len()];
        let mut cpu = vec![Duration::ZERO; IMPLS.len()];
        let mut target_allocs = vec![Some(0u64); IMPLS.len()];
        let (mut left, mut turn) = (total, 0);
        let mut order = active.clone();
        while left > 0 {
            let n = chunk.min(left);
            // A new order every turn: what one run leaves behind (a fenced
            // write's tail the target discards after the outcome, a warm
            // cache) falls on a different successor each time, not always
            // on the same one as with a fixed cycle.
            paired::shuffle(&mut order, turn as u64);
            for &i in &order {
                let before = target.allocations()?;
                let c = workers[i].run(case, n)?;
                let after = target.allocations()?;
                target_allocs[i] = match (target_allocs[i], before, after) {
                    (Some(sum), Some(b), Some(a)) => Some(sum + (a - b).saturating_sub(probe)),
                    _ => None,
                };
                turns[i].push(paired::turn_figure(&c.samples, by_latency));
                samples[i].extend(c.samples);
                cpu[i] += c.cpu;
            }
            left -= n;
            turn += 1;
            progress(&format!("{} {}/{total}…", case.name(), total - left));
        }
        progress("");
        let sums: Vec<Summary> = samples
            .iter()
            .zip(&cpu)
            .map(|(s, c)| summarize(s, *c))
            .collect();
        for &i in &active {
            let im = &IMPLS[i];
            let ratio = if by_latency {
                sums[i].p50 / sums[0].p50
            } else {
                sums[i].gbps / sums[0].gbps
            };
            rows.push(Row {
                case: case.name(),
                im: im.name(),
                s: sums[i].clone(),
                ratio: Some(ratio),
                target_allocs: target_allocs[i].map(|n| n as f64 / total as f64),
                instructions: None,
                turns: std::mem::take(&mut turns[i]),
            });
        }
    }
    drop(workers);
    if a.instructions {
        count_instructions(&exe, &t, &a.setup(), &mut rows)?;
    }
    print!("{}", table(&rows)?);
    println!(
        "(× raw: p50 latency ratio for 4 KiB cases and fail_fast, throughput ratio otherwise; \
         allocs and Ir per iteration, a batch of 64 being one)"
    );
    goals(&rows, !a.spin.is_zero());
    write_json(a, &rows)?;
    // Stopped as it stops by itself, not killed: a `timeline` build's
    // target writes its readings at its exit (scripts/fail-fast-breakdown.sh).
    if let Target::Process(c) = target {
        c.stop(Duration::from_secs(5));
    }
    Ok(true)
}

/// Which congestion control the run's TCP connections use, and why: it
/// decides whether a connection paces its sends (BBR does, inside TCP
/// without an `fq` qdisc), which on loopback can make one connection a
/// third as fast as another for a whole run (docs/BENCHMARKS.md).
fn congestion_in_use(a: &BenchArgs) -> String {
    match &a.tcp_congestion {
        Some(name) => format!("{name} (--tcp-congestion)"),
        None => {
            let default = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control");
            let name = default.as_deref().map_or("unknown", str::trim);
            format!("{name} (the system's default; --tcp-congestion to choose)")
        }
    }
}

/// Fills in instructions per iteration for the small single-transfer cases.
fn count_instructions(
    exe: &std::path::Path,
    t: &Endpoint,
    setup: &Setup,
    rows: &mut [Row],
) -> Result<(), Box<dyn std::error::Error>> {
    if !instructions::available() {
        println!("instructions: valgrind not found (apt-get install valgrind); column left out");
        return Ok(());
    }
    for case in [
        Case::Write(4 << 10),
        Case::Read(4 << 10),
        Case::Write(64 << 10),
    ] {
        // Only the cases this run measured (`--cases`).
        if !rows.iter().any(|r| r.case == case.name()) {
            continue;
        }
        for im in IMPLS.into_iter().filter(|im| runs(*im, case)) {
            progress(&format!("callgrind {} {}…", case.name(), im.name()));
            // One that fails leaves its cell empty: the run's other figures
            // (minutes of them) are still printed.
            let ir = match instructions::per_iteration(exe, t, im, case, setup) {
                Ok(ir) => Some(ir),
                Err(e) => {
                    progress("");
                    println!("instructions: {e}; left out");
                    None
                }
            };
            if let Some(r) = rows
                .iter_mut()
                .find(|r| r.case == case.name() && r.im == im.name())
            {
                r.instructions = ir;
            }
        }
    }
    progress("");
    Ok(())
}

fn table(rows: &[Row]) -> Result<String, std::fmt::Error> {
    let opt = |v: Option<f64>, prec: usize| {
        v.map(|v| format!("{v:.prec$}"))
            .unwrap_or_else(|| "-".into())
    };
    let mut t = String::new();
    writeln!(
        t,
        "{:<14} {:<17} {:>8} {:>8} {:>8} {:>7} {:>9} {:>7} {:>7} {:>8} {:>9} {:>6}",
        "case",
        "impl",
        "min µs",
        "p50 µs",
        "p99 µs",
        "Gb/s",
        "CPU ms/GB",
        "allocs",
        "tgt al",
        "Ir",
        "fence µs",
        "× raw"
    )?;
    for r in rows {
        let s = &r.s;
        writeln!(
            t,
            "{:<14} {:<17} {:>8.1} {:>8.1} {:>8.1} {:>7.2} {:>9.1} {:>7.2} {:>7} {:>8} {:>9} {:>6}",
            r.case,
            r.im,
            s.min,
            s.p50,
            s.p99,
            s.gbps,
            s.cpu_ms_per_gb,
            s.allocs,
            opt(r.target_allocs, 2),
            opt(r.instructions, 0),
            opt(s.fence_p50, 0),
            opt(r.ratio, 2)
        )?;
    }
    Ok(t)
}

/// The cost issue's goals, each MET or MISSED with its figure.
/// Prints each goal's verdict. `spinning`: `--spin-us` was given, so
/// quiesce's initiators and raw spin while tokio blocks — tokio then pays
/// a wake-up per reply the others do not, and no verdict against it is
/// given.
fn goals(rows: &[Row], spinning: bool) {
    let get = |case: &str, im: &str| rows.iter().find(|r| r.case == case && r.im == im);
    let verdict = |ok: bool| if ok { "MET" } else { "MISSED" };
    let q = "quiesce-io_uring";
    if let (Some(r), Some(u)) = (get("write_4k", "raw-std"), get("write_4k", q)) {
        let (m, p) = (u.s.min / r.s.min, u.s.p50 / r.s.p50);
        println!(
            "goal write_4k t_min and p50 <= 1.1x raw: {} (t_min {m:.2}, p50 {p:.2})",
            verdict(m <= 1.1 && p <= 1.1)
        );
        if let Some(ir) = u.instructions {
            println!(
                "goal write_4k <= 4000 user instructions including the batch: {} ({ir:.0})",
                verdict(ir <= 4000.0)
            );
        }
        // Where the time goes: the same write through the transport alone.
        if let Some(d) = get("write_4k", "quiesce-direct") {
            let ir = match (u.instructions, d.instructions) {
                (Some(all), Some(alone)) => {
                    format!(", {:.0} of the {all:.0} instructions", all - alone)
                }
                _ => String::new(),
            };
            println!(
                "  split: the transport alone (quiesce-direct) t_min {:.2}, p50 {:.2} x raw; \
                 the batch layer +{:.2} us p50{ir}",
                d.s.min / r.s.min,
                d.s.p50 / r.s.p50,
                u.s.p50 - d.s.p50
            );
        }
        let tgt = u.target_allocs.map_or("-".into(), |a| format!("{a:.2}"));
        println!(
            "goal write_4k allocations <= 2 on the initiator, 0 on the target: {} ({:.2}, {tgt})",
            verdict(u.s.allocs <= 2.0 && u.target_allocs.is_some_and(|a| a < 0.005)),
            u.s.allocs
        );
    }
    for (case, min) in [("write_64m", 1.2), ("batch_64x64k", 1.2)] {
        if let (Some(r), Some(u)) = (get(case, "raw-std"), get(case, q)) {
            let x = u.s.gbps / r.s.gbps;
            println!(
                "goal {case} >= {min}x raw throughput: {} ({x:.2})",
                verdict(x >= min)
            );
        }
    }
    if let Some(f) = get("fail_fast_64m", q).and_then(|r| r.s.fence_p50) {
        println!(
            "goal fail_fast_64m <= 1 ms from failure to safe outcome: {} ({:.2} ms)",
            verdict(f <= 1000.0),
            f / 1e3
        );
    }
    // A case's pooled figure: p50 for latency cases, throughput otherwise.
    let figure = |case: &str, s: &Summary| if by_latency(case) { s.p50 } else { s.gbps };
    let cases: std::collections::BTreeSet<&str> = rows.iter().map(|r| r.case.as_str()).collect();
    for rival in ["quiesce-epoll", "tokio"] {
        let mut pooled_behind = Vec::new();
        let mut significant = Vec::new();
        let mut by_turn = Vec::new();
        for c in &cases {
            let (Some(u), Some(o)) = (get(c, q), get(c, rival)) else {
                continue;
            };
            let x = paired::lead(figure(c, &u.s), figure(c, &o.s), by_latency(c));
            if x < 1.0 {
                pooled_behind.push(format!("{c} {x:.3}"));
            }
            let p = paired::paired(&u.turns, &o.turns, by_latency(c));
            let line = format!(
                "{c} {:.3} {}/{} p={:.2}",
                p.median_lead, p.behind, p.turns, p.p_behind
            );
            if p.significantly_behind() {
                significant.push(line.clone());
            }
            by_turn.push(line);
        }
        // Decided turn by turn (each turn's two figures saw the same
        // machine); the pooled leads, which this VM's wake-up modes swing,
        // are printed beside.
        if spinning && rival == "tokio" {
            println!(
                "goal io_uring not behind tokio on any case: NOT JUDGED (--spin-us: quiesce \
                 spins and tokio blocks, so only tokio pays a wake-up per reply)"
            );
            println!(
                "  by turn against tokio, for reference: {}",
                by_turn.join(", ")
            );
            continue;
        }
        println!(
            "goal io_uring not behind {rival} on any case: {} (behind by turn: {significant:?}; \
             pooled p50/throughput behind: {pooled_behind:?})",
            verdict(significant.is_empty())
        );
        println!(
            "  by turn against {rival} (median lead, turns behind, sign-test p): {}",
            by_turn.join(", ")
        );
    }
}

/// Whether a case is judged by its p50 latency (the 4 KiB cases and
/// fail-fast) rather than its throughput.
fn by_latency(case: &str) -> bool {
    case.starts_with("fail_fast") || case.ends_with("_4k")
}
