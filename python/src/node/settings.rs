//! What a node's settings come from: the environment Mooncake's callers
//! set (`MC_TRANSFER_TIMEOUT`), quiesce's own variables, and the address
//! `initialize` is given.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use quiesce_batch::{BatchOptions, FailurePolicy};
use quiesce_runtime::time::LONGEST_WAIT;
use quiesce_transports::LocalMode;

/// The environment variable holding the cluster's shared secret (at least
/// 16 bytes; the same on every peer).
pub const SECRET_ENV: &str = "QUIESCE_SECRET";
/// Set to `1` to run without a secret: any peer that can connect may read
/// and write every registered range. Only on a trusted network.
pub const OPEN_CLUSTER_ENV: &str = "QUIESCE_OPEN_CLUSTER";
/// What an open cluster derives its token from (public by design).
const OPEN_CLUSTER_SECRET: &[u8] = b"quiesce open cluster: whoever connects may read and write";
/// The label every range's token is derived under: Mooncake's callers never
/// see segment names, so all of a node's ranges share one token.
pub(super) const TOKEN_LABEL: &str = "mooncake-node";

/// How long `initialize` waits for the metadata server to hold this node.
pub(super) const PUBLISH_WAIT: Duration = Duration::from_secs(10);

/// The cluster's shared secret: `explicit` (16+ bytes), an open cluster's
/// public one if `open_cluster`, else from the environment.
pub(crate) fn secret(explicit: Option<&[u8]>, open_cluster: bool) -> Result<Vec<u8>, String> {
    if let Some(s) = explicit {
        if s.len() < 16 {
            return Err("the secret must hold at least 16 bytes".into());
        }
        return Ok(s.to_vec());
    }
    if open_cluster {
        tracing::warn!(
            "open cluster: any peer that can connect may read and write registered memory"
        );
        return Ok(OPEN_CLUSTER_SECRET.to_vec());
    }
    if let Some(s) = std::env::var_os(SECRET_ENV) {
        let s = s.into_encoded_bytes();
        if s.len() < 16 {
            return Err(format!("{SECRET_ENV} must hold at least 16 bytes"));
        }
        return Ok(s);
    }
    if std::env::var(OPEN_CLUSTER_ENV).is_ok_and(|v| v == "1") {
        return secret(None, true);
    }
    Err(format!(
        "remote access needs a shared secret: set {SECRET_ENV} (16+ bytes, the same on every \
         peer), or {OPEN_CLUSTER_ENV}=1 to let any peer that can connect read and write (trusted \
         networks only)"
    ))
}

/// Whether peers on this host are reached by cross-memory attach:
/// `QUIESCE_LOCAL` = `auto` (the default), `off` (TCP only, both roles) or
/// `required` (fail a connection that cannot attach).
pub(crate) fn local_mode() -> LocalMode {
    match std::env::var("QUIESCE_LOCAL").as_deref() {
        Ok("off") => LocalMode::Off,
        Ok("required") => LocalMode::Required,
        Ok("auto") | Err(_) => LocalMode::Auto,
        Ok(other) => {
            tracing::warn!("QUIESCE_LOCAL={other:?} is not auto, off or required; using auto");
            LocalMode::Auto
        }
    }
}

/// The TCP congestion control of the engine's connections
/// (`EngineConfig::tcp_congestion`): `QUIESCE_TCP_CONGESTION` (`cubic`,
/// `reno`, `bbr`, …), checked here so a name the kernel lacks is reported
/// with the variable that gave it; unset or empty, the system's default.
pub(crate) fn tcp_congestion() -> Result<Option<String>, String> {
    match std::env::var("QUIESCE_TCP_CONGESTION") {
        Ok(name) if !name.is_empty() => {
            quiesce_runtime::net::check_tcp_congestion(&name)
                .map_err(|e| format!("QUIESCE_TCP_CONGESTION: {e}"))?;
            Ok(Some(name))
        }
        _ => Ok(None),
    }
}

/// A timeout of `timeout` seconds from Python: none if not positive (or
/// NaN), inf and huge values [`LONGEST_WAIT`].
pub(crate) fn seconds(timeout: f64) -> Duration {
    if timeout.is_nan() || timeout <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(timeout)
        .unwrap_or(LONGEST_WAIT)
        .min(LONGEST_WAIT)
}

/// The variable that makes a sync call wait for a batch whose completion is
/// unknown before it answers.
pub(crate) const QUIESCE_WAIT_UNKNOWN: &str = "QUIESCE_WAIT_UNKNOWN";

/// How long a sync call that would answer -2 (or `get_batch_transfer_status`
/// on such a batch) first waits for its batch to drain:
/// [`QUIESCE_WAIT_UNKNOWN`] seconds, 0 (answer -2 at once) if unset.
/// vLLM and SGLang take -2 for a failure and reuse the memory at once,
/// never calling `wait_for_quiescence()`; with a wait, the call answers the
/// drained outcome instead, after which nothing touches the memory.
pub(super) fn wait_unknown() -> Duration {
    let Ok(v) = std::env::var(QUIESCE_WAIT_UNKNOWN) else {
        return Duration::ZERO;
    };
    match v
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
    {
        Some(d) => d,
        None => {
            tracing::warn!("{QUIESCE_WAIT_UNKNOWN}={v:?} is not a number of seconds; not waiting");
            Duration::ZERO
        }
    }
}

/// How long the engine and its callers busy-poll before they block:
/// `QUIESCE_SPIN_US` microseconds (0: never), else the sync engine's default.
pub(crate) fn spin() -> Duration {
    std::env::var("QUIESCE_SPIN_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(quiesce_batch::sync::DEFAULT_SPIN, Duration::from_micros)
}

/// Fail-fast, as Mooncake returns at a batch's first failure — but after
/// fencing the rest, so the -1 is safe. Mooncake's `MC_TRANSFER_TIMEOUT`
/// (seconds, at least 5; 30 by default: [`transfer_timeout`]) is each
/// batch's deadline, plus a nanosecond per byte ([`Node::options_for`]).
pub(super) fn options() -> BatchOptions {
    let secs = transfer_timeout(std::env::var("MC_TRANSFER_TIMEOUT").ok().as_deref());
    BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_secs(secs))
}

/// Seconds of `MC_TRANSFER_TIMEOUT`'s value `v` (unset: 30), read as
/// Mooncake reads it — `std::max(5, atoi(v))`: the number the text starts
/// with (after blanks, with its sign), 0 if none, at least 5, and no upper
/// bound but an `int`'s (where `atoi` would wrap, the largest).
fn transfer_timeout(v: Option<&str>) -> u64 {
    let Some(v) = v else { return 30 };
    let v = v.trim_start();
    let (negative, digits) = match v.as_bytes().first() {
        Some(b'-') => (true, &v[1..]),
        Some(b'+') => (false, &v[1..]),
        _ => (false, v),
    };
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    let n = match digits[..end].parse::<u64>() {
        Ok(n) if !negative => n.min(i32::MAX as u64),
        // Too many digits for any integer: past an int either way.
        Err(_) if !negative && end > 0 => i32::MAX as u64,
        _ => 0,
    };
    n.max(5)
}

pub(crate) fn listen_addr(local_hostname: &str) -> Result<SocketAddr, String> {
    let bad_port = || format!("bad port in {local_hostname:?}");
    // "[v6]:port", "[v6]", "host:port", "host", or a bare IPv6 address.
    let (host, port) = if let Some(rest) = local_hostname.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("no ']' in {local_hostname:?}"))?;
        let port = match after {
            "" => 0,
            p => p
                .strip_prefix(':')
                .and_then(|p| p.parse::<u16>().ok())
                .ok_or_else(bad_port)?,
        };
        (host, port)
    } else {
        match local_hostname.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, p.parse::<u16>().map_err(|_| bad_port())?),
            _ => (local_hostname, 0),
        }
    };
    let addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host:?}: {e}"))?;
    quiesce_directory::prefer_ipv4(addrs).ok_or_else(|| format!("{host:?} resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::transfer_timeout;

    /// Mooncake's `std::max(5, atoi(MC_TRANSFER_TIMEOUT))`: no upper bound,
    /// the leading number of the text, 5 for none; 30 s when unset.
    #[test]
    fn mc_transfer_timeout_is_read_as_mooncake_reads_it() {
        assert_eq!(transfer_timeout(None), 30);
        assert_eq!(transfer_timeout(Some("60")), 60);
        assert_eq!(transfer_timeout(Some("3600")), 3600, "an hour is an hour");
        assert_eq!(transfer_timeout(Some("1")), 5);
        assert_eq!(transfer_timeout(Some("-7")), 5);
        assert_eq!(transfer_timeout(Some("abc")), 5);
        assert_eq!(transfer_timeout(Some("")), 5);
        assert_eq!(transfer_timeout(Some(" 45s")), 45);
        assert_eq!(transfer_timeout(Some("+90")), 90);
        // atoi's int: past it, the largest.
        assert_eq!(transfer_timeout(Some("99999999999999")), i32::MAX as u64);
    }
}
