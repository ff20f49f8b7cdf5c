//! The `quiesce` command: `demo`, `target`, `bench`.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Heap counters for `bench`, `soak` and the target's `heap` command (relaxed
/// atomics around the system allocator).
#[global_allocator]
static HEAP: quiesce::runtime::heap::CountingAlloc = quiesce::runtime::heap::CountingAlloc;

mod cmd {
    pub mod bench;
    pub mod demo;
    pub mod early_return;
    pub mod soak;
    pub mod target;
}

#[derive(Parser)]
#[command(
    name = "quiesce",
    version,
    about = "Transfers that resolve only once nothing can touch their buffers"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

// Parsed once at start-up: the size difference between variants is irrelevant.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run the seed scenario against a target on loopback and count corrupted rounds.
    Demo {
        /// Rounds to run (at least 1).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
        rounds: u32,
        /// Size of the valid write, in bytes (suffixes K, M, G).
        #[arg(long, default_value = "64M", value_parser = parse_size)]
        size: usize,
        /// tcp, or rdma (needs an RDMA device; `scripts/softroce-vm.sh` has one).
        #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
        transport: String,
        /// Publish the target in this directory (etcd://host:port[/prefix])
        /// and find it there by its `node/segment` paths.
        #[arg(long)]
        directory: Option<String>,
    },
    /// State that must not grow (failed batches, connection churn) and an
    /// honest client under a flood, against a target process.
    Soak {
        /// Failed (fenced) batches on one session (at least 2: growth is
        /// measured after the first 1 %).
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(2..))]
        batches: u64,
        /// Connections opened, authenticated and closed (at least 1).
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
        connections: u64,
        /// Connections that never finish their handshake, held open (at
        /// least 1).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
        flood: u32,
    },
    /// Latency and bandwidth against a target, or `--compare` against raw TCP and tokio.
    Bench {
        /// Start a target on loopback and compare raw std TCP, tokio, quiesce io_uring and epoll.
        #[arg(
            long,
            conflicts_with_all = [
                "connect", "token", "directory", "size", "op", "batch", "initiator",
                "driver", "busy_poll"
            ]
        )]
        compare: bool,
        /// Start a target on loopback and measure many transfers at once:
        /// 1,000 batches in flight (heap per batch), 16 concurrent 64 MiB
        /// writes, two shards against one.
        #[arg(
            long,
            conflicts_with_all = [
                "compare", "connect", "token", "directory", "json", "iters", "size",
                "driver", "spin_us", "op", "batch", "initiator", "busy_poll", "rounds",
                "zc_threshold"
            ]
        )]
        scale: bool,
        /// Target address (from `quiesce target`).
        #[arg(long)]
        connect: Option<SocketAddr>,
        /// Token of the target's `kv` segment.
        #[arg(long)]
        token: Option<quiesce::transports::Token>,
        /// tcp, or rdma (needs an RDMA device).
        #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
        transport: String,
        /// rdma: busy-poll the completion queue (lowest latency, a core spins).
        #[arg(long)]
        busy_poll: bool,
        /// write or read.
        #[arg(long, default_value = "write", value_parser = ["write", "read"])]
        op: String,
        /// Comma-separated sizes (suffixes K, M, G).
        #[arg(long, default_value = "4K,64K,1M,64M", value_delimiter = ',', value_parser = parse_size)]
        size: Vec<usize>,
        /// Iterations per size (default: by size; at least 1).
        #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        iters: Option<usize>,
        /// Tasks per batch (at least 1).
        #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        batch: usize,
        /// --compare: multiples of the default iterations per case.
        /// (3 by default; at least 1).
        #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        rounds: Option<usize>,
        /// Also write the results as JSON.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Driver for quiesce over TCP (io_uring, the default, or epoll).
        #[arg(long, value_parser = ["io_uring", "epoll"])]
        driver: Option<String>,
        /// Without --compare: the initiator to run (quiesce = TCP, local =
        /// quiesce's local transport, local-socket = the same with small
        /// requests on the socket rather than the shared-memory mailbox,
        /// raw, tokio, direct = quiesce's TCP transport without the batch
        /// layer (single writes and reads, --driver picks the driver);
        /// rdma: quiesce, or direct = the same for RDMA).
        #[arg(long = "impl", default_value = "quiesce")]
        initiator: String,
        /// quiesce: send slices of at least this size with SEND_ZC (io_uring).
        #[arg(long, value_parser = parse_size)]
        zc_threshold: Option<usize>,
        /// --compare: run the target on a thread of this process instead of
        /// its own (every implementation then pays a cross-thread wake-up,
        /// and the allocs column counts the target's allocations too).
        #[arg(long)]
        same_process: bool,
        /// --compare: skip counting instructions under callgrind.
        #[arg(long)]
        no_instructions: bool,
        /// --compare: run only these cases (comma-separated, named as the
        /// table names them, e.g. fail_fast_64m,write_1m).
        #[arg(long, value_delimiter = ',')]
        cases: Vec<String>,
        /// Find --peer's address here (etcd://host:port[/prefix]) instead of
        /// --connect.
        #[arg(long, requires = "peer", conflicts_with = "connect")]
        directory: Option<String>,
        /// The target's node name in --directory.
        #[arg(long, requires = "directory")]
        peer: Option<String>,
        /// quiesce's initiators (and --compare's target) busy-poll this
        /// many µs before their reactor blocks; raw then spins on a
        /// non-blocking socket (never blocks); tokio blocks.
        #[arg(long, default_value_t = 0)]
        spin_us: u64,
        /// --compare and --connect: every initiator's TCP congestion
        /// control (TCP_CONGESTION: cubic, reno, bbr, …), and --compare's
        /// target's; default: the system's.
        #[arg(long, conflicts_with = "scale")]
        tcp_congestion: Option<String>,
    },
    /// Serve segments `kv` (read-write, --size bytes), `ro` and `wo` to peers.
    Target {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// Size of the `kv` segment (suffixes K, M, G).
        #[arg(long, default_value = "64M", value_parser = parse_size)]
        size: usize,
        /// Keep serving when stdin closes.
        #[arg(long)]
        no_stdin: bool,
        /// tcp, or rdma: the segments are RDMA memory regions too.
        #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
        transport: String,
        /// Demonstrations only: acknowledge fences without applying them.
        #[arg(long)]
        ignore_fences: bool,
        /// Publish the endpoint and segments here: etcd://host:port[/prefix]
        /// (under a lease: they vanish within its TTL if this process dies).
        #[arg(long)]
        directory: Option<String>,
        /// This node's name in the directory.
        #[arg(long, default_value = "quiesce-target")]
        node: String,
        /// The largest frame peers may send (the raw bench initiator sends
        /// a whole transfer as one frame: `bench --compare` serves 128M).
        #[arg(long, default_value = "16M", value_parser = parse_size)]
        max_frame: usize,
        /// Busy-poll this many µs before the reactor blocks (a core spins
        /// while requests keep coming; 0: block at once).
        #[arg(long, default_value_t = 0)]
        spin_us: u64,
        /// The TCP congestion control of the connections it serves
        /// (TCP_CONGESTION: cubic, reno, bbr, …); default: the system's.
        #[arg(long)]
        tcp_congestion: Option<String>,
    },
}

/// `4096`, `4K`, `64M`, `1G`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n = num
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{s:?} is not a size of at least 1 byte (like 4096, 4K, 64M)"))?;
    // No buffer is larger: Rust's allocation limit, less the page the
    // buffers are aligned to (past it, allocating panicked).
    if n > (isize::MAX as usize) & !4095 {
        return Err(format!("{s:?} is too large for a buffer"));
    }
    Ok(n)
}

/// The `bench` flags that say which mode a run is in, and which of the
/// others it was given.
struct BenchFlags<'a> {
    rdma: bool,
    compare: bool,
    initiator: &'a str,
    busy_poll: bool,
    spin_us: u64,
    driver: bool,
    tcp_congestion: bool,
    zc_threshold: bool,
    /// Flags only `--compare` reads, and whether each was given (clap's
    /// `requires = "compare"` took the flag's default `false` for present).
    compare_only: [(&'a str, bool); 4],
}

/// A flag the bench mode `f` would accept and ignore (never: a figure must
/// measure what its command line says), named with why.
fn bench_flags_unused(f: &BenchFlags) -> Option<String> {
    let no = |flag: &str, with: &str| Some(format!("{flag} cannot be used with {with}"));
    if !f.compare {
        if let Some((flag, _)) = f.compare_only.iter().find(|(_, given)| *given) {
            return Some(format!("{flag} can only be used with --compare"));
        }
    }
    if f.rdma {
        if !matches!(f.initiator, "quiesce" | "direct") {
            return no(
                &format!("--impl {}", f.initiator),
                "--transport rdma (it runs quiesce or direct)",
            );
        }
        let tcp_only = [
            ("--spin-us", f.spin_us != 0),
            ("--driver", f.driver),
            ("--tcp-congestion", f.tcp_congestion),
            ("--zc-threshold", f.zc_threshold),
        ];
        if let Some((flag, _)) = tcp_only.iter().find(|(_, given)| *given) {
            return no(flag, "--transport rdma (it sets TCP initiators)");
        }
    } else if f.busy_poll {
        return no(
            "--busy-poll",
            "--transport tcp (it polls RDMA completion queues)",
        );
    }
    if f.zc_threshold && !f.compare && matches!(f.initiator, "raw" | "tokio") {
        return no(
            "--zc-threshold",
            &format!("--impl {} (it sets quiesce's sends)", f.initiator),
        );
    }
    None
}

/// `peer`'s address in the directory at `url`.
fn resolve(url: &str, peer: &str) -> Result<SocketAddr, quiesce::directory::DirectoryError> {
    let dir = quiesce::directory::Directory::open(url)?;
    Ok(dir.resolve(peer)?.addr)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    quiesce::logs::init();
    let res = match cli.cmd.unwrap_or(Cmd::Demo {
        rounds: 50,
        size: 64 << 20,
        transport: "tcp".into(),
        directory: None,
    }) {
        Cmd::Demo {
            rounds,
            size,
            transport,
            directory,
        } => cmd::demo::run(rounds, size, transport == "rdma", directory.as_deref()),
        Cmd::Soak {
            batches,
            connections,
            flood,
        } => cmd::soak::run(cmd::soak::Options {
            batches,
            connections,
            flood: flood as usize,
        }),
        Cmd::Target {
            listen,
            size,
            no_stdin,
            transport,
            ignore_fences,
            directory,
            node,
            max_frame,
            spin_us,
            tcp_congestion,
        } => cmd::target::run(cmd::target::Options {
            tcp_congestion,
            max_frame: max_frame as u64,
            spin: std::time::Duration::from_micros(spin_us),
            listen,
            size,
            watch_stdin: !no_stdin,
            rdma: transport == "rdma",
            ignore_fences,
            directory: directory.map(|url| (url, node)),
        })
        .map(|()| true),
        Cmd::Bench {
            compare,
            scale,
            connect,
            token,
            transport,
            busy_poll,
            op,
            size,
            iters,
            batch,
            rounds,
            json,
            driver,
            initiator,
            zc_threshold,
            same_process,
            no_instructions,
            cases,
            directory,
            peer,
            spin_us,
            tcp_congestion,
        } => {
            if let Some(why) = bench_flags_unused(&BenchFlags {
                rdma: transport == "rdma",
                compare,
                initiator: &initiator,
                busy_poll,
                spin_us,
                driver: driver.is_some(),
                tcp_congestion: tcp_congestion.is_some(),
                zc_threshold: zc_threshold.is_some(),
                compare_only: [
                    ("--rounds", rounds.is_some()),
                    ("--same-process", same_process),
                    ("--no-instructions", no_instructions),
                    ("--cases", !cases.is_empty()),
                ],
            }) {
                eprintln!("quiesce: {why}");
                return ExitCode::from(2);
            }
            let connect = match (directory, peer) {
                (Some(url), Some(peer)) => match resolve(&url, &peer) {
                    Ok(a) => Some(a),
                    Err(e) => {
                        eprintln!("quiesce: {e}");
                        return ExitCode::from(2);
                    }
                },
                _ => connect,
            };
            // One of the two (clap checked).
            let driver = match driver.as_deref().unwrap_or("io_uring") {
                "epoll" => quiesce::runtime::DriverKind::Epoll,
                _ => quiesce::runtime::DriverKind::IoUring,
            };
            cmd::bench::run(cmd::bench::BenchArgs {
                compare,
                scale,
                connect,
                token,
                transport,
                busy_poll,
                op,
                sizes: size,
                iters,
                batch,
                rounds: rounds.unwrap_or(3),
                json,
                driver,
                initiator,
                zc_threshold,
                same_process,
                instructions: !no_instructions,
                cases,
                spin: std::time::Duration::from_micros(spin_us),
                tcp_congestion,
            })
        }
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("quiesce: {e}");
            ExitCode::from(2)
        }
    }
}
