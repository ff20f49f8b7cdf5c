//! The `quiesce` command's logs reach stderr, filtered by `QUIESCE_LOG`:
//! without a subscriber every `tracing` warning the crates emit (a fence out
//! of grace, a leaked batch, a refused peer) would vanish.

use std::process::{Command, Output};

use quiesce::target_child::TargetChild;

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
    // The demo ran to its verdict, nothing corrupted (its proofs that the
    // count can fail rest on one round each here: one that did not show,
    // exit 1 with NOT SHOWN, is no failure of the logs).
    let stdout = String::from_utf8_lossy(&out.stdout);
    let shown =
        out.status.success() || (out.status.code() == Some(1) && stdout.contains("NOT SHOWN"));
    assert!(
        shown && stdout.contains("corrupted: 0/1"),
        "demo failed: {out:?}"
    );
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

/// A `quiesce target` (the tests' usual `TargetChild`) whose stderr goes to
/// a file, read back by [`stop`].
fn target() -> (TargetChild, std::path::PathBuf) {
    let log = std::env::temp_dir().join(format!(
        "quiesce-logs-test-{}-{:?}.err",
        std::process::id(),
        std::thread::current().id()
    ));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quiesce"));
    cmd.env_remove("QUIESCE_LOG")
        .stderr(std::fs::File::create(&log).unwrap());
    let t = TargetChild::spawn_command(cmd, 4096, false, &[]).expect("the target starts");
    (t, log)
}

/// Stops a [`target`] (it exits when its stdin closes) and returns its stderr.
fn stop((target, log): (TargetChild, std::path::PathBuf)) -> String {
    target.stop(std::time::Duration::from_secs(5));
    let err = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    err
}

/// What a peer can make happen at will is not logged at will: 50
/// connections that break the protocol in a burst give one warning, and
/// once the interval is over a line says how many were not logged, even if
/// nothing follows the burst; the next one after that is logged again.
#[test]
fn a_flood_of_bad_connections_is_one_warning_and_a_count() {
    use std::io::{Read, Write};

    let t = target();
    let addr = t.0.addr;
    let bad = || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(&[0xff; 64]).unwrap();
        // The target answers and closes: read to the end.
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    };
    for _ in 0..50 {
        bad();
    }
    std::thread::sleep(std::time::Duration::from_millis(1500));
    bad();
    let err = stop(t);
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("closing a connection"))
        .collect();
    assert_eq!(warnings.len(), 3, "{err}");
    assert!(warnings[0].contains("suppressed=0"), "{}", warnings[0]);
    assert!(warnings[1].contains("suppressed=49"), "{}", warnings[1]);
    assert!(warnings[2].contains("suppressed=0"), "{}", warnings[2]);
}

/// A proof the target refuses (a wrong token: peers with different
/// secrets) is a warning at the target, naming the peer; the connection the
/// refused initiator keeps until the handshake deadline is then closed
/// without a claim that it broke the protocol.
#[test]
fn a_refused_proof_is_a_warning_and_its_connection_is_no_protocol_break() {
    use quiesce::transports::{Engine, EngineConfig, Token};

    let t = target();
    let addr = t.0.addr;
    quiesce::Runtime::new().unwrap().block_on(async {
        let e = Engine::initiator(EngineConfig::default()).unwrap();
        let peer = e.connect(addr).await.unwrap();
        assert!(peer.open("kv", Token::random()).await.is_err());
        // Past the target's handshake deadline (5 s), connection still open.
        quiesce::runtime::time::sleep(std::time::Duration::from_millis(5500)).await;
        e.shutdown();
    });
    let err = stop(t);
    let refused: Vec<&str> = err.lines().filter(|l| l.contains("refused")).collect();
    assert_eq!(refused.len(), 1, "{err}");
    assert!(refused[0].contains(" WARN "), "{}", refused[0]);
    assert!(refused[0].contains("peer=127.0.0.1:"), "{}", refused[0]);
    assert!(!err.contains("broke the protocol"), "{err}");
}

/// An initiator on the target's host ends as it should (its writes
/// answered, its engine shut down or dropped, its process carrying on): a
/// dropped engine closes its end of the mailbox's doorbell before the
/// target reads the socket's end. A normal close, logged as one: it was a
/// warning of a protocol break at every such peer's end.
#[test]
fn a_local_initiator_that_ends_is_no_protocol_break() {
    use quiesce::transports::{AlignedBuf, Engine, EngineConfig, LocalMode};

    let t = target();
    let (addr, token) = (t.0.addr, t.0.tokens["kv"]);
    for shut_down in [true, false] {
        quiesce::Runtime::new().unwrap().block_on(async {
            let e = Engine::bind(EngineConfig {
                local: LocalMode::Required,
                ..EngineConfig::default()
            })
            .unwrap();
            let peer = e.connect(addr).await.unwrap();
            let kv = peer.open("kv", token).await.unwrap();
            assert!(peer.is_local(), "a target on this host is attached");
            for _ in 0..3 {
                let (res, _) = kv.write(0, AlignedBuf::new(4096), 1).await;
                assert_eq!(res.unwrap(), 4096);
            }
            if shut_down {
                e.shutdown();
            }
        });
    }
    // The target sees the closes before it is stopped.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let err = stop(t);
    assert!(!err.contains("broke the protocol"), "{err}");
}
