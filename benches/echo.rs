//! Side-by-side 1 KiB TCP echo over loopback: quiesce (io_uring and epoll),
//! tokio current_thread and monoio. Each server runs on one thread pinned to
//! core 0; the same blocking std::net client runs on core 1 for all of them.
//!
//! Per implementation and round: a throughput run (`--conns` connections over
//! `--threads` client threads, each thread writing 1 KiB on each of its
//! connections, then reading every echo back), then a latency run (one
//! connection, ping-pong). Rounds interleave the implementations; the report
//! gives the median over rounds.
//!
//! `cargo bench --bench echo -- --secs 1 --rounds 1 --conns 8 --threads 4 --warmup 0.3`

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use quiesce_runtime::{shard, spawn_local, DriverKind, Runtime};

/// Message size.
const MSG: usize = 1024;
const SERVER_CORE: usize = 0;
const CLIENT_CORE: usize = 1;

/// An empty histogram of nanoseconds, 1 ns to 60 s, 3 significant digits.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap()
}

struct Args {
    secs: f64,
    warmup: f64,
    rounds: usize,
    conns: usize,
    threads: usize,
}

impl Args {
    fn parse() -> Args {
        let mut a = Args {
            secs: 2.0,
            warmup: 0.3,
            rounds: 3,
            conns: 16,
            threads: 4,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut value = || -> f64 {
                let v = it.next().unwrap_or_default();
                v.parse()
                    .unwrap_or_else(|_| panic!("{flag} needs a number, got {v:?}"))
            };
            match flag.as_str() {
                "--bench" => {} // passed by cargo bench
                "--secs" => a.secs = value(),
                "--warmup" => a.warmup = value(),
                "--rounds" => a.rounds = value() as usize,
                "--conns" => a.conns = value() as usize,
                "--threads" => a.threads = value() as usize,
                other => eprintln!("echo: ignoring argument {other:?}"),
            }
        }
        a.rounds = a.rounds.max(1);
        a.conns = a.conns.max(1);
        a.threads = a.threads.clamp(1, a.conns);
        a
    }
}

/// Pins the calling thread to `core`; warns once if that is not possible.
fn pin(core: usize) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    // SAFETY: cpu_set_t is plain data (all-zero = empty set), core < CPU_SETSIZE, and the kernel only reads the set.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 && !WARNED.swap(true, Ordering::Relaxed) {
        let e = std::io::Error::last_os_error();
        eprintln!("echo: could not pin to core {core} ({e}); running unpinned");
    }
}

/// Server implementations, in the order they run and are reported.
#[derive(Clone, Copy)]
enum Impl {
    QuiesceUring,
    QuiesceEpoll,
    Tokio,
    Monoio,
}

impl Impl {
    const ALL: [Impl; 4] = [
        Self::QuiesceUring,
        Self::QuiesceEpoll,
        Self::Tokio,
        Self::Monoio,
    ];

    fn name(self) -> &'static str {
        match self {
            Impl::QuiesceUring => "quiesce io_uring",
            Impl::QuiesceEpoll => "quiesce epoll",
            Impl::Tokio => "tokio current_thread",
            Impl::Monoio => "monoio io_uring",
        }
    }
}

// ---------------------------------------------------------------- servers

/// How the server thread is told to stop.
enum Stop {
    /// quiesce and tokio: `block_on` waits on this channel.
    Chan(shard::Sender<()>),
    /// monoio (whose wakers are not cross-thread without its `sync` feature):
    /// the flag is set, then a dummy connection wakes the accept loop.
    Poke(Arc<AtomicBool>),
}

struct Server {
    addr: SocketAddr,
    stop: Stop,
    thread: thread::JoinHandle<()>,
}

impl Server {
    fn start(imp: Impl) -> Server {
        let (ready_tx, ready_rx) = mpsc::channel();
        let (stop_tx, stop_rx) = shard::channel();
        let flag = Arc::new(AtomicBool::new(false));
        let stop = match imp {
            Impl::Monoio => Stop::Poke(flag.clone()),
            _ => Stop::Chan(stop_tx),
        };
        let thread = thread::Builder::new()
            .name(format!("echo-server-{}", imp.name()))
            .spawn(move || {
                pin(SERVER_CORE);
                match imp {
                    Impl::QuiesceUring => quiesce_server(DriverKind::IoUring, ready_tx, stop_rx),
                    Impl::QuiesceEpoll => quiesce_server(DriverKind::Epoll, ready_tx, stop_rx),
                    Impl::Tokio => tokio_server(ready_tx, stop_rx),
                    Impl::Monoio => monoio_server(ready_tx, flag),
                }
            })
            .expect("spawn server thread");
        let addr = ready_rx.recv().expect("server failed to start");
        Server { addr, stop, thread }
    }

    fn stop(self) {
        match self.stop {
            Stop::Chan(tx) => tx.send(()).expect("server gone before stop"),
            Stop::Poke(flag) => {
                flag.store(true, Ordering::SeqCst);
                drop(TcpStream::connect(self.addr));
            }
        }
        self.thread.join().expect("server thread panicked");
    }
}

/// Where a server thread reports the address it listens on.
type Ready = mpsc::Sender<SocketAddr>;

fn quiesce_server(kind: DriverKind, ready: Ready, mut stop: shard::Receiver<()>) {
    let rt = Runtime::builder()
        .driver(kind)
        .build()
        .expect("quiesce runtime");
    rt.block_on(async move {
        let listener = quiesce_runtime::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        ready.send(listener.local_addr().unwrap()).unwrap();
        let accept = spawn_local(async move {
            while let Ok((s, _)) = listener.accept().await {
                s.set_nodelay(true).unwrap();
                spawn_local(async move {
                    // Capacity MSG, length 0: a read sets the length to what it got.
                    // (Reads never shrink a Vec, so it must be cleared each time.)
                    let mut buf = Vec::with_capacity(MSG);
                    loop {
                        buf.clear();
                        let (res, b) = s.read(buf).await;
                        if !matches!(res, Ok(n) if n > 0) {
                            break;
                        }
                        let (res, b) = s.write_all(b).await;
                        buf = b;
                        if res.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        stop.recv().await;
        accept.abort();
    });
    drop(rt); // cancels what is left and waits for the kernel to let go
}

fn tokio_server(ready: Ready, mut stop: shard::Receiver<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        ready.send(listener.local_addr().unwrap()).unwrap();
        let accept = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                s.set_nodelay(true).unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; MSG];
                    while let Ok(n @ 1..) = s.read(&mut buf).await {
                        if s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        stop.recv().await;
        accept.abort();
    });
}

fn monoio_server(ready: Ready, stop: Arc<AtomicBool>) {
    use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
    let mut rt = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
        .enable_timer()
        .build()
        .expect("monoio runtime");
    rt.block_on(async move {
        let listener = monoio::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        ready.send(listener.local_addr().unwrap()).unwrap();
        while let Ok((mut s, _)) = listener.accept().await {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            s.set_nodelay(true).unwrap();
            monoio::spawn(async move {
                let mut buf = Vec::with_capacity(MSG);
                loop {
                    buf.clear();
                    let (res, b) = s.read(buf).await;
                    if !matches!(res, Ok(n) if n > 0) {
                        break;
                    }
                    let (res, b) = s.write_all(b).await;
                    buf = b;
                    if res.is_err() {
                        break;
                    }
                }
            });
        }
    });
}

// ---------------------------------------------------------------- client

/// What one client thread measured after warm-up.
struct Measured {
    round_trips: u64,
    /// Nanoseconds per batch (one round trip on each of the thread's connections).
    hist: Histogram<u64>,
}

/// One client thread: `conns` connections, each batch writes a message on
/// every connection then reads every echo back (and checks it).
fn drive(
    addr: SocketAddr,
    conns: usize,
    warmup: Duration,
    span: Duration,
    start: &Barrier,
) -> Measured {
    pin(CLIENT_CORE);
    let mut socks: Vec<TcpStream> = (0..conns)
        .map(|_| {
            let s = TcpStream::connect(addr).expect("connect");
            s.set_nodelay(true).unwrap();
            s
        })
        .collect();
    let mut msg = [0x5au8; MSG];
    let mut back = [0u8; MSG];
    let mut hist = histogram();
    let mut round_trips = 0;
    start.wait();
    let warm_end = Instant::now() + warmup;
    let end = warm_end + span;
    loop {
        let t = Instant::now();
        if t >= end {
            break;
        }
        msg[0] = msg[0].wrapping_add(1);
        for s in &mut socks {
            s.write_all(&msg).expect("client write");
        }
        for s in &mut socks {
            s.read_exact(&mut back).expect("client read");
            assert!(back == msg, "echo returned different bytes");
        }
        if t >= warm_end {
            round_trips += conns as u64;
            hist.saturating_record(t.elapsed().as_nanos() as u64);
        }
    }
    Measured { round_trips, hist } // dropping `socks` closes the connections
}

/// Runs `threads` client threads over `conns` connections in total.
fn run_client(addr: SocketAddr, conns: usize, threads: usize, args: &Args) -> Measured {
    let warmup = Duration::from_secs_f64(args.warmup);
    let span = Duration::from_secs_f64(args.secs);
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let n = conns / threads + usize::from(i < conns % threads);
            let start = start.clone();
            thread::spawn(move || drive(addr, n, warmup, span, &start))
        })
        .collect();
    let mut total = Measured {
        round_trips: 0,
        hist: histogram(),
    };
    for h in handles {
        let m = h.join().expect("client thread panicked");
        total.round_trips += m.round_trips;
        total.hist.add(&m.hist).unwrap();
    }
    total
}

/// One implementation's figures for one round.
#[derive(Clone, Copy)]
struct Sample {
    rt_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
}

fn run_impl(imp: Impl, args: &Args) -> Sample {
    let server = Server::start(imp);
    let tput = run_client(server.addr, args.conns, args.threads, args);
    let lat = run_client(server.addr, 1, 1, args).hist;
    server.stop();
    let us = |q: f64| lat.value_at_quantile(q) as f64 / 1e3;
    Sample {
        rt_per_s: tput.round_trips as f64 / args.secs,
        p50_us: us(0.50),
        p99_us: us(0.99),
        p999_us: us(0.999),
    }
}

// ---------------------------------------------------------------- report

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn main() {
    let args = Args::parse();
    println!(
        "echo: {MSG} B messages, {} conns over {} client threads (core {CLIENT_CORE}), server on core {SERVER_CORE}, \
         {}s + {}s warm-up per run, {} round(s)",
        args.conns, args.threads, args.secs, args.warmup, args.rounds
    );
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); Impl::ALL.len()];
    for round in 1..=args.rounds {
        for (i, imp) in Impl::ALL.into_iter().enumerate() {
            let s = run_impl(imp, &args);
            eprintln!(
                "round {round}/{}: {:<22} {:>10.0} rt/s  p50 {:>7.1} µs",
                args.rounds,
                imp.name(),
                s.rt_per_s,
                s.p50_us
            );
            samples[i].push(s);
        }
    }
    let med: Vec<Sample> = samples
        .iter()
        .map(|v| {
            let m = |f: fn(&Sample) -> f64| median(v.iter().map(f).collect());
            Sample {
                rt_per_s: m(|s| s.rt_per_s),
                p50_us: m(|s| s.p50_us),
                p99_us: m(|s| s.p99_us),
                p999_us: m(|s| s.p999_us),
            }
        })
        .collect();

    println!();
    println!(
        "median of {} round(s); latency from the 1-connection ping-pong run",
        args.rounds
    );
    println!(
        "{:<22} {:>12} {:>10} {:>9} {:>9} {:>10}",
        "impl", "round-trips/s", "MB/s", "p50 µs", "p99 µs", "p99.9 µs"
    );
    for (imp, s) in Impl::ALL.into_iter().zip(&med) {
        println!(
            "{:<22} {:>12.0} {:>10.1} {:>9.1} {:>9.1} {:>10.1}",
            imp.name(),
            s.rt_per_s,
            s.rt_per_s * MSG as f64 / 1e6, // payload echoed, one direction
            s.p50_us,
            s.p99_us,
            s.p999_us
        );
    }

    let (uring, epoll, tokio, monoio) = (med[0], med[1], med[2], med[3]);
    let tput = uring.rt_per_s / monoio.rt_per_s;
    let p50 = uring.p50_us / tokio.p50_us;
    let epoll_tput = epoll.rt_per_s / tokio.rt_per_s;
    let epoll_p50 = epoll.p50_us / tokio.p50_us;
    let uring_tput_tokio = uring.rt_per_s / tokio.rt_per_s;
    println!();
    println!("quiesce io_uring throughput / monoio throughput: {tput:.2}x");
    println!("quiesce io_uring p50 / tokio p50:                {p50:.2}x");
    println!("quiesce epoll throughput / tokio throughput:     {epoll_tput:.2}x");
    println!("quiesce epoll p50 / tokio p50:                   {epoll_p50:.2}x");
    println!("quiesce io_uring throughput / tokio throughput:  {uring_tput_tokio:.2}x");
    println!();
    let met = |ok: bool| if ok { "MET" } else { "MISSED" };
    // Issue 14's goals.
    println!(
        "goal throughput >= 1.3x monoio: {} ({tput:.2})",
        met(tput >= 1.3)
    );
    println!(
        "goal throughput >= 1.1x tokio: {} ({uring_tput_tokio:.2})",
        met(uring_tput_tokio >= 1.1)
    );
    println!("goal p50 <= tokio: {} ({p50:.2})", met(p50 <= 1.0));
}
