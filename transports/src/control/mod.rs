//! The control plane every transport shares: the wire format, tokens and
//! their proofs, sessions, the fence table, revoke, admission, and the
//! server that runs each connection's handshake and dispatches its frames —
//! to the TCP data path (`crate::tcp::serve`) and to the queue-pair handler
//! a data plane that sets up its own connections (RDMA) registers
//! ([`QpPlane`]).

pub(crate) mod accept;
pub(crate) mod auth;
pub(crate) mod fence;
pub(crate) mod frame;
pub(crate) mod revoke;
pub(crate) mod server;
pub(crate) mod target;
pub mod wire;

use crate::control::wire::{QpWire, RemoteKey};

/// What a data plane that sets up its own connections (RDMA) registers with
/// the control server, which answers `QpConnect` through it.
pub(crate) trait QpPlane {
    /// A queue pair (or the like) connected to the initiator's `remote`, and
    /// the endpoint to answer; `Err` says why not.
    fn accept(&self, remote: &QpWire) -> Result<(Box<dyn ServedLink>, QpWire), String>;
    /// The remote keys of `segments` (those the plane serves).
    fn keys(&self, segments: &mut dyn Iterator<Item = u64>) -> Vec<RemoteKey>;
}

/// The target's end of a link a [`QpPlane`] set up for one control
/// connection: reset by that connection's fences, gone with it.
pub(crate) trait ServedLink {
    /// Its number, named in the `FenceAck` that reset it.
    fn number(&self) -> u32;
    /// Fence: once this returns the link lands nothing more.
    fn fence(&self);
}
