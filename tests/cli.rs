//! The `quiesce` command's arguments: what it cannot honour is refused at
//! parse time with a message (exit 2), never accepted and ignored, nor a
//! panic later.

use std::process::Command;

/// Runs `quiesce args…`; its exit code and stderr.
fn quiesce(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_quiesce"))
        .args(args)
        .output()
        .expect("run quiesce");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A size of 0 bytes is no size: `demo --size 0` panicked (exit 101) on the
/// empty batch, and `target --size 0` served an empty segment.
#[test]
fn a_zero_size_is_refused() {
    for args in [
        &["demo", "--size", "0", "--rounds", "1"][..],
        &["target", "--size", "0K"],
        &["bench", "--size", "4K,0"],
    ] {
        let (code, err) = quiesce(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains("at least 1 byte"), "{args:?}: {err}");
    }
}

/// A size past what any buffer can be panicked (exit 101) where the target
/// or the bench allocated it, instead of being refused (a batch of sizes
/// too; just under isize::MAX, the page alignment pushed it over).
#[test]
fn a_size_no_buffer_can_have_is_refused() {
    for args in [
        &["target", "--size", "9000000000G"][..],
        &["target", "--size", "9223372036854775807"],
        &[
            "bench",
            "--size",
            "4K,9000000000G",
            "--connect",
            "127.0.0.1:1",
        ],
        &[
            "bench",
            "--size",
            "4G",
            "--batch",
            "4294967296",
            "--connect",
            "127.0.0.1:1",
        ],
    ] {
        let (code, err) = quiesce(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains("too large"), "{args:?}: {err}");
    }
}

/// Flags a mode does not use are refused with it: `bench --scale` ignored
/// --json (no file written), --driver and --size; `bench --compare` ignored
/// --connect, --size and --impl; `bench --transport rdma` ran quiesce over
/// RDMA whatever --impl said, and ignored the TCP initiators' flags;
/// --busy-poll over TCP and --zc-threshold for raw or tokio did nothing.
#[test]
fn flags_a_bench_mode_would_ignore_are_refused() {
    let json = std::env::temp_dir().join(format!("quiesce-cli-{}.json", std::process::id()));
    let json = json.to_str().unwrap();
    for args in [
        &["bench", "--scale", "--json", json][..],
        &["bench", "--scale", "--driver", "epoll"],
        &["bench", "--scale", "--size", "4K"],
        &["bench", "--compare", "--connect", "127.0.0.1:1"],
        &["bench", "--compare", "--size", "4K"],
        &["bench", "--compare", "--impl", "raw"],
        &["bench", "--transport", "rdma", "--impl", "raw"],
        &["bench", "--transport", "rdma", "--impl", "tokio"],
        &["bench", "--transport", "rdma", "--spin-us", "50"],
        &["bench", "--transport", "rdma", "--driver", "epoll"],
        &["bench", "--transport", "rdma", "--tcp-congestion", "reno"],
        &["bench", "--transport", "rdma", "--zc-threshold", "64K"],
        &["bench", "--busy-poll", "--connect", "127.0.0.1:1"],
        &["bench", "--impl", "raw", "--zc-threshold", "64K"],
    ] {
        let (code, err) = quiesce(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains("cannot be used with"), "{args:?}: {err}");
    }
    assert!(!std::path::Path::new(json).exists());
}

/// Counts of nothing are refused: `bench --iters 0` printed a row of zeros
/// (and under --compare wrote NaN ratios, no JSON, to --json), `--batch 0`
/// ran single writes, `--compare --rounds 0` one round, `soak
/// --connections 0` met its goal at NaN bytes per connection; and the flags
/// only --compare reads were taken without it (clap's `requires` counted
/// the `--compare` flag's default as given).
#[test]
fn counts_of_nothing_and_compare_only_flags_are_refused() {
    for args in [
        &["bench", "--iters", "0", "--connect", "127.0.0.1:1"][..],
        &["soak", "--connections", "0"],
        &["bench", "--batch", "0", "--connect", "127.0.0.1:1"],
        &["bench", "--compare", "--rounds", "0"],
    ] {
        let (code, err) = quiesce(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains("0 is not in 1.."), "{args:?}: {err}");
    }
    for flag in [
        &["--rounds", "2"][..],
        &["--same-process"],
        &["--no-instructions"],
        &["--cases", "write_1m"],
    ] {
        let args = [&["bench", "--connect", "127.0.0.1:1"][..], flag].concat();
        let (code, err) = quiesce(&args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(
            err.contains("can only be used with --compare"),
            "{args:?}: {err}"
        );
    }
}

/// A clean count is evidence only where the count can fail: `demo` with a
/// write too small for its checks passed (exit 0) although every stale-bytes
/// round's write finished before the target was stopped (the revoke tested
/// on none), and it would with an early-return baseline of 0. It must say
/// which proof was not shown, and fail.
#[test]
fn a_demo_whose_checks_tested_nothing_does_not_pass() {
    let out = Command::new(env!("CARGO_BIN_EXE_quiesce"))
        .args(["demo", "--size", "4K", "--rounds", "3"])
        .output()
        .expect("run quiesce");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = |start: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} line: {stdout}"))
    };
    let baseline_clean = line("early-return baseline").ends_with("corrupted 0/3");
    let stale_untested = line("stale bytes (").contains("(6 writes finished before the stop");
    if !baseline_clean && !stale_untested {
        // A stall let the 4 KiB writes be caught by both checks this time.
        eprintln!("both checks were tested at 4 KiB this time: {stdout}");
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    if baseline_clean {
        assert!(
            stdout.contains("NOT SHOWN: the early-return baseline"),
            "{stdout}"
        );
    }
    if stale_untested {
        assert!(
            stdout.contains("NOT SHOWN: every write with the revoke"),
            "{stdout}"
        );
    }
}

/// `quiesce target` on epoll switched its stdin's open file description to
/// non-blocking, and that description is shared with whoever handed it the
/// stdin (a user's terminal, a parent's pipe): the shell's next read got
/// EAGAIN. It must leave the description as it found it.
#[test]
fn the_target_leaves_the_stdin_it_was_given_as_it_found_it() {
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::AsRawFd;
    use std::process::Stdio;

    let (reader, mut writer) = std::io::pipe().expect("pipe");
    let kept = reader.try_clone().expect("dup"); // the same description
    let nonblocking = || {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", kept.as_raw_fd()))
            .expect("fdinfo");
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .expect("flags line");
        u32::from_str_radix(flags.trim(), 8).expect("octal flags") & 0o4000 != 0
    };
    assert!(!nonblocking(), "the pipe starts blocking");
    for driver in ["epoll", "io_uring"] {
        let reader = kept.try_clone().expect("dup");
        let mut child = Command::new(env!("CARGO_BIN_EXE_quiesce"))
            .args(["target", "--size", "4K"])
            .env("QUIESCE_DRIVER", driver)
            .stdin(reader)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the target");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        // Past `listening` the target reads its stdin: a command's answer
        // says it has adopted it.
        while !line.starts_with("listening") {
            line.clear();
            assert!(out.read_line(&mut line).expect("read") > 0, "target ended");
        }
        writer.write_all(b"heap\n").expect("write");
        line.clear();
        out.read_line(&mut line).expect("read");
        assert!(line.starts_with("heap "), "{line}");
        assert!(
            !nonblocking(),
            "{driver}: the target made the shared stdin non-blocking"
        );
        child.kill().expect("kill");
        child.wait().expect("wait");
    }
}

/// A regular file as stdin is read from where its shared offset stands (a
/// script that read its first line before starting the target): it is not
/// opened again, which would start at 0.
#[test]
fn the_target_reads_a_file_on_from_where_it_was_given() {
    use std::io::{Read, Seek, Write};
    let path = std::env::temp_dir().join(format!("quiesce-cli-stdin-{}", std::process::id()));
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(b"skip\nheap\n"))
        .expect("write the commands");
    let mut stdin = std::fs::File::open(&path).expect("open");
    let mut first = [0u8; 5];
    stdin.read_exact(&mut first).expect("the first line");
    assert_eq!(stdin.stream_position().unwrap(), 5);
    let out = Command::new(env!("CARGO_BIN_EXE_quiesce"))
        .args(["target", "--size", "4K"])
        .stdin(stdin)
        .output()
        .expect("run the target");
    let _ = std::fs::remove_file(&path);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let replies: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("listening"))
        .skip(1)
        .collect();
    assert_eq!(replies.len(), 1, "{stdout}");
    assert!(replies[0].starts_with("heap "), "{stdout}");
}

/// A target that leads its own session, with no controlling terminal,
/// reading a terminal as stdin: opening that terminal again made it the
/// target's controlling terminal (no O_NOCTTY), so its hang-up would
/// signal the target. Python's `pty` makes the terminal; `setsid` the
/// session.
#[test]
fn the_target_takes_no_controlling_terminal_from_its_stdin() {
    let script = r#"
import os, pty, subprocess, sys
master, slave = pty.openpty()
p = subprocess.Popen(["setsid", sys.argv[1], "target", "--size", "4K"],
                     stdin=slave, stdout=subprocess.PIPE, env=dict(os.environ, QUIESCE_DRIVER="epoll"))
while not p.stdout.readline().startswith(b"listening"):
    pass
os.write(master, b"heap\n")
assert p.stdout.readline().startswith(b"heap "), "no answer"
with open(f"/proc/{p.pid}/stat") as f:
    tty_nr = int(f.read().rsplit(")", 1)[1].split()[4])
p.kill(); p.wait()
print(tty_nr)
"#;
    let out = Command::new("python3")
        .args(["-c", script, env!("CARGO_BIN_EXE_quiesce")])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.trim(),
        "0",
        "the target took its stdin as its controlling terminal"
    );
}
