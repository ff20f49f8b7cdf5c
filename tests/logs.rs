//! The `quiesce` command's logs reach stderr, filtered by `QUIESCE_LOG`:
//! without a subscriber every `tracing` warning the crates emit (a fence out
//! of grace, a leaked batch, a refused peer) would vanish.

use std::process::{Command, Output};

/// A one-round demo of 1 MiB writes: every batch logs "batch quiesced" at
/// INFO, inside its `batch` span.
fn demo(filter: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quiesce"));
    cmd.args(["demo", "--rounds", "1", "--size", "1M"]);
    match filter {
        Some(f) => cmd.env("QUIESCE_LOG", f),
        None => cmd.env_remove("QUIESCE_LOG"),
    };
    let out = cmd.output().expect("the quiesce binary runs");
    assert!(out.status.success(), "demo failed: {out:?}");
    out
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn info_events_reach_stderr_with_their_batch_span() {
    let err = stderr(&demo(Some("info")));
    let line = err
        .lines()
        .find(|l| l.contains("batch quiesced"))
        .unwrap_or_else(|| panic!("no `batch quiesced` event on stderr:\n{err}"));
    assert!(line.contains(" INFO "), "{line}");
    assert!(
        line.contains("batch{id="),
        "the batch span is missing: {line}"
    );
    assert!(
        line.contains("outcome="),
        "the event's fields are missing: {line}"
    );
}

#[test]
fn the_default_filter_is_warn() {
    let err = stderr(&demo(None));
    assert!(
        !err.contains(" INFO "),
        "INFO events under the default filter:\n{err}"
    );
}

#[test]
fn a_filter_that_does_not_parse_is_reported_and_warn_is_used() {
    let err = stderr(&demo(Some("quiesce_batch=loud")));
    assert!(
        err.contains("QUIESCE_LOG=\"quiesce_batch=loud\" is not a filter"),
        "no report of the bad filter:\n{err}"
    );
    assert!(!err.contains(" INFO "), "INFO events:\n{err}");
}
