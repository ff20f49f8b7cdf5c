//! User-space instructions per iteration, where hardware counters are
//! missing (this VM has none: `perf stat -e instructions:u` answers
//! `<not supported>`): the initiator alone runs under
//! `valgrind --tool=callgrind`, as `quiesce bench --connect` against the same
//! target process, twice — for [`SHORT`] and [`LONG`] iterations — and the
//! difference of the two totals over `LONG - SHORT` is what one iteration
//! costs, start-up, connection and teardown cancelling out. Callgrind counts
//! every thread of the process and nothing in the kernel.
//!
//! Under callgrind the initiator runs some 50× slower while the target does
//! not, so an answer is usually there by the time the initiator looks for
//! it: the figure holds fewer idle polls than a real run, and is the cost of
//! the work, not of waiting.

use std::path::Path;
use std::process::{Command, Stdio};

use super::{Case, Endpoint, Impl, Setup};
use quiesce::runtime::DriverKind;

/// Iterations of the shorter run.
const SHORT: usize = 100;
/// Iterations of the longer run.
const LONG: usize = 600;

/// Whether `valgrind` can be run.
pub fn available() -> bool {
    Command::new("valgrind")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Instructions one iteration of `case` costs `im` against `t`.
pub fn per_iteration(
    exe: &Path,
    t: &Endpoint,
    im: Impl,
    case: Case,
    setup: &Setup,
) -> Result<f64, Box<dyn std::error::Error>> {
    let short = total(exe, t, im, case, SHORT, setup)?;
    let long = total(exe, t, im, case, LONG, setup)?;
    Ok((long as f64 - short as f64) / (LONG - SHORT) as f64)
}

/// The instructions of one whole `quiesce bench` run under callgrind.
fn total(
    exe: &Path,
    t: &Endpoint,
    im: Impl,
    case: Case,
    iters: usize,
    setup: &Setup,
) -> Result<u64, Box<dyn std::error::Error>> {
    let (initiator, driver) = match im {
        Impl::Raw => ("raw", "io_uring"),
        Impl::Tokio => ("tokio", "io_uring"),
        Impl::Uring => ("quiesce", "io_uring"),
        Impl::Epoll => ("quiesce", "epoll"),
        Impl::Local => ("local", "io_uring"),
        Impl::LocalSocket => ("local-socket", "io_uring"),
        Impl::Direct(DriverKind::Epoll) => ("direct", "epoll"),
        Impl::Direct(_) => ("direct", "io_uring"),
        Impl::Rdma { .. } => return Err("callgrind runs count the TCP initiators".into()),
    };
    let (op, size) = match case {
        Case::Write(s) => ("write", s),
        Case::Read(s) => ("read", s),
        _ => return Err(format!("{}: callgrind runs count single transfers", case.name()).into()),
    };
    let out = std::env::temp_dir().join(format!(
        "quiesce-callgrind.{}.{}.{}.{iters}",
        std::process::id(),
        im.name(),
        case.name()
    ));
    // Set up as the timed initiator was, but blocking when idle (no
    // --spin-us): the figure is the cost of the work, not of waiting.
    let mut cmd = Command::new("valgrind");
    cmd.arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(exe)
        .args(["bench", "--connect", &t.addr.to_string()])
        .args(["--token", &t.kv.token.to_string()])
        .args(["--impl", initiator, "--driver", driver, "--op", op])
        .args(["--size", &size.to_string(), "--iters", &iters.to_string()]);
    // Only quiesce's initiators send with SEND_ZC (the others refuse the
    // flag rather than ignore it).
    if let Some(zc) = setup
        .zc_threshold
        .filter(|_| !matches!(im, Impl::Raw | Impl::Tokio))
    {
        cmd.args(["--zc-threshold", &zc.to_string()]);
    }
    if let Some(name) = &setup.tcp_congestion {
        cmd.args(["--tcp-congestion", name]);
    }
    let run = cmd.stdout(Stdio::null()).output()?;
    let text = std::fs::read_to_string(&out);
    let _ = std::fs::remove_file(&out);
    if !run.status.success() {
        return Err(format!(
            "callgrind {} {}: {}\n{}",
            im.name(),
            case.name(),
            run.status,
            String::from_utf8_lossy(&run.stderr)
        )
        .into());
    }
    parse_total(&text?).ok_or_else(|| format!("no totals in {}", out.display()).into())
}

/// The `totals:` (or `summary:`) line of a callgrind output file.
fn parse_total(text: &str) -> Option<u64> {
    text.lines()
        .rev()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::parse_total;

    #[test]
    fn reads_the_totals_line() {
        let f = "events: Ir\nfn=main\n3 10\nsummary: 1234\ntotals: 1234\n";
        assert_eq!(parse_total(f), Some(1234));
        assert_eq!(parse_total("events: Ir\n"), None);
    }
}
