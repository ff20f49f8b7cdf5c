//! Caller memory addressed by pointer, for bindings that speak Mooncake's
//! API (Python's `register_memory(addr, capacity)`, remote addresses as the
//! peer's virtual addresses): lending a range as a segment, taking it back
//! only once nothing can touch it, and opening a peer's segment by an
//! address inside it.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{mpsc, MutexGuard};
use std::time::Duration;

use quiesce_runtime::spawn_local;
use quiesce_runtime::time::timeout;
use quiesce_transports::{ForeignMemory, Token, TransferError};

use super::{host, Lent, SegmentBy, SyncEngine, SyncError};

/// Where a lent range stands (the caller's side of it).
pub(crate) enum Lending {
    /// `lend` is registering it.
    Starting,
    /// Served to peers as segment `.1`; the receiver says when the engine
    /// let go.
    Serving(mpsc::Receiver<()>, u64),
    /// A `reclaim` is withdrawing segment `.0` or waiting for its release.
    Reclaiming(u64),
    /// Segment `.1`, withdrawn, not yet released (a `reclaim` timed out).
    Withdrawn(mpsc::Receiver<()>, u64),
}

impl Lending {
    /// The segment it is, once registered.
    fn segment(&self) -> Option<u64> {
        match self {
            Lending::Starting => None,
            Lending::Serving(_, id) | Lending::Reclaiming(id) | Lending::Withdrawn(_, id) => {
                Some(*id)
            }
        }
    }
}

/// A peer's segment this engine opened (by name, or by an address inside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenedSegment {
    /// The handle batches name it by.
    pub segment: u32,
    /// The peer's virtual address of its first byte (offset = address − base).
    pub base: u64,
    /// Its length.
    pub len: u64,
}

impl SyncEngine {
    /// Where the engine listens (peers connect here).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Lends `addr..addr + len` to peers as segment `name` (read and
    /// write), proven with `token`; returns its id. Refused
    /// ([`SyncError::StillLent`]) while an earlier lending of `addr` has not
    /// been reclaimed to the end.
    ///
    /// # Safety
    ///
    /// The range must stay valid for reads and writes, and nothing but the
    /// engine may write it, until [`reclaim`](Self::reclaim) returns
    /// `Ok(true)` for it (or the engine has stopped).
    pub unsafe fn lend(
        &self,
        name: &str,
        addr: u64,
        len: u64,
        token: Token,
    ) -> Result<u64, SyncError> {
        // Before any lock: one a parent's thread held at the fork stays held.
        self.not_forked()?;
        if host::span(addr, len).is_none() {
            return Err(SyncError::NotHostMemory { addr, len });
        }
        let (released_tx, released_rx) = mpsc::channel();
        // Claimed before the engine registers anything: a second lending of
        // the same address would replace the first one's release signal.
        match self.lendings().entry(addr) {
            Entry::Occupied(_) => return Err(SyncError::StillLent(addr)),
            Entry::Vacant(v) => v.insert(Lending::Starting),
        };
        let name = name.to_string();
        let r = self.call(move |st, tx| {
            // SAFETY: the caller's contract above; `on_release` tells
            // `reclaim` when the engine no longer holds the range.
            let mem = unsafe {
                ForeignMemory::new(addr as *mut u8, len as usize, move || {
                    let _ = released_tx.send(());
                })
            };
            let r = st.fabric.lend(&st.engine, &name, mem, token).map(|lent| {
                let id = lent.seg.id();
                st.lent.borrow_mut().insert(addr, lent);
                id
            });
            let _ = tx.send(r);
        });
        let mut lendings = self.lendings();
        match r {
            Ok(Ok(id)) => {
                lendings.insert(addr, Lending::Serving(released_rx, id));
                Ok(id)
            }
            Ok(Err(e)) | Err(e) => {
                // Not registered: the engine dropped the memory's handle.
                lendings.remove(&addr);
                Err(e)
            }
        }
    }

    /// Takes back the range lent at `addr`: revokes all of it (writes
    /// landing there are cut, and none issued before lands later), stops
    /// serving it, and waits up to `timeout` until nothing holds it — no
    /// write landing, no read sending from it. `Ok(true)`: the memory is the
    /// caller's again. `Ok(false)`: something still holds it (or another
    /// call is taking it back right now); it must not be freed or reused
    /// yet — call again to keep waiting.
    pub fn reclaim(&self, addr: u64, timeout: Duration) -> Result<bool, SyncError> {
        self.reclaim_lending(addr, None, timeout)
    }

    /// [`reclaim`](Self::reclaim) of the lending at `addr` only if it is
    /// segment `segment`: a lending of the address made since (the one
    /// asked for was taken back meanwhile, by another call) is not this
    /// call's to take, and the answer is [`SyncError::NotLent`].
    pub fn reclaim_segment(
        &self,
        addr: u64,
        segment: u64,
        timeout: Duration,
    ) -> Result<bool, SyncError> {
        self.reclaim_lending(addr, Some(segment), timeout)
    }

    fn reclaim_lending(
        &self,
        addr: u64,
        only: Option<u64>,
        timeout: Duration,
    ) -> Result<bool, SyncError> {
        // (It waits for a release only the parent's engine would send.)
        self.not_forked()?;
        let (rx, serving, id) = {
            let mut lendings = self.lendings();
            let Some(state) = lendings.get_mut(&addr) else {
                return Err(SyncError::NotLent(addr));
            };
            if only.is_some_and(|want| state.segment() != Some(want)) {
                return Err(SyncError::NotLent(addr));
            }
            let taken = match std::mem::replace(state, Lending::Starting) {
                Lending::Serving(rx, id) => (rx, true, id),
                Lending::Withdrawn(rx, id) => (rx, false, id),
                // Another call holds it; it stays as that call leaves it.
                other @ (Lending::Starting | Lending::Reclaiming(_)) => {
                    *state = other;
                    return Ok(false);
                }
            };
            *state = Lending::Reclaiming(taken.2);
            taken
        };
        if serving {
            let withdrawn = self.call(move |st, tx| {
                let Some(Lent { seg, local }) = st.lent.borrow_mut().remove(&addr) else {
                    let _ = tx.send(Ok(()));
                    return;
                };
                // No new local post from it; posts in flight hold the
                // registration (and so the memory) until they are reaped.
                drop(local);
                let (engine, fabric) = (st.engine.clone(), st.fabric.clone());
                spawn_local(async move {
                    let r = seg.revoke(0..seg.len()).await.map_err(SyncError::from);
                    fabric.deregister(&engine, seg.id());
                    drop(seg);
                    let _ = tx.send(r);
                });
            });
            // The job deregisters the segment whatever its revoke answered,
            // and an engine that stopped dropped it: either way the release
            // signal below says when nothing holds the memory.
            if let Err(e) | Ok(Err(e)) = withdrawn {
                tracing::warn!(addr, error = %e, "reclaiming lent memory");
            }
        }
        match rx.recv_timeout(timeout) {
            // Released — or the engine's thread is gone, after its runtime
            // reaped every operation.
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.lendings().remove(&addr);
                Ok(true)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.lendings().insert(addr, Lending::Withdrawn(rx, id));
                Ok(false)
            }
        }
    }

    /// Connects to `peer` and opens the segment that holds the peer's
    /// address `addr`, proving `token`.
    pub fn open_at(
        &self,
        peer: SocketAddr,
        addr: u64,
        token: Token,
    ) -> Result<OpenedSegment, SyncError> {
        self.open_by(peer, SegmentBy::Address(addr), token)
    }

    /// Connects to `peer` and opens the segment it registered first among
    /// those live now that `token` opens (Mooncake's
    /// `get_first_buffer_address`).
    pub fn open_first(&self, peer: SocketAddr, token: Token) -> Result<OpenedSegment, SyncError> {
        self.open_by(peer, SegmentBy::First, token)
    }

    /// Whether a peer answers at `peer` within `within`: a hello round
    /// trip on a connection of its own, closed after (nothing is proven on
    /// it); the node that answered. A connection the kernel accepted for a
    /// stopped process times out here.
    pub fn probe(&self, peer: SocketAddr, within: Duration) -> Result<String, SyncError> {
        self.call(move |st, tx| {
            let st = st.clone();
            spawn_local(async move {
                let r = match timeout(within, st.engine.probe(peer)).await {
                    Ok(r) => r.map_err(SyncError::from),
                    Err(_) => Err(SyncError::Transfer(TransferError::handshake(
                        peer,
                        format!("no hello ack within {within:?}"),
                    ))),
                };
                let _ = tx.send(r);
            });
        })?
    }

    /// The name of the node at `peer` (connecting to it if this engine has
    /// not): what its hello said. A caller that found `peer` under a node's
    /// name (a directory entry) checks it before opening there, since the
    /// entry may be stale and the address another node's now; a connected
    /// peer's reconnects already refuse a node of another name.
    pub fn peer_node(&self, peer: SocketAddr) -> Result<String, SyncError> {
        self.call(move |st, tx| {
            let st = st.clone();
            spawn_local(async move {
                let _ = tx.send(
                    st.fabric
                        .node(&st.engine, peer)
                        .await
                        .map_err(SyncError::from),
                );
            });
        })?
    }

    fn open_by(
        &self,
        peer: SocketAddr,
        by: SegmentBy,
        token: Token,
    ) -> Result<OpenedSegment, SyncError> {
        self.call(move |st, tx| {
            let st = st.clone();
            spawn_local(async move {
                let r = async {
                    let seg = st.fabric.open(&st.engine, peer, by, token).await?;
                    Ok(st.keep(seg, peer, token, None))
                };
                let _ = tx.send(r.await);
            });
        })?
    }

    fn lendings(&self) -> MutexGuard<'_, HashMap<u64, Lending>> {
        // A poisoned map is still the right map: nothing in it panics.
        self.released.lock().unwrap_or_else(|e| e.into_inner())
    }
}
