//! `TCP_CONGESTION` on the runtime's sockets: set, read back, passed from a
//! listener to what it accepts, and bad names refused with a typed error.

mod common;

use std::io::ErrorKind;

use common::*;
use quiesce_runtime::net::{check_tcp_congestion, TcpListener, TcpStream};

/// The system's default algorithm and another one this kernel has (`reno`
/// is always built in), so that a setting that did nothing is seen.
fn default_and_other() -> (String, String) {
    let read = |p: &str| std::fs::read_to_string(p).unwrap().trim().to_string();
    let default = read("/proc/sys/net/ipv4/tcp_congestion_control");
    let available = read("/proc/sys/net/ipv4/tcp_available_congestion_control");
    let other = available
        .split_whitespace()
        .find(|n| *n != default)
        .expect("a second congestion-control algorithm (reno is always built in)")
        .to_string();
    (default, other)
}

#[test]
fn congestion_is_set_read_back_and_passed_to_accepted_connections() {
    let (default, other) = default_and_other();
    rt().block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_congestion(&other).unwrap();
        let addr = l.local_addr().unwrap();
        let client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = l.accept().await.unwrap();
        assert_eq!(
            accepted.congestion().unwrap(),
            other,
            "accepted from the listener"
        );
        assert_eq!(
            client.congestion().unwrap(),
            default,
            "untouched: the system's"
        );
        client.set_congestion(&other).unwrap();
        assert_eq!(client.congestion().unwrap(), other);
    });
}

#[test]
fn a_bad_congestion_name_is_a_typed_error() {
    assert_eq!(
        check_tcp_congestion("no-such-cc").unwrap_err().kind(),
        ErrorKind::NotFound
    );
    for bad in ["", "sixteen-bytes-ab", "nul\0"] {
        let e = check_tcp_congestion(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{bad:?}: {e}");
    }
    check_tcp_congestion("reno").unwrap();
}
