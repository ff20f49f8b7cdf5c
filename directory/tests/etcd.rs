//! The etcd directory against a real etcd (Debian's `etcd-server`; each
//! test starts its own on free ports with a temporary data directory).
//! Without an etcd binary the tests say they are skipped, and fail under
//! `CI=true`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use quiesce_directory::{
    Change, Directory, DirectoryError, EtcdDirectory, EtcdOptions, LocalEtcd, NodeRecord,
    SegmentRecord,
};

const TTL: i64 = 2;

#[path = "etcd/slow.rs"]
mod slow;

fn have_etcd() -> bool {
    if !LocalEtcd::available() {
        assert!(
            std::env::var("CI").is_err(),
            "CI=true but no etcd binary (apt-get install etcd-server)"
        );
        eprintln!("skipped: no etcd binary (apt-get install etcd-server)");
        return false;
    }
    true
}

fn etcd() -> Option<LocalEtcd> {
    have_etcd().then(|| LocalEtcd::start().expect("start etcd"))
}

#[test]
fn a_port_taken_before_etcd_binds_is_reported_as_in_use() {
    if !have_etcd() {
        return;
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = free.local_addr().unwrap().port();
    drop(free);
    let ip = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    let err = LocalEtcd::start_with(ip, port, peer, &[])
        .err()
        .expect("etcd started on a port another socket listens on");
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
}

fn directory(e: &LocalEtcd, prefix: &str) -> EtcdDirectory {
    EtcdDirectory::start(EtcdOptions {
        ttl_secs: TTL,
        ..EtcdOptions::from_url(&e.url(prefix)).unwrap()
    })
    .unwrap()
}

fn node(name: &str, port: u16) -> NodeRecord {
    NodeRecord {
        node: name.into(),
        addr: format!("127.0.0.1:{port}").parse().unwrap(),
        fabric: "tcp".into(),
    }
}

fn segment(node: &str, name: &str, id: u64, len: u64) -> SegmentRecord {
    SegmentRecord {
        node: node.into(),
        name: name.into(),
        id,
        base: 0x7f00_0000_0000,
        len,
        read: true,
        write: true,
    }
}

/// Puts `entries` straight into etcd, as a foreign or hostile writer would.
fn put_raw(e: &LocalEtcd, entries: impl IntoIterator<Item = (String, Vec<u8>)>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = etcd_client::Client::connect([e.endpoint()], None)
            .await
            .unwrap();
        for (k, v) in entries {
            c.put(k, v, None).await.unwrap();
        }
    });
}

fn wait_for(rx: &Receiver<Change>, within: Duration, want: impl Fn(&Change) -> bool) -> bool {
    let end = Instant::now() + within;
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(c) if want(&c) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    }
    false
}

/// Run as a child process by `entries_vanish_within_ttl_of_a_kill`:
/// publishes a node and a segment, says `ready`, and waits to be killed.
#[test]
fn child_publisher() {
    let Ok(url) = std::env::var("QZ_DIRECTORY_CHILD") else {
        return;
    };
    let d = EtcdDirectory::start(EtcdOptions {
        ttl_secs: TTL,
        ..EtcdOptions::from_url(&url).unwrap()
    })
    .unwrap();
    d.publish_node(&node("doomed", 7001)).unwrap();
    d.publish_segment(&segment("doomed", "kv", 1, 4096))
        .unwrap();
    d.flush(Duration::from_secs(10)).unwrap();
    println!("ready");
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn entries_appear_on_start_and_vanish_within_ttl_of_a_kill() {
    let Some(e) = etcd() else { return };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_publisher",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("QZ_DIRECTORY_CHILD", e.url("kill"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("ready") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child ended early");
    }
    let watcher = directory(&e, "kill");
    assert_eq!(watcher.resolve("doomed").unwrap(), node("doomed", 7001));
    assert_eq!(watcher.segment("doomed", "kv").unwrap().len, 4096);
    let changes = watcher.subscribe();
    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    let gone = wait_for(&changes, Duration::from_secs(TTL as u64 + 5), |c| {
        *c == Change::NodeGone("doomed".into())
    });
    let took = killed.elapsed();
    assert!(gone, "the dead node's entry never went away");
    assert!(
        took <= Duration::from_secs(TTL as u64 + 1),
        "the entry outlived the kill by {took:?} (TTL {TTL} s)"
    );
    // A fresh initiator (no mirror) finds nothing either: gone from etcd.
    let fresh = directory(&e, "kill");
    assert_eq!(
        fresh.resolve("doomed"),
        Err(DirectoryError::NotFound("doomed".into()))
    );
    assert!(fresh.segment("doomed", "kv").is_err());
    eprintln!("entry gone {took:?} after the kill (TTL {TTL} s)");
}

/// Withdrawing a registration by its id leaves a later registration of
/// the same name alone (the native engine withdraws a lending only once it
/// is taken back, which may be after the name was lent again).
#[test]
fn withdrawing_a_replaced_registration_leaves_the_new_one() {
    let Some(e) = etcd() else { return };
    let target = directory(&e, "replaced");
    target.publish_node(&node("t", 7005)).unwrap();
    target
        .publish_segment(&segment("t", "kv", 1, 4096))
        .unwrap();
    target
        .publish_segment(&segment("t", "kv", 2, 8192))
        .unwrap();
    target.withdraw_segment("t", "kv", Some(1)).unwrap();
    target.flush(Duration::from_secs(10)).unwrap();
    let fresh = directory(&e, "replaced");
    assert_eq!(fresh.segment("t", "kv").map(|s| s.id), Ok(2));
    target.withdraw_segment("t", "kv", Some(2)).unwrap();
    target.flush(Duration::from_secs(10)).unwrap();
    assert!(directory(&e, "replaced").segment("t", "kv").is_err());
}

/// Two processes under one node name (a duplicate, or an old incarnation
/// still up beside a new one): withdrawing what one published deletes only
/// its own record. The older one's withdraw deleted the newer one's
/// record of the same segment name, and the segment vanished from the
/// directory.
#[test]
fn a_withdraw_deletes_only_a_record_this_process_wrote() {
    let Some(e) = etcd() else { return };
    let old = directory(&e, "owner");
    old.publish_segment(&segment("n", "kv", 1, 4096)).unwrap();
    old.flush(Duration::from_secs(10)).unwrap();
    let new = directory(&e, "owner");
    new.publish_node(&node("n", 7100)).unwrap();
    new.publish_segment(&segment("n", "kv", 2, 8192)).unwrap();
    new.flush(Duration::from_secs(10)).unwrap();
    old.withdraw_segment("n", "kv", Some(1)).unwrap();
    old.flush(Duration::from_secs(10)).unwrap();
    let fresh = directory(&e, "owner");
    assert_eq!(
        fresh.segment("n", "kv").map(|s| s.id),
        Ok(2),
        "the newer process's record"
    );
}

/// The newest publisher of a name keeps it: an older process that loses
/// etcd and gets a session again does not write its entries back over one
/// another process wrote since. It did, and whichever of the two got its
/// session back last had the name (the old address served to initiators).
#[test]
fn a_reconnecting_process_does_not_write_back_over_a_newer_publisher() {
    let Some(mut e) = etcd() else { return };
    let old = directory(&e, "newest");
    old.publish_node(&node("n", 7101)).unwrap();
    old.flush(Duration::from_secs(10)).unwrap();
    let new = directory(&e, "newest");
    new.publish_node(&node("n", 7102)).unwrap();
    new.flush(Duration::from_secs(10)).unwrap();
    for round in 0..3 {
        // Both lose their sessions; whichever comes back last is random.
        e.stop();
        std::thread::sleep(Duration::from_millis(300));
        e.restart().unwrap();
        new.flush(Duration::from_secs(15)).unwrap();
        old.flush(Duration::from_secs(15)).unwrap();
        let fresh = directory(&e, "newest");
        assert_eq!(
            fresh.resolve("n").map(|n| n.addr.port()),
            Ok(7102),
            "round {round}: the older process wrote its address back"
        );
    }
}

#[test]
fn a_watching_initiator_picks_up_a_re_registered_segment() {
    let Some(e) = etcd() else { return };
    let target = directory(&e, "rereg");
    target.publish_node(&node("t", 7002)).unwrap();
    target
        .publish_segment(&segment("t", "kv", 1, 4096))
        .unwrap();
    target.flush(Duration::from_secs(10)).unwrap();
    let initiator = directory(&e, "rereg");
    assert_eq!(initiator.segment("t", "kv").unwrap().id, 1);
    let changes = initiator.subscribe();
    target.withdraw_segment("t", "kv", None).unwrap();
    target
        .publish_segment(&segment("t", "kv", 2, 8192))
        .unwrap();
    target.flush(Duration::from_secs(10)).unwrap();
    assert!(
        wait_for(&changes, Duration::from_secs(5), |c| matches!(
            c,
            Change::Segment(s) if s.id == 2
        )),
        "the watch did not deliver the new registration"
    );
    // Served from the mirror: stop etcd and it still answers.
    let mut e = e;
    e.stop();
    let s = initiator.segment("t", "kv").unwrap();
    assert_eq!((s.id, s.len), (2, 8192));
}

#[test]
fn etcd_away_serves_the_cache_types_new_lookups_and_republishes_when_back() {
    let Some(mut e) = etcd() else { return };
    let target = directory(&e, "away");
    target.publish_node(&node("t", 7003)).unwrap();
    target
        .publish_segment(&segment("t", "kv", 1, 4096))
        .unwrap();
    target.flush(Duration::from_secs(10)).unwrap();
    let initiator = directory(&e, "away");
    assert_eq!(initiator.resolve("t").unwrap().addr.port(), 7003);
    let changes = initiator.subscribe();

    // etcd dies with its data: cached peers still resolve, new names get a
    // typed error in bounded time, publishing still queues.
    e.wipe();
    assert!(wait_for(&changes, Duration::from_secs(10), |c| matches!(
        c,
        Change::Unavailable(_)
    )));
    assert_eq!(initiator.resolve("t").unwrap().addr.port(), 7003);
    let asked = Instant::now();
    assert!(matches!(
        initiator.resolve("other"),
        Err(DirectoryError::Unavailable(_))
    ));
    // A segment the mirror lacks, of a cached node: etcd cannot be asked,
    // which is not knowing that it does not exist.
    assert!(matches!(
        initiator.segment("t", "other"),
        Err(DirectoryError::Unavailable(_))
    ));
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    target
        .publish_segment(&segment("t", "late", 2, 512))
        .unwrap();
    assert!(matches!(
        target.flush(Duration::from_millis(300)),
        Err(DirectoryError::Unavailable(_))
    ));

    // etcd back, empty: the target writes everything again, including what
    // it published while etcd was away.
    e.restart().unwrap();
    target.flush(Duration::from_secs(15)).unwrap();
    let fresh = directory(&e, "away");
    assert_eq!(fresh.resolve("t").unwrap().addr.port(), 7003);
    let names: Vec<String> = fresh
        .segments("t")
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["kv", "late"]);
    assert!(wait_for(&changes, Duration::from_secs(15), |c| matches!(
        c,
        Change::Segment(s) if s.name == "late"
    )));
}

#[test]
fn a_closed_directory_takes_its_entries_with_it() {
    let Some(e) = etcd() else { return };
    let target = directory(&e, "close");
    target.publish_node(&node("t", 7004)).unwrap();
    target.flush(Duration::from_secs(10)).unwrap();
    let initiator = directory(&e, "close");
    assert!(initiator.resolve("t").is_ok());
    let changes = initiator.subscribe();
    let closed = Instant::now();
    drop(target);
    assert!(wait_for(&changes, Duration::from_secs(TTL as u64), |c| {
        *c == Change::NodeGone("t".into())
    }));
    assert!(
        closed.elapsed() < Duration::from_secs(1),
        "{:?}",
        closed.elapsed()
    );
}

#[test]
fn bad_names_urls_and_foreign_entries_are_refused() {
    assert!(matches!(
        Directory::open("zookeeper://x"),
        Err(DirectoryError::BadUrl { .. })
    ));
    assert!(matches!(
        Directory::open("etcd://nohost"),
        Err(DirectoryError::BadUrl { .. })
    ));
    assert!(matches!(
        Directory::open("P2PHANDSHAKE"),
        Ok(Directory::P2p)
    ));
    let Some(e) = etcd() else { return };
    let d = directory(&e, "bad");
    assert!(matches!(
        d.publish_node(&node("a/b", 1)),
        Err(DirectoryError::BadName(_))
    ));
    assert!(matches!(d.resolve(""), Err(DirectoryError::BadName(_))));
    // A hostile or foreign writer under the prefix: ignored, never served.
    put_raw(
        &e,
        [
            ("bad/nodes/evil", "addr=not an address\n"),
            ("bad/nodes/ok", "addr=127.0.0.1:9\nfabric=tcp\n"),
            ("bad/segments/ok/kv", "len=\u{1}"),
        ]
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())),
    );
    assert!(matches!(
        d.resolve("evil"),
        Err(DirectoryError::Malformed(_))
    ));
    assert_eq!(d.resolve("ok").unwrap().addr.port(), 9);
    assert!(d.segments("ok").unwrap().is_empty());
    // A value that does not decode, written over a good one, takes the old
    // entry with it (the watch saw it): the old address is not the answer.
    put_raw(
        &e,
        [(
            "bad/nodes/ok".to_string(),
            b"addr=host.example:7000\nfabric=tcp\n".to_vec(),
        )],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while d.resolve("ok").is_ok_and(|r| r.addr.port() == 9) {
        assert!(
            std::time::Instant::now() < deadline,
            "a garbled entry still resolves to the address it replaced"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `node/segment` paths: the node's endpoint and the segment's published
/// descriptor; a missing segment or node is `NotFound` naming the path, a
/// path without a segment is a bad name. P2P paths are `host:port/segment`.
#[test]
fn node_slash_segment_paths_resolve_through_the_directory() {
    let Some(e) = etcd() else { return };
    let target = directory(&e, "paths");
    target.publish_node(&node("prefill-0", 7003)).unwrap();
    target
        .publish_segment(&segment("prefill-0", "kv", 4, 1 << 20))
        .unwrap();
    target.flush(Duration::from_secs(10)).unwrap();
    let dir = Directory::Etcd(directory(&e, "paths"));
    let at = dir.locate("prefill-0/kv").unwrap();
    assert_eq!(at.node.addr, "127.0.0.1:7003".parse().unwrap());
    assert_eq!(at.segment, "kv");
    let rec = at.record.expect("etcd has the descriptor");
    assert_eq!((rec.id, rec.len), (4, 1 << 20));
    assert_eq!(
        dir.locate("prefill-0/ro"),
        Err(DirectoryError::NotFound("prefill-0/ro".into()))
    );
    assert!(matches!(
        dir.locate("nobody/kv"),
        Err(DirectoryError::NotFound(_))
    ));
    assert!(matches!(
        dir.locate("prefill-0"),
        Err(DirectoryError::BadName(_))
    ));
    assert!(matches!(
        dir.locate("prefill-0/"),
        Err(DirectoryError::BadName(_))
    ));
    let p2p = Directory::P2p.locate("127.0.0.1:7004/kv").unwrap();
    assert_eq!(p2p.node.addr, "127.0.0.1:7004".parse().unwrap());
    assert_eq!((p2p.segment.as_str(), p2p.record), ("kv", None));
}

/// A node with thousands of entries comes back after etcd lost them: its
/// session setup writes them in transactions, within its bound. One put at
/// a time took longer than the bound (two operation timeouts), so every
/// attempt timed out and the node stayed gone.
#[test]
fn a_node_with_thousands_of_segments_comes_back_after_etcd_restarts() {
    let Some(mut e) = etcd() else { return };
    const N: u64 = 3000;
    let target = EtcdDirectory::start(EtcdOptions {
        ttl_secs: TTL,
        op_timeout: Duration::from_millis(250),
        ..EtcdOptions::from_url(&e.url("many")).unwrap()
    })
    .unwrap();
    target.publish_node(&node("t", 7006)).unwrap();
    for i in 0..N {
        target
            .publish_segment(&segment("t", &format!("s{i}"), i + 1, 4096))
            .unwrap();
    }
    target.flush(Duration::from_secs(60)).unwrap();
    e.wipe();
    e.restart().unwrap();
    target
        .flush(Duration::from_secs(30))
        .expect("the node's entries are written again");
    let fresh = directory(&e, "many");
    assert_eq!(fresh.segments("t").unwrap().len(), N as usize);
}

/// A directory larger than one etcd reply may be (4 MiB by default in the
/// client) — here from large foreign values under the prefix, some among
/// a node's segments: a node still joins and publishes, and another reads
/// it and its segments.
#[test]
fn a_directory_larger_than_one_reply_is_read_in_pages() {
    let Some(e) = etcd() else { return };
    put_raw(
        &e,
        (0..3).flat_map(|i| {
            ["junk", "segments/a"]
                .map(|under| (format!("big/{under}/zz-{i}"), vec![b'x'; 1_400_000]))
        }),
    );
    let a = directory(&e, "big");
    a.publish_node(&node("a", 7101)).unwrap();
    a.publish_segment(&segment("a", "kv", 1, 4096)).unwrap();
    a.flush(Duration::from_secs(30))
        .expect("published past a directory of 8 MiB");
    let b = directory(&e, "big");
    b.publish_node(&node("b", 7102)).unwrap();
    b.flush(Duration::from_secs(30))
        .expect("a second node joins too");
    assert_eq!(b.resolve("a").unwrap(), node("a", 7101));
    assert_eq!(b.segment("a", "kv").unwrap().id, 1);
}

/// A forked child has a copy of the directory but not its helper thread
/// (Python's `os.fork()` after `initialize`): a lookup there answers
/// `Unavailable` at once instead of waiting for a helper that is not there,
/// and dropping the copy does not wait for that thread either.
#[test]
fn a_forked_childs_copy_answers_at_once_and_drops_without_waiting() {
    let Some(e) = etcd() else { return };
    let d = directory(&e, "fork");
    d.publish_node(&node("p", 7201)).unwrap();
    d.flush(Duration::from_secs(10)).unwrap();
    // SAFETY: the child only calls the directory, drops it and `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let answer = d.resolve("nobody");
        drop(d);
        let code = match answer {
            Err(DirectoryError::Unavailable(_)) => 0,
            _ => 3,
        };
        // SAFETY: ends the child without running the parent's exit code.
        unsafe { libc::_exit(code) };
    }
    assert!(pid > 0, "fork failed");
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        let mut status = 0;
        // SAFETY: waits for our own child without blocking.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break Some(status);
        }
        if Instant::now() >= until {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: reaps it.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let status = status.expect("the child hung in the directory");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's lookup did not answer Unavailable (status {status:#x})"
    );
    assert_eq!(
        d.resolve("p").unwrap(),
        node("p", 7201),
        "the parent's is unharmed"
    );
}
