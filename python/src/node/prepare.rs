//! What a drop-in call becomes before it runs: its input checked, the
//! memory it uses counted (so an unregister or a free waits for it), and a
//! task on an opened segment for each entry.

use std::net::SocketAddr;
use std::time::Duration;

use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{Direction, MemoryAccess, SyncTask, SyncTasks};
use quiesce_batch::BatchOptions;
use smallvec::SmallVec;

use super::Node;
use crate::managed::Uses;

/// What one call's tasks became.
pub(super) struct Prepared {
    pub(super) peer: SocketAddr,
    /// Paired with their direction as the sync engine takes them (no
    /// second vector to pair them there).
    pub(super) tasks: SyncTasks<RawBuf>,
    /// The bytes they move.
    pub(super) bytes: u64,
    /// The segments the tasks use (inline for a few: no allocation).
    pub(super) used: SmallVec<[u32; 4]>,
    /// The managed buffers its local buffers lie in.
    pub(super) uses: Uses,
}

/// A call's peer, tasks and the segment handles they use
/// ([`Node::tasks`]).
type Planned = (SocketAddr, SyncTasks<RawBuf>, SmallVec<[u32; 4]>);

impl Node {
    pub(super) fn prepare(
        &self,
        target: &str,
        dir: Direction,
        buffers: &[usize],
        peer_addresses: &[usize],
        lengths: &[usize],
    ) -> Result<Prepared, String> {
        // Before any lock (the buffer check's, the peers'): in a forked
        // child, one that a parent's thread held at the fork stays held.
        self.engine().not_forked().map_err(|e| e.to_string())?;
        if buffers.len() != peer_addresses.len() || buffers.len() != lengths.len() {
            return Err("buffers, peer addresses and lengths differ in count".into());
        }
        // A zero-length entry moves nothing: Mooncake completes it as a
        // no-op, and SGLang sends them (a model's state item of 0 bytes, with
        // whatever pointer it has, among its others). A call with nothing
        // else is bad input. A call with no entries at all is not: Mooncake
        // answers 0 for it, and a caller that lists the blocks left to send
        // makes one (its tasks are empty, and `run`/`submit` complete it).
        if !lengths.is_empty() && lengths.iter().all(|&l| l == 0) {
            return Err("zero length: every task is empty".into());
        }
        if let Some(i) = (0..buffers.len()).find(|&i| buffers[i] == 0 && lengths[i] != 0) {
            return Err(format!("task {i} has a null buffer"));
        }
        // The caller's word is Mooncake's contract, but a GPU pointer (SGLang
        // goes on to transfer from its KV caches after their registration
        // failed) would crash this process in the first copy.
        // A write's source need only be readable.
        let locals = buffers.iter().zip(lengths).filter(|(_, &l)| l != 0);
        let (access, may) = match dir {
            Direction::Write => (MemoryAccess::Read, "read"),
            Direction::Read => (MemoryAccess::ReadWrite, "read and write"),
        };
        if let Some((b, l)) = self
            .host
            .first_without(locals.map(|(&b, &l)| (b as u64, l as u64)), access)
        {
            return Err(format!(
                "local buffer {b:#x}..+{l} is not memory this process can {may} \
                 (device memory? quiesce moves host memory)"
            ));
        }
        // Counted before anything that may block (the peer's lookup, the
        // segment's open: a network round trip): from here the call uses
        // the memory, and an unregister or a free waits for it. Counted
        // after, a free in that window answered 0 and released a managed
        // buffer the call then read into.
        let locals = buffers.iter().zip(lengths).filter(|(_, &l)| l != 0);
        let uses = self
            .managed
            .take_uses(locals.map(|(&b, &l)| (b, l)))
            .map_err(|at| {
                format!("the memory at {at:#x} is being unregistered or freed: no batch may start from it")
            })?;
        match self.tasks(target, dir, buffers, peer_addresses, lengths) {
            Ok((peer, tasks, used)) => Ok(Prepared {
                peer,
                tasks,
                used,
                bytes: lengths.iter().map(|&l| l as u64).sum(),
                uses,
            }),
            // Nothing started: the uses go back.
            Err(e) => {
                self.managed.release(uses);
                Err(e)
            }
        }
    }

    /// [`prepare`](Self::prepare)'s tasks: the peer, each entry's task on
    /// the segment that holds its remote range (opened if need be), and
    /// those segments' handles.
    fn tasks(
        &self,
        target: &str,
        dir: Direction,
        buffers: &[usize],
        peer_addresses: &[usize],
        lengths: &[usize],
    ) -> Result<Planned, String> {
        let peer = self.peer(target)?;
        let mut tasks = SyncTasks::with_capacity(buffers.len());
        let mut used = SmallVec::with_capacity(buffers.len());
        let entries = buffers.iter().zip(peer_addresses).zip(lengths);
        for ((&buf, &at), &len) in entries.filter(|(_, &len)| len != 0) {
            let seg = self.segment(target, peer, at as u64, len as u64)?;
            used.push(seg.segment);
            let task = SyncTask {
                segment: seg.segment,
                offset: at as u64 - seg.base,
                // SAFETY: Mooncake's contract, which this API keeps: the
                // caller's buffer stays valid and untouched until the call
                // returns 0 or -1, or, after -2, until wait_for_quiescence()
                // says the batch drained.
                buf: unsafe { RawBuf::new(buf as *mut u8, len) },
            };
            tasks.push((dir, task));
        }
        Ok((peer, tasks, used))
    }

    /// The options of a call's batch: room for all of its tasks. Mooncake
    /// takes a batch of any length, and vLLM and SGLang pass one entry per
    /// KV block and layer — past the native limit (4,096) on long prompts.
    /// The caller's own lists bound it; it holds up to about 2 KiB per
    /// entry while it runs (262,144 entries of 256 bytes, initiator and
    /// target in one process: 0.75 s and ~500 MiB over the buffers).
    ///
    /// Its deadline grows with its size as Mooncake's does:
    /// `MC_TRANSFER_TIMEOUT` plus a nanosecond per byte (a second per GB),
    /// so a whole rank's weights read at start-up are not cut at 30 s.
    pub(super) fn options_for(&self, p: &Prepared) -> BatchOptions {
        let mut opts = self.options.room_for(p.tasks.len());
        opts.deadline = opts.deadline.map(|d| d + Duration::from_nanos(p.bytes));
        opts
    }
}
