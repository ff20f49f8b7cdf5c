//! Doorbells: a jammed, flooded, closed or foreign doorbell, or a served
//! count the initiator moved, never blocks the target or keeps it
//! waking; and who may attach at all.

use super::*;

/// Makes the target's end `fd` of a doorbell block: full, then blocking —
/// what a hostile initiator, which shares the file, can do to the doorbell
/// the target rings.
fn jam(fd: i32) {
    // SAFETY: fcntl and write on an fd this test holds; 8 bytes from a live u64.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        assert!(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0);
        let v = u64::MAX - 1;
        while libc::write(fd, (&v as *const u64).cast(), 8) == 8 {}
        assert!(libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0);
    }
}

/// Another peer's 512-byte write to `kv` at `addr`, from a thread of its
/// own: its result comes on the channel (never, if the target's reactor is
/// held).
fn another_peer_writes(
    addr: std::net::SocketAddr,
    token: quiesce_transports::Token,
) -> std::sync::mpsc::Receiver<Result<u64, String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        Runtime::new().unwrap().block_on(async {
            let engine = initiator(false);
            let peer = engine.connect(addr).await.unwrap();
            let kv = peer.open("kv", token).await.unwrap();
            let (res, _) = kv.write(4096, pattern(512, 9), 9).await;
            let _ = tx.send(res.map_err(|e| e.to_string()));
            engine.shutdown();
        })
    });
    rx
}

/// The doorbell the target rings is a file the initiator made. An
/// initiator that jams it (fills it, then clears `O_NONBLOCK` on it) and
/// says it sleeps must not block the target's reactor when it rings: the
/// request is answered, and every other peer is served.
#[test]
fn a_jammed_doorbell_does_not_block_the_target() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let mut hand = HandMailbox::offer(&mut c);
    jam(hand.named[1].as_raw_fd());
    // "Asleep": the target rings after it serves.
    hand.mem.word(192).store(1, Ordering::Relaxed);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (st, applied) = hand.request(1, kv.id, 0, &pattern(512, 4), 512);
        done_tx.send((st, applied, hand)).unwrap();
    });
    let answered = done_rx.recv_timeout(Duration::from_secs(10));
    // The target's reactor still runs: another peer is served.
    let served = another_peer_writes(target.addr, kv.token).recv_timeout(Duration::from_secs(10));
    if answered.is_err() || served.is_err() {
        // A blocked target would never stop: leave its thread behind.
        std::mem::forget(target);
    }
    let (st, applied, _hand) = answered.expect("the request was never answered");
    assert_eq!((st, applied), (Status::Ok as u64, 512));
    let res = served.expect("the target's reactor is blocked: another peer was never served");
    assert_eq!(res.unwrap(), 512);
}

/// An initiator that floods the doorbell it rings the target with (bytes
/// faster than 64-byte receives drain them) holds nothing of the target:
/// its reactor drains a bounded amount per wake and serves every other
/// peer meanwhile (the drain looped while a receive came back full, for as
/// long as the flood lasted).
#[test]
fn a_flooded_doorbell_does_not_hold_the_target() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let hand = HandMailbox::offer(&mut c);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        let fd = hand.to_target.fd();
        std::thread::spawn(move || {
            let bytes = vec![1u8; 64 << 10];
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(20) {
                // SAFETY: sends from a live buffer on an fd `hand` keeps open.
                unsafe {
                    libc::send(
                        fd,
                        bytes.as_ptr().cast(),
                        bytes.len(),
                        libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                    )
                };
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let served = another_peer_writes(target.addr, kv.token).recv_timeout(Duration::from_secs(10));
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    drop(hand);
    let res = served.expect("the target's reactor is held: another peer was never served");
    assert_eq!(res.unwrap(), 512);
}

/// An initiator that closes its ends of the doorbells harms only its own
/// connection. Ringing one whose other end is gone raises no `SIGPIPE` (a
/// host that did not ignore it died of it with pipe doorbells); a doorbell
/// whose ringer is gone stays readable for good, so the target closes the
/// connection rather than wake for it again and again.
#[test]
fn closed_doorbells_neither_signal_nor_keep_the_target_waking() {
    // As a C host that never ignored SIGPIPE. (This binary's other tests
    // send with MSG_NOSIGNAL, as the engine does.)
    // SAFETY: sets a signal's disposition; no handler runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let mut hand = HandMailbox::offer(&mut c);
    // The initiator's own end gone (closed off this thread: until the
    // end the target rings hangs up), and it "sleeps": the target rings it.
    hand.to_initiator = None;
    let hung_up = |fd: i32| {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one live pollfd; no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    };
    let t0 = Instant::now();
    while !hung_up(hand.named[1].as_raw_fd()) {
        assert!(t0.elapsed() < Duration::from_secs(5), "the end stayed open");
        std::thread::sleep(Duration::from_millis(1));
    }
    hand.mem.word(192).store(1, Ordering::Relaxed);
    let (st, applied) = hand.request(1, kv.id, 0, &pattern(512, 4), 512);
    assert_eq!(
        (st, applied),
        (Status::Ok as u64, 512),
        "the target died or refused"
    );
    // The end that rings the target gone: the target closes the connection.
    drop(hand);
    let t0 = Instant::now();
    assert!(c.recv().is_none(), "the connection stayed open");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // Everyone else is served as before.
    others_are_served(&target, kv.token);
}

/// A loopback TCP connection whose last close blocks its closer for
/// `linger`: its peer (returned, to keep open) never reads, so its send
/// queue holds bytes it cannot send, and `SO_LINGER` makes close wait.
fn lingering_socket(linger: Duration) -> (std::net::TcpStream, std::net::TcpStream) {
    use std::io::Write;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut stuck = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (reader, _) = listener.accept().unwrap();
    stuck.set_nonblocking(true).unwrap();
    let chunk = vec![7u8; 64 << 10];
    while stuck.write(&chunk).is_ok() {}
    let l = libc::linger {
        l_onoff: 1,
        l_linger: linger.as_secs() as libc::c_int,
    };
    // SAFETY: sets an option from a live linger struct of the given size.
    let r = unsafe {
        libc::setsockopt(
            stuck.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0);
    (stuck, reader)
}

/// Bytes waiting in the socket `fd`.
fn queued(fd: i32) -> libc::c_int {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int into a live one.
    assert_eq!(unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) }, 0);
    n
}

/// Sends one ring byte through `bell` with `file` attached (`SCM_RIGHTS`).
fn ring_with_a_file(bell: i32, file: i32) {
    let mut byte = [1u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: a zeroed msghdr is valid; every pointer set below is live
    // for the sendmsg, and the one cmsg fits in `control`.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), file);
        libc::sendmsg(bell, &msg, libc::MSG_NOSIGNAL)
    };
    assert_eq!(sent, 1, "{}", std::io::Error::last_os_error());
}

/// A doorbell is an `AF_UNIX` socket, which carries files too. An
/// initiator that rang with a file attached (`SCM_RIGHTS`) had the target's
/// drain close it on the reactor, as a receive without room for files
/// does — and the last close of a TCP socket lingering over bytes it
/// cannot send blocks for the linger time: every peer of the shard waited
/// (on epoll for all of it; on io_uring until the next completion's task
/// work cut the wait short). Files that come through a doorbell are now
/// closed off the reactor, and the connection that sent them is closed; so
/// are files still queued in a doorbell when the connection ends.
#[test]
fn a_file_sent_through_a_doorbell_does_not_hold_the_target() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let served = |case: &str| {
        let res = another_peer_writes(target.addr, kv.token)
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("{case}: the target's reactor is held"));
        assert_eq!(res.unwrap(), 512, "{case}");
    };

    // A ring with a file: drained at once.
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let hand = HandMailbox::offer(&mut c);
    let (stuck, _reader) = lingering_socket(Duration::from_secs(60));
    ring_with_a_file(hand.to_target.fd(), stuck.as_raw_fd());
    drop(stuck);
    // Until the target took the ring (and the file).
    let t0 = Instant::now();
    while queued(hand.named[0].as_raw_fd()) > 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    served("a ring with a file");
    let mut b = [0u8; 64];
    assert!(
        matches!(c.s.read(&mut b), Ok(0)),
        "the connection that sent a file stayed open"
    );
    drop(hand);

    // A file queued in the doorbell the target rings, which it never
    // reads: closed with the target's end when the connection ends.
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let hand = HandMailbox::offer(&mut c);
    let (stuck, _reader2) = lingering_socket(Duration::from_secs(60));
    let to_initiator = hand.to_initiator.as_ref().unwrap();
    ring_with_a_file(to_initiator.fd(), stuck.as_raw_fd());
    drop(stuck);
    let HandMailbox {
        named: [_target_end, initiator_end],
        ..
    } = hand;
    drop(initiator_end); // the target's copy is the last
    drop(c);
    served("a file queued at the end");
    others_are_served(&target, kv.token);
}

/// CPU time (s) each target shard thread of the process used so far, by
/// thread id.
fn shard_cpu() -> std::collections::HashMap<String, f64> {
    let tick = 100.0; // USER_HZ
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            comm.starts_with("target-shard").then_some(())?;
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            // After the ")" closing comm: state is field 3, utime 14, stime 15.
            let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let cpu = (f[11].parse::<f64>().ok()? + f[12].parse::<f64>().ok()?) / tick;
            Some((dir.file_name()?.to_string_lossy().into_owned(), cpu))
        })
        .collect()
}

/// The most CPU one target shard thread used over an idle second (the
/// tests alongside serve a request or two in it, not a second's worth).
fn idle_cpu() -> f64 {
    let before = shard_cpu();
    std::thread::sleep(Duration::from_secs(1));
    shard_cpu()
        .into_iter()
        .map(|(tid, cpu)| cpu - before.get(&tid).copied().unwrap_or(cpu))
        .fold(0.0, f64::max)
}

/// Nothing an initiator writes in the shared mapping makes the target
/// spin: a `served` count it moved past `submitted` woke the serve loop at
/// every reactor turn for nothing (the reactor compared the two words of
/// the mapping, the serve loop its own count), one core at 100 % for as
/// long as the connection lived.
#[test]
fn a_served_count_moved_by_the_initiator_does_not_make_the_target_spin() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let hand = HandMailbox::offer(&mut c);
    hand.mem.word(64).store(1, Ordering::Release);
    hand.to_target.ring();
    let used = idle_cpu();
    assert!(
        used < 0.5,
        "the target's shard used {used:.2} s of one idle second"
    );
    drop(hand);
}

/// A doorbell must be a connected socket (PROTOCOL.md §4.7): one that was
/// never connected polls as hung up for ever, and the target, watching it,
/// never blocked again.
#[test]
fn an_unconnected_doorbell_is_refused() {
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 1 << 20, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    let (_to_target, _to_initiator, named) = hand_bells();
    // SAFETY: a plain socket(2) call; the fd is owned below.
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(raw >= 0);
    // SAFETY: `raw` is a new fd nothing else owns.
    let unconnected = unsafe { OwnedFd::from_raw_fd(raw) };
    let mem = hand_memory();
    let st = offer(
        &mut c,
        mem.fd(),
        unconnected.as_raw_fd(),
        named[1].as_raw_fd(),
    );
    if st == Status::Ok {
        let used = idle_cpu();
        panic!("an unconnected doorbell was accepted (the target's shard then used {used:.2} s of one idle second)");
    }
    assert_eq!(st, Status::Forbidden);
}

/// The target copies between its segments and an attached process with
/// its own credentials, for as long as the connection lives: a process of
/// another user must not attach. Through it (its child that keeps the
/// socket, once it exec'd a setuid program), a target with more rights
/// than the initiator — root, as in many containers — would read and write
/// memory the initiator's user may not. Only a process of the target's own
/// user attaches; others stay on TCP.
#[test]
fn a_process_of_another_user_does_not_attach() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // CI runs as root: a skip there would pass unseen.
        assert!(std::env::var("CI").is_err(), "CI=true but not root");
        eprintln!("skipped: needs root to run a process as another user");
        return;
    }
    let target = ShardTarget::start(EngineConfig::default(), &[("kv", 4096, RW)]);
    let kv = target.seg("kv").clone();
    let mut c = RawClient::connect(target.addr);
    assert_eq!(c.auth_status(kv.id, kv.token), Status::Ok);
    // A fork holds the socket and the nonce at the same address; it turns
    // into user `nobody` and waits.
    let child = fork_as_nobody();
    let st = attach_as(&mut c, child as u32);
    // SAFETY: kills and reaps the child forked above.
    unsafe {
        libc::kill(child, libc::SIGKILL);
        libc::waitpid(child, std::ptr::null_mut(), 0);
    }
    assert_eq!(st, Status::Forbidden, "a process of another user attached");
}
