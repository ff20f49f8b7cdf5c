//! What a target's answer may count: a write's answer no more bytes than
//! it carried, a read's none, and an answer that counts bytes that landed
//! (fenced, revoked, or a local target that could not reach this process's
//! memory) reports them, summed over a striped write's slices. A target
//! that counts otherwise broke the protocol.

mod common;

use std::net::SocketAddr;

use common::fake::{accept_auth, fake_target, open, payload};
use common::*;
use quiesce_runtime::Runtime;
use quiesce_transports::wire::{Header, Opcode, Status};
use quiesce_transports::{Token, TransferError};

/// A fake target that accepts every proof and answers each write with
/// `answer(header)`: a status and the count it says.
fn answering_writes(
    name: &'static str,
    answer: impl Fn(&Header) -> (Status, u64) + Send + Sync + 'static,
) -> SocketAddr {
    fake_target(name, move |mut s, addr| {
        while let Some(h) = recv_header(&mut s) {
            let Some(p) = payload(&mut s, &h) else { return };
            match h.op {
                Opcode::Auth => accept_auth(&mut s, &p, addr, |_| {}),
                Opcode::Write => {
                    let (st, length) = answer(&h);
                    let a = Header {
                        op: Opcode::Status,
                        flags: st as u8,
                        length,
                        ..h
                    };
                    send(&mut s, &a, &[]);
                }
                _ => {}
            }
        }
    })
}

/// A target's answer may count no more bytes than the write carried: `Ok`
/// says every byte landed, and a partial answer counts those that did. One
/// that answers a 4 KiB write `Ok` for 1 byte, or 2⁶³ landed of a
/// partial one, broke the protocol: the write fails as a bad frame, never
/// `Ok(1)` (a task reported completed with 1 of its 4,096 bytes) nor a sum
/// that overflows over slices.
#[test]
fn a_write_answered_for_another_length_is_a_bad_frame() {
    for (st, length) in [(Status::Ok, 1), (Status::FencedPartial, 1 << 63)] {
        let addr = answering_writes("miscounting", move |_| (st, length));
        Runtime::new().unwrap().block_on(async {
            let kv = open(addr, Token::random()).await;
            for len in [4096, 256 << 10] {
                let (r, _) = kv.write(0, vec![1u8; len], 1).await;
                assert!(
                    matches!(r, Err(TransferError::BadFrame(_))),
                    "{st:?} for {length} bytes of a {len}-byte write: {r:?}"
                );
            }
        });
    }
}

/// A read is refused whole or not at all: a status for it never counts
/// bytes (no `Status` carries a read's data, and fences and revokes do not
/// cut reads). A target that answers one `FencedPartial`, `Revoked` or
/// `Unreachable` with a count broke the protocol: the read fails as a bad
/// frame, never reports 2⁶³ bytes in a 4 KiB buffer nor sums the counts of
/// its slices past 64 bits.
#[test]
fn a_read_refused_with_a_count_is_a_bad_frame() {
    for st in [Status::FencedPartial, Status::Revoked, Status::Unreachable] {
        let addr = fake_target("miscounting-reads", move |mut s, addr| {
            while let Some(h) = recv_header(&mut s) {
                if h.op == Opcode::Read {
                    // (A read's header carries no payload.)
                    let a = Header {
                        op: Opcode::Status,
                        flags: st as u8,
                        length: 1 << 63,
                        ..h
                    };
                    send(&mut s, &a, &[]);
                    continue;
                }
                let Some(p) = payload(&mut s, &h) else { return };
                if h.op == Opcode::Auth {
                    accept_auth(&mut s, &p, addr, |_| {});
                }
            }
        });
        Runtime::new().unwrap().block_on(async {
            let kv = open(addr, Token::random()).await;
            for len in [4096usize, 3 << 20] {
                let (r, _) = kv.read(0, len as u64, vec![0u8; len], 1).await;
                assert!(
                    matches!(r, Err(TransferError::BadFrame(_))),
                    "{st:?} with a count for a {len}-byte read: {r:?}"
                );
            }
        });
    }
}

/// A local-transport target that could not reach the initiator's memory
/// after some bytes answers `Unreachable` with their count: the write's
/// error carries it (summed over a striped write's slices), as a fenced or
/// revoked write's does. It was a message (`RemoteAccess`), and the task's
/// report said 0 bytes landed, with the target's answer in.
#[test]
fn a_write_the_target_could_not_finish_reaching_reports_what_landed() {
    let addr = answering_writes("unreaching", |h| (Status::Unreachable, h.length / 2));
    Runtime::new().unwrap().block_on(async {
        let kv = open(addr, Token::random()).await;
        for len in [4096u64, 3 << 20] {
            let (r, _) = kv.write(0, vec![1u8; len as usize], 1).await;
            let e = r.expect_err("answered Unreachable");
            assert_eq!(e.landed(), Some(len / 2), "{len}-byte write: {e:?}");
            assert!(e.settles_remote(), "{e:?}");
        }
    });
}

/// A striped write whose first slice finds no segment and whose others the
/// target could not finish reaching: what landed is the unreached slices'
/// bytes, and the error says so. It was reported as a revoke after them (the
/// "no such segment" kept, turned into `Revoked` by the landed count).
#[test]
fn a_striped_write_partly_unreached_is_not_reported_revoked() {
    let addr = answering_writes("unreaching-striped", |h| match h.offset {
        0 => (Status::NoSuchSegment, 0),
        _ => (Status::Unreachable, h.length / 2),
    });
    Runtime::new().unwrap().block_on(async {
        let kv = open(addr, Token::random()).await;
        let (r, _) = kv.write(0, vec![1u8; 3 << 20], 1).await;
        let e = r.expect_err("refused and unreached");
        assert!(
            matches!(e, TransferError::Unreachable { landed } if landed > 0),
            "{e:?}"
        );
    });
}

/// An `AuthAck` for one proof must carry one answer: one with two broke the
/// protocol, and the open fails as a bad frame on a connection it kills
/// (the next open connects afresh). It was `OpenRefused` — "wrong token or
/// no such segment" — on a connection kept up.
#[test]
fn an_auth_ack_with_the_wrong_count_is_a_bad_frame() {
    use quiesce_transports::wire::{AuthAck, Descriptor, GrantReceipt};
    use quiesce_transports::{Engine, Rights};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let conns = Arc::new(AtomicUsize::new(0));
    let seen = conns.clone();
    let addr = fake_target("two-answers", move |mut s, addr| {
        seen.fetch_add(1, Ordering::SeqCst);
        while let Some(h) = recv_header(&mut s) {
            if payload(&mut s, &h).is_none() {
                return;
            }
            if h.op != Opcode::Auth {
                continue;
            }
            let d = Descriptor {
                id: 1,
                name: "kv".into(),
                len: 4096,
                base: 0x1000,
                rights: Rights::READ | Rights::WRITE,
                endpoints: vec![addr],
                grant: GrantReceipt::NONE,
            };
            let ack = AuthAck {
                results: vec![(Status::Ok, Some(d.clone())), (Status::Ok, Some(d))],
            }
            .encode()
            .unwrap();
            let a = Header {
                length: ack.len() as u64,
                ..Header::new(Opcode::AuthAck)
            };
            send(&mut s, &a, &ack);
        }
    });
    Runtime::new().unwrap().block_on(async {
        let e = Engine::bind(tcp()).unwrap();
        let peer = e.connect(addr).await.unwrap();
        let r = peer.open("kv", Token::random()).await.err();
        assert!(matches!(r, Some(TransferError::BadFrame(_))), "{r:?}");
        let before = conns.load(Ordering::SeqCst);
        let _ = peer.open("kv", Token::random()).await;
        assert!(
            conns.load(Ordering::SeqCst) > before,
            "the connection that broke the protocol was kept"
        );
        e.shutdown();
    });
}
