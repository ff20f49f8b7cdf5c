//! A hostile target against the initiator's end of a mailbox: the mapping
//! is shared, so whatever the target writes into it the initiator must
//! survive (a typed error or an answer), never panic or hang.

use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;

use super::*;
use common::fake::{accept_auth, fake_target, payload};

/// Where the ring's counters lie in the mailbox (PROTOCOL.md §4.7).
const SUBMITTED_AT: u64 = 0;
const SERVED_AT: u64 = 64;

/// Answers request `h` `Ok`, with `length`.
fn answer_len(s: &mut std::net::TcpStream, h: &Header, length: u64) {
    let a = Header {
        op: Opcode::Status,
        flags: Status::Ok as u8,
        length,
        ..*h
    };
    send(s, &a, &[]);
}

/// A target that attaches, takes the mailbox and, before answering the
/// offer, writes `submitted` and `served` into the ring's counters; it
/// never serves a request.
fn miscounting_target(submitted: u64, served: u64) -> SocketAddr {
    fake_target("miscounting", move |mut s, addr| {
        // The doorbells' ends, held as a target holds them.
        let mut held = Vec::new();
        while let Some(h) = recv_header(&mut s) {
            let Some(p) = payload(&mut s, &h) else { return };
            match h.op {
                Opcode::Auth => accept_auth(&mut s, &p, addr, |_| {}),
                // This test process holds both ends of the connection.
                Opcode::LocalAttach => answer_len(&mut s, &h, u64::from(std::process::id())),
                Opcode::LocalMailbox => {
                    // The initiator's fd numbers are this process's.
                    let take = |at: usize| {
                        let fd = i32::from_le_bytes(p[at..at + 4].try_into().unwrap());
                        // SAFETY: the initiator keeps the files open until
                        // the offer is answered, below.
                        unsafe { BorrowedFd::borrow_raw(fd) }
                            .try_clone_to_owned()
                            .unwrap()
                    };
                    held.extend([take(4), take(8)]);
                    let mem = std::fs::File::from(take(0));
                    mem.write_all_at(&submitted.to_le_bytes(), SUBMITTED_AT)
                        .unwrap();
                    mem.write_all_at(&served.to_le_bytes(), SERVED_AT).unwrap();
                    answer_len(&mut s, &h, 0);
                }
                _ => {}
            }
        }
    })
}

/// The ring's counters start where the initiator left them, zero: a target
/// that wrote counts into them before it answered the offer made the first
/// small request overflow (a panic in a debug build) or wait for a slot, or
/// for an answer the initiator could never see, for ever (release). Now
/// such a count settles the request or kills the connection.
#[test]
fn counters_a_target_wrote_before_the_first_request_neither_panic_nor_hang() {
    for (submitted, served) in [(0, 1), (0, u64::MAX), (5, 3)] {
        let addr = miscounting_target(submitted, served);
        Runtime::new().unwrap().block_on(async {
            let e = initiator(true);
            let peer = e.connect(addr).await.unwrap();
            let kv = peer
                .open("kv", quiesce_transports::Token::random())
                .await
                .unwrap();
            let out = quiesce_runtime::time::timeout(
                Duration::from_secs(3),
                kv.write(0, vec![1u8; 4096], 1),
            )
            .await;
            assert!(
                out.is_ok(),
                "counters ({submitted}, {served}): a small write waited 3 s for a slot"
            );
            assert!(e.stats().mailbox_requests <= 1, "{:?}", e.stats());
        });
    }
}

/// A target whose connection is held by a process of another user is not
/// attached to: that process cannot write this one's memory, so its `Ok` to
/// a local read would mark bytes nobody wrote as read — undefined behaviour
/// for a `Vec`'s spare capacity, stale heap handed out as data. (The check
/// that the named process holds the connection passed, and the initiator
/// took the target's word for the rest.) `Required` fails such a
/// connection; the read never answers `Ok`.
#[test]
fn a_target_of_another_user_is_not_attached_to() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a process as another user");
        return;
    }
    let children = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let forked = children.clone();
    let addr = fake_target("another-user", move |mut s, addr| {
        while let Some(h) = recv_header(&mut s) {
            let Some(p) = payload(&mut s, &h) else { return };
            match h.op {
                Opcode::Auth => accept_auth(&mut s, &p, addr, |_| {}),
                // A child of `nobody` holds this end of the connection.
                Opcode::LocalAttach => {
                    let child = fork_as_nobody();
                    forked.lock().unwrap().push(child);
                    answer_len(&mut s, &h, child as u64);
                }
                // "Read": nothing was written.
                Opcode::ReadLocal => answer_len(&mut s, &h, h.length),
                _ => {}
            }
        }
    });
    let out = Runtime::new().unwrap().block_on(async {
        // One data connection: one attach, one process holding it.
        let e = Engine::bind(EngineConfig {
            local: LocalMode::Required,
            mailbox: false,
            connections_per_peer: 1,
            ..Default::default()
        })
        .unwrap();
        let peer = match e.connect(addr).await {
            Ok(p) => p,
            Err(e) => return Err(e),
        };
        let kv = match peer.open("kv", quiesce_transports::Token::random()).await {
            Ok(kv) => kv,
            Err(e) => return Err(e),
        };
        let read = kv.read(0, 4096, Vec::<u8>::with_capacity(4096), 1);
        match quiesce_runtime::time::timeout(Duration::from_secs(5), read).await {
            Ok((r, buf)) => r.map(|n| (n, buf.len())),
            Err(_) => Ok((0, usize::MAX)), // no answer in 5 s: attached, and stuck
        }
    });
    for child in children.lock().unwrap().drain(..) {
        // SAFETY: kills and reaps a child forked above.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
    }
    assert!(
        out.is_err(),
        "a target of another user attached, and its read answered {out:?}"
    );
}
