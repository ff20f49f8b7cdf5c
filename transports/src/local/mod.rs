//! The local transport: a peer on this host moves data by cross-memory
//! attach (`process_vm_readv(2)` / `process_vm_writev(2)`), with TCP kept
//! for everything else — handshake, authentication, sessions, requests and
//! their answers, fences and revoke (DESIGN.md §16, PROTOCOL.md §7).
//!
//! **Only the target copies.** An attached connection's `WriteLocal` names
//! the source in the initiator's memory; the target pulls it into its
//! segment. `ReadLocal` names the destination; the target pushes the
//! segment's bytes there. So every byte that lands in a segment is written
//! by the target's own thread, after the same checks as a TCP write, under
//! the same fence and revoke registrations — a revoke or a fence stops it
//! between two chunks and waits for the chunk in progress. The initiator
//! never maps or writes the target's memory.
//!
//! **The caller's buffer comes back only when the target let go** of it:
//! with the target's answer, or — when the connection dies first — once
//! the target confirmed a fence of the batch (it then has no copy of the
//! batch in progress and starts none) or has exited ([`loan`]). A stopped
//! target therefore holds a buffer; the batch's deadline turns that into
//! `CompletionUnknown`, never into a buffer handed back on a guess.
//!
//! **Small requests skip the socket.** An attached connection also gets a
//! [`mailbox`] in shared memory: writes and reads of up to 64 KiB are
//! copied through its slots, and served by the target before the next
//! frame it reads from the socket — one stream, with no syscall on either
//! side while the reactors spin.
//!
//! **Who is attached is proven, not claimed**: a pid is accepted only if
//! that process holds this very connection's socket ([`owner`]) and its
//! memory holds this connection's nonce at the address it named.

pub(crate) mod conn;
pub(crate) mod inbox;
pub(crate) mod loan;
pub(crate) mod mailbox;
pub(crate) mod outbox;
pub(crate) mod owner;
pub(crate) mod serve;

/// The target copies at most this many bytes between two looks at its
/// fences and revokes (and two reactor turns): about 100 µs at memcpy
/// speed, so a large copy never stalls the reactor for long.
pub(crate) const CHUNK: usize = 1 << 20;

/// An attached peer's transfers are sliced at least this large: one
/// request per 16 MiB instead of per 1 MiB (the target still copies in
/// [`CHUNK`]s, yielding between them), so a large transfer pays few round
/// trips.
pub(crate) const SLICE: usize = 16 << 20;

/// Bytes of a `LocalAttach` payload: pid (4), address of the nonce (8).
pub(crate) const ATTACH_PAYLOAD: usize = 12;

/// Bytes of a `WriteLocal`/`ReadLocal` payload: the initiator's address.
pub(crate) const ADDRESS_PAYLOAD: usize = 8;
