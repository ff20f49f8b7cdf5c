//! 4 KiB latency and 64 MiB throughput across network namespaces (veth and
//! a bridge, `quiesce::cluster`), quiesce beside the raw std TCP initiator
//! on the same link, interleaved round by round: clean, with 2 ms ± 1 ms
//! delay each way (the cluster's delay line: this kernel has no netem), and
//! with 1 % loss on top. The target runs on one host, `quiesce bench` on
//! another. As root:
//!
//! ```sh
//! cargo build --release --bin quiesce --example cluster_bench
//! target/release/examples/cluster_bench [ROUNDS]
//! ```

use std::path::PathBuf;

use std::time::Duration;

use quiesce::cluster::{Cluster, Delay};
use quiesce::target_child::TargetChild;

const TARGET: usize = 0;
const INITIATOR: usize = 1;

/// (t_min µs, t_typical µs, MB/s) per size row of `quiesce bench`.
fn bench(c: &Cluster, exe: &PathBuf, t: &TargetChild, im: &str) -> Vec<(f64, f64, f64)> {
    let out = c
        .launcher(INITIATOR)
        .arg(exe)
        .args(["bench", "--connect", &t.addr.to_string()])
        .args(["--token", &t.tokens["kv"].to_string()])
        .args(["--impl", im, "--size", "4K,64M"])
        .output()
        .expect("quiesce bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let f: Vec<f64> = l
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            (f.len() >= 10).then(|| (f[2], f[3], f[8]))
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let exe = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|p| p.parent())
        .unwrap()
        .join("quiesce");
    let c = Cluster::new(2).expect("root, iproute2 and tc are needed");
    let mut launcher = c.launcher(TARGET);
    launcher.arg(&exe);
    let listen = format!("{}:7000", c.hosts[TARGET].ip);
    let t = TargetChild::spawn_command(
        launcher,
        64 << 20,
        false,
        &["--listen", &listen, "--max-frame", "128M"],
    )
    .expect("target");
    let jittery = Delay {
        base: Duration::from_millis(2),
        jitter: Duration::from_millis(1),
    };
    let profiles: [(&str, Option<Delay>, bool); 3] = [
        ("clean veth", None, false),
        ("2ms±1ms each way", Some(jittery), false),
        ("2ms±1ms + 1% loss", Some(jittery), true),
    ];
    println!("cluster bench: veth + bridge, target and initiator in their own namespaces; {rounds} interleaved rounds; median of rounds");
    println!(
        "{:<34} {:>8} {:>12} {:>12} {:>12} {:>12} {:>10}",
        "profile", "impl", "4K t_min", "4K p50", "64M MB/s", "4K p50 ×raw", "64M ×raw"
    );
    for (label, delay, lossy) in profiles {
        for h in [TARGET, INITIATOR] {
            c.loss(h, lossy.then_some(1)).unwrap();
            c.delay(h, delay).unwrap();
        }
        let mut runs: [Vec<Vec<(f64, f64, f64)>>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..rounds {
            for (i, im) in ["raw", "quiesce"].iter().enumerate() {
                runs[i].push(bench(&c, &exe, &t, im));
            }
        }
        let col = |i: usize, row: usize, f: fn(&(f64, f64, f64)) -> f64| {
            median(runs[i].iter().map(|r| f(&r[row])).collect())
        };
        let raw = (col(0, 0, |r| r.1), col(0, 1, |r| r.2));
        for (i, im) in ["raw-std", "quiesce"].iter().enumerate() {
            let p50 = col(i, 0, |r| r.1);
            let mbs = col(i, 1, |r| r.2);
            println!(
                "{:<34} {:>8} {:>12.2} {:>12.2} {:>12.1} {:>12.2} {:>10.2}",
                label,
                im,
                col(i, 0, |r| r.0),
                p50,
                mbs,
                p50 / raw.0,
                mbs / raw.1
            );
        }
    }
}
