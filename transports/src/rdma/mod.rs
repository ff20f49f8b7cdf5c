//! RDMA verbs: one-sided RDMA WRITE and READ over reliable-connected queue
//! pairs, polled by the shard's reactor.
//!
//! * [`RdmaEngine`] — one per shard. It wraps a TCP [`Engine`](crate::Engine),
//!   which stays the control plane: hello, token proofs, the queue pair
//!   exchange (`QpConnect`/`QpAccept`, see `docs/PROTOCOL.md`) and remote
//!   fences all travel on one TCP control connection per peer.
//! * Segments it registers get a memory region whose access flags follow
//!   their [`Rights`](crate::Rights): the target's NIC enforces them.
//! * Local buffers must lie inside a [`Region`](crate::Region) registered with
//!   [`RdmaEngine::register_region`]; anything else is refused with
//!   [`TransferError::Unregistered`](crate::TransferError::Unregistered)
//!   before a byte is posted.
//! * The shard's completion queue is a reactor completion source (busy-polled,
//!   or armed on its completion channel with drain-after-arm). Every work
//!   request is tracked until it is known done; a transfer resolves only
//!   then. Only the last request of each transfer in a doorbell asks for a
//!   completion; an RC send queue completes in order, so that one vouches
//!   for the silent ones before it (`ledger`).
//! * A failed completion puts the queue pair in the error state, every
//!   outstanding request flushes, and the next transfer builds a new queue
//!   pair. A fence moves both ends' queue pairs to the error state.
//!
//! Without `libibverbs.so.1`, or without a device, [`RdmaEngine::bind`]
//! returns [`RdmaError::NoDevice`]; nothing else in the crate needs either.

mod engine;
mod ledger;
mod link;
mod local;
mod peer;
mod reaper;
pub(crate) mod served;
mod verbs;

pub use engine::{LocalMemory, RdmaConfig, RdmaEngine};
pub use peer::{after_next_qp_accept, AfterAccept, RdmaPeer, RdmaSegment};
pub use reaper::RdmaStats;
pub use served::{fail_next_served_resets, stall_next_qp_accepts};
pub use verbs::{device_names, fail_next_deregistrations, QpEndpoint};

/// Why the RDMA engine cannot start, or a verbs call failed.
#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// No usable device: libibverbs missing, no device, or no active port.
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// The port has no GID to send from (RoCE needs an IPv4-mapped one).
    #[error("no usable GID on {device}: {why}")]
    NoGid {
        /// The device.
        device: String,
        /// What was looked for.
        why: String,
    },
    /// A verbs call failed.
    #[error("{0}: {1}")]
    Verbs(&'static str, std::io::Error),
    /// The TCP control plane could not start.
    #[error("control plane: {0}")]
    Control(std::io::Error),
    /// The memory is already registered with this engine.
    #[error("memory already registered")]
    AlreadyRegistered,
}
