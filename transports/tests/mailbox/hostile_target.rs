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

/// A target that attaches, takes the mailbox and, before answering the
/// offer, writes `submitted` and `served` into the ring's counters; it
/// never serves a request.
fn miscounting_target(submitted: u64, served: u64) -> SocketAddr {
    fake_target("miscounting", move |mut s, addr| {
        // The doorbells' ends, held as a target holds them.
        let mut held = Vec::new();
        while let Some(h) = recv_header(&mut s) {
            let Some(p) = payload(&mut s, &h) else { return };
            let answer_len = |s: &mut std::net::TcpStream, length: u64| {
                let a = Header {
                    op: Opcode::Status,
                    flags: Status::Ok as u8,
                    length,
                    ..h
                };
                send(s, &a, &[]);
            };
            match h.op {
                Opcode::Auth => accept_auth(&mut s, &p, addr, |_| {}),
                // This test process holds both ends of the connection.
                Opcode::LocalAttach => answer_len(&mut s, u64::from(std::process::id())),
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
                    answer_len(&mut s, 0);
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
