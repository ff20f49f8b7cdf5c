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

/// Flags a mode does not use are refused with it: `bench --scale` ignored
/// --json (no file written), --driver and --size; `bench --compare` ignored
/// --connect, --size and --impl.
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
    ] {
        let (code, err) = quiesce(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains("cannot be used with"), "{args:?}: {err}");
    }
    assert!(!std::path::Path::new(json).exists());
}
