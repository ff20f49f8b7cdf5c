//! Fake targets: just enough of the protocol (hello, auth, answers) to
//! misbehave on cue where a real target cannot be made to.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;

use quiesce_transports::wire::{
    AuthAck, AuthRequest, Descriptor, GrantReceipt, Header, Hello, HelloAck, Opcode, SegmentRef,
    Status, VERSION,
};
use quiesce_transports::{Engine, RemoteSegment, Rights, Token};

use super::{recv_header, send};

/// Listens on loopback. Each connection gets its hello answered (one
/// session, 5, whose key is never checked: a new one for a hello that asks
/// for none, joined otherwise), then `serve(stream, listen address)` on a
/// thread of its own.
pub fn fake_target(
    node: &'static str,
    serve: impl Fn(TcpStream, SocketAddr) + Send + Sync + 'static,
) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let serve = Arc::new(serve);
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let serve = serve.clone();
            std::thread::spawn(move || {
                if hello(&mut s, node).is_some() {
                    serve(s, addr);
                }
            });
        }
    });
    addr
}

fn hello(s: &mut TcpStream, node: &str) -> Option<()> {
    let h = recv_header(s)?;
    let asked = Hello::decode(&payload(s, &h)?).ok()?.session;
    let ack = HelloAck {
        version: VERSION,
        shards: 1,
        nonce: [7; 16],
        node: node.into(),
        session: 5,
        session_key: if asked == 0 { [3; 16] } else { [0; 16] },
    }
    .encode()
    .unwrap();
    let h = Header {
        length: ack.len() as u64,
        ..Header::new(Opcode::HelloAck)
    };
    send(s, &h, &ack);
    Some(())
}

/// The payload of the frame whose header `h` was just read (`None` once
/// the connection ends).
pub fn payload(s: &mut TcpStream, h: &Header) -> Option<Vec<u8>> {
    let mut p = vec![0u8; h.length as usize];
    s.read_exact(&mut p).ok()?;
    Some(p)
}

/// Answers the `Auth` whose payload is `p`, accepting every proof with a
/// 1 GiB read-write segment: named, its id is its name's first byte; by
/// id, that id. `proven` sees each id.
pub fn accept_auth(s: &mut TcpStream, p: &[u8], addr: SocketAddr, mut proven: impl FnMut(u64)) {
    let req = AuthRequest::decode(p).unwrap();
    let results = req
        .proofs
        .iter()
        .map(|(r, ..)| {
            // A segment proven by id again is described as when it was
            // opened (a real target does: another name is another segment).
            let (id, name) = match r {
                SegmentRef::Name(n) => (n.as_bytes()[0] as u64, n.clone()),
                SegmentRef::Id(id) => (*id, name_of(*id)),
                _ => (1, String::new()),
            };
            proven(id);
            if let SegmentRef::Name(n) = r {
                NAMES.lock().unwrap().insert(id, n.clone());
            }
            let d = Descriptor {
                id,
                name,
                len: 1 << 30,
                base: 0x1000,
                rights: Rights::READ | Rights::WRITE,
                endpoints: vec![addr],
                grant: GrantReceipt::NONE,
            };
            (Status::Ok, Some(d))
        })
        .collect();
    let ack = AuthAck { results }.encode().unwrap();
    let h = Header {
        length: ack.len() as u64,
        ..Header::new(Opcode::AuthAck)
    };
    send(s, &h, &ack);
}

/// The name a segment of this id was opened by, by any fake target of the
/// process (ids are the names' first bytes, so each has one name).
fn name_of(id: u64) -> String {
    NAMES.lock().unwrap().get(&id).cloned().unwrap_or_default()
}

static NAMES: std::sync::Mutex<std::collections::BTreeMap<u64, String>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Answers write `h` with `st`: `Ok` applied all of it, anything else
/// nothing.
pub fn answer(s: &mut TcpStream, h: &Header, st: Status) {
    let a = Header {
        op: Opcode::Status,
        flags: st as u8,
        length: if st == Status::Ok { h.length } else { 0 },
        ..*h
    };
    send(s, &a, &[]);
}

/// Acknowledges the fence `h`.
pub fn ack_fence(s: &mut TcpStream, h: &Header) {
    let a = Header {
        op: Opcode::FenceAck,
        offset: 0,
        length: 0,
        ..*h
    };
    send(s, &a, &[]);
}

/// Segment `kv` at `addr`, opened with `token` by an engine that lives as
/// long as the process (the runtime's tasks need it).
pub async fn open(addr: SocketAddr, token: Token) -> RemoteSegment {
    let e = Engine::bind(super::tcp()).unwrap();
    let kv = e
        .connect(addr)
        .await
        .unwrap()
        .open("kv", token)
        .await
        .unwrap();
    std::mem::forget(e);
    kv
}
