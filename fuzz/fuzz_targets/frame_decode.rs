//! Every decoder of the wire format on arbitrary bytes: no panic, and what
//! decodes re-encodes to something that decodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quiesce_transports::wire::{
    AuthAck, AuthRequest, Header, Hello, HelloAck, QpAccept, QpConnect,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data) {
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let _ = h.status();
    }
    // The first byte picks the payload decoder; the rest is the payload.
    let Some((&which, payload)) = data.split_first() else {
        return;
    };
    match which % 6 {
        0 => {
            if let Ok(m) = Hello::decode(payload) {
                assert_eq!(Hello::decode(&m.encode().unwrap()).unwrap(), m);
                let _ = m.negotiate();
            }
        }
        1 => {
            if let Ok(m) = HelloAck::decode(payload) {
                if let Ok(enc) = m.encode() {
                    assert_eq!(HelloAck::decode(&enc).unwrap(), m);
                }
            }
        }
        2 => {
            if let Ok(m) = AuthRequest::decode(payload) {
                assert_eq!(AuthRequest::decode(&m.encode().unwrap()).unwrap(), m);
            }
        }
        3 => {
            if let Ok(m) = AuthAck::decode(payload) {
                if let Ok(enc) = m.encode() {
                    assert_eq!(AuthAck::decode(&enc).unwrap(), m);
                }
            }
        }
        4 => {
            if let Ok(m) = QpConnect::decode(payload) {
                assert_eq!(QpConnect::decode(&m.encode()).unwrap(), m);
            }
        }
        _ => {
            if let Ok(m) = QpAccept::decode(payload) {
                assert_eq!(QpAccept::decode(&m.encode().unwrap()).unwrap(), m);
            }
        }
    }
});
