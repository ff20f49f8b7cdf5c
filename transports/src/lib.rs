//! quiesce's transports: one-sided remote writes and reads into memory a
//! target registered, over TCP on io_uring or RDMA verbs ([`rdma`]).
//!
//! * [`Engine`] — one per shard: serves [`Segment`]s to peers and opens
//!   [`Peer`]s for transfers.
//! * Peers meet without a metadata server: a hello exchange carries node names
//!   and segment descriptors, and an HMAC challenge–response proves a
//!   segment's [`Token`] without sending it ([`wire`], `docs/PROTOCOL.md`).
//! * A peer on this host is reached by cross-memory attach (the local
//!   transport, [`LocalMode`]): the target copies each request's bytes from
//!   or to the initiator's memory itself, and a lent buffer comes back only
//!   once the target let go of it.
//! * The target validates every request before touching memory, lands writes
//!   straight in the segment, acknowledges after the last byte, and confirms
//!   remote fences ([`Peer::fence`]) only once no byte of the batch can land.
//!
//! ```no_run
//! use quiesce_runtime::Runtime;
//! use quiesce_transports::{Engine, EngineConfig, Rights};
//! Runtime::new().unwrap().block_on(async {
//!     let target = Engine::bind(EngineConfig::default()).unwrap();
//!     let seg = target.register("kv", vec![0u8; 1 << 20], Rights::READ | Rights::WRITE).unwrap();
//!     let initiator = Engine::bind(EngineConfig::default()).unwrap();
//!     let peer = initiator.connect(target.local_addr()).await.unwrap();
//!     let kv = peer.open("kv", seg.token()).await.unwrap();
//!     let (res, _buf) = kv.write(4096, vec![7u8; 4096], 1).await;
//!     assert_eq!(res.unwrap(), 4096);
//! });
//! ```
#![deny(missing_docs)]

mod config;
mod control;
mod engine;
mod error;
mod local;
mod lock;
mod memory;
pub mod rdma;
mod segment;
mod tcp;

pub use control::wire;

pub use config::{EngineConfig, LocalMode};
pub use control::auth::{BadToken, Token};
pub use control::revoke::RevokeError;
pub use engine::{Engine, EngineStats, RegisterError};
pub use error::{HandshakeFailure, TransferError};
pub use memory::{AlignedBuf, ForeignMemory, Lease, LeaseError, Region};
pub use segment::{Rights, Segment, SegmentMemory};
pub use tcp::peer::Peer;
pub use tcp::segment::RemoteSegment;
