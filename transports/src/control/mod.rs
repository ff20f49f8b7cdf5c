//! The control plane every transport shares: the wire format, tokens and
//! their proofs, sessions, the fence table, revoke, admission, and the
//! server that runs each connection's handshake and dispatches its frames —
//! to the TCP data path (`crate::tcp::serve`) and to the queue-pair handler
//! a data plane that sets up its own connections (RDMA) registers
//! ([`QpPlane`]).

pub(crate) mod accept;
pub(crate) mod auth;
pub(crate) mod batch_hash;
pub(crate) mod fence;
pub(crate) mod frame;
pub(crate) mod idle;
pub(crate) mod log_limit;
pub(crate) mod prove;
pub(crate) mod read_ahead;
pub(crate) mod registered;
pub(crate) mod revoke;
pub(crate) mod server;
pub(crate) mod target;
pub mod wire;

use crate::control::wire::{QpWire, RemoteKey};

/// What a data plane that sets up its own connections (RDMA) registers with
/// the control server, which answers `QpConnect` through it.
pub(crate) trait QpPlane {
    /// A new link for one control connection, with no queue pair and no
    /// key yet; `Err` says why not.
    fn open_link(&self) -> Result<Box<dyn ServedLink>, String>;
}

/// What a [`QpPlane`] serves one control connection, from its first
/// `QpConnect`; its session reaches it too (a fence on any connection of
/// the session resets it).
pub(crate) type ServedSlot = std::rc::Rc<std::cell::RefCell<Option<Box<dyn ServedLink>>>>;

/// The target's end of what a [`QpPlane`] serves one control connection: a
/// queue pair (replaced on each `QpConnect`, reset by the fences of its
/// session) and the keys of the segments the connection proved, which work
/// on that connection's queue pairs only. Gone with the connection.
pub(crate) trait ServedLink {
    /// Replaces the queue pair (the old one reset first) with one connected
    /// to the initiator's `remote`; returns the endpoint to answer.
    fn connect(&mut self, remote: &QpWire) -> Result<QpWire, String>;
    /// The remote keys of `segments` (those the plane serves), usable only
    /// on this link's queue pairs.
    fn keys(&mut self, segments: &mut dyn Iterator<Item = u64>) -> Vec<RemoteKey>;
    /// Fence: resets and drops the queue pair, so nothing more lands through
    /// it once this returns `Ok`, with its number (0 if there was none),
    /// named in the `FenceAck`. `Err` says why requests may still land
    /// through it (the device would neither reset nor destroy it): the
    /// link is poisoned then, and no fence of its session is confirmed.
    fn reset(&mut self) -> Result<u32, String>;
    /// True once the link can never serve again (a key a revoke had to kill
    /// lives on in its domain): the control connection is closed, and the
    /// initiator's next one gets a new link.
    fn poisoned(&self) -> bool;
}
