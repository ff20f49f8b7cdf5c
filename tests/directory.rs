//! `quiesce target --directory etcd://…` in its own process: an initiator
//! finds it and its segments by name, writes through the address the
//! directory gave, and sees the entries go within the lease's TTL once the
//! target is killed. Needs Debian's etcd-server (`.ci/run` installs it;
//! elsewhere the test says it is skipped, and fails under `CI=true`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use quiesce::directory::{Change, Directory, LocalEtcd};
use quiesce::runtime::Runtime;
use quiesce::target_child::TargetChild;
use quiesce::transports::{Engine, EngineConfig};

const TTL: u64 = 2;

/// A private etcd, where Debian's etcd-server is installed.
fn etcd() -> Option<LocalEtcd> {
    if !LocalEtcd::available() {
        assert!(std::env::var("CI").is_err(), "CI=true but no etcd binary");
        eprintln!("skipped: no etcd binary (apt-get install etcd-server)");
        return None;
    }
    Some(LocalEtcd::start().unwrap())
}

#[test]
fn a_target_found_through_etcd_serves_writes_and_vanishes_when_killed() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url("cli");
    let mut cmd = Command::new(Path::new(env!("CARGO_BIN_EXE_quiesce")));
    cmd.env("QUIESCE_DIRECTORY_TTL", TTL.to_string());
    let target = TargetChild::spawn_command(
        cmd,
        1 << 20,
        false,
        &["--directory", &url, "--node", "prefill-0"],
    )
    .unwrap();

    let dir = Directory::open(&url).unwrap();
    let node = dir.resolve("prefill-0").unwrap();
    assert_eq!(node.addr, target.addr);
    let segs = dir.segments("prefill-0").unwrap();
    let kv = segs.iter().find(|s| s.name == "kv").expect("kv published");
    assert_eq!((kv.id, kv.len), (target.ids["kv"], 1 << 20));
    assert!(kv.read && kv.write);
    let ro = segs.iter().find(|s| s.name == "ro").expect("ro published");
    assert!(ro.read && !ro.write);

    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(EngineConfig::default()).unwrap();
        let peer = e.connect(node.addr).await.unwrap();
        let seg = peer.open("kv", target.tokens["kv"]).await.unwrap();
        let (r, _) = seg.write(0, vec![5u8; 4096], 1).await;
        assert_eq!(r.unwrap(), 4096);
        e.shutdown();
    });

    let Directory::Etcd(watching) = &dir else {
        panic!("an etcd:// URL opens the etcd backend")
    };
    let changes = watching.subscribe();
    target.signal(libc::SIGKILL).unwrap();
    let killed = Instant::now();
    let mut gone = false;
    while killed.elapsed() < Duration::from_secs(TTL + 5) {
        if let Ok(Change::NodeGone(n)) = changes.recv_timeout(Duration::from_millis(100)) {
            gone = n == "prefill-0";
            if gone {
                break;
            }
        }
    }
    let took = killed.elapsed();
    assert!(gone, "the killed target's entry never went away");
    assert!(took <= Duration::from_secs(TTL + 1), "{took:?}");
    drop(target);
    eprintln!("entry gone {took:?} after SIGKILL (TTL {TTL} s)");
}

/// `quiesce demo --directory`: the demo's target publishes itself, the
/// demo finds its `kv` and `ro` by their `node/segment` paths (checking the
/// published ids against the target's own) and runs the seed scenario
/// through the address the directory gave — 0 corrupted.
#[test]
fn the_demo_finds_its_target_through_etcd() {
    let Some(etcd) = etcd() else { return };
    let url = etcd.url("demo");
    let out = Command::new(Path::new(env!("CARGO_BIN_EXE_quiesce")))
        .args(["demo", "--rounds", "3", "--size", "8M", "--directory", &url])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Ran to its verdict (a proof that did not show on its few rounds, exit
    // 1 with NOT SHOWN, is not this test's concern).
    let shown =
        out.status.success() || (out.status.code() == Some(1) && stdout.contains("NOT SHOWN"));
    assert!(shown, "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for name in ["kv", "ro"] {
        assert!(
            stdout.contains(&format!("/{name} through {url}")),
            "{name} not found through the directory:\n{stdout}"
        );
    }
    assert!(stdout.contains("corrupted: 0/3"), "{stdout}");
}
