//! What the Mooncake methods share behind their Python signatures:
//! starting the node, running a blocking transfer, lending a range,
//! submitting an asynchronous batch, and freeing a managed buffer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use quiesce_batch::sync::{Direction, SyncError};
use quiesce_batch::{SYNC_FAILED, SYNC_OK, SYNC_UNKNOWN};
use quiesce_runtime::timeline::{self, Step};

use crate::managed::{Free, Held, NotLendable};
use crate::node::{complain, Fabric, Node};

use super::{TransferEngine, RECLAIM_WAIT};

impl TransferEngine {
    pub(super) fn node(&self) -> Option<Arc<Node>> {
        self.node.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(super) fn start(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata: &str,
        protocol: &str,
        device_name: &str,
    ) -> i32 {
        if self.node().is_some() {
            return complain("initialize: already initialised");
        }
        if self.starting.swap(true, Ordering::AcqRel) {
            return complain("initialize: another thread is initialising this engine");
        }
        /// Clears `starting` however the start ends (a panic included).
        struct Started<'a>(&'a AtomicBool);
        impl Drop for Started<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _started = Started(&self.starting);
        // Mooncake's switch (SGLang sets it and keeps protocol "rdma"): TCP
        // whatever the protocol says.
        let protocol = if force_tcp() { "tcp" } else { protocol };
        let fabric = match protocol {
            "tcp" => Fabric::Tcp,
            "rdma" => {
                let device = device_name
                    .split(',')
                    .map(str::trim)
                    .find(|d| !d.is_empty())
                    .map(str::to_string);
                match (&device, rdma_missing()) {
                    // Mooncake installs TCP when it finds no RDMA device,
                    // and "rdma" is vLLM's and SGLang's default protocol.
                    (None, Some(why)) => {
                        tracing::warn!(
                            "initialize: protocol \"rdma\", but {why}: using TCP, as Mooncake \
                             does (MC_FORCE_TCP=1 or protocol \"tcp\" says so)"
                        );
                        Fabric::Tcp
                    }
                    _ => Fabric::Rdma { device },
                }
            }
            _ => {
                return complain(&format!(
                    "initialize: protocol {protocol:?}: \"tcp\" and \"rdma\" are supported"
                ))
            }
        };
        // Mooncake's forms: "P2PHANDSHAKE", "etcd://host:port", or a bare
        // "host:port[,host:port]" meaning etcd.
        let metadata = match metadata {
            "P2PHANDSHAKE" => metadata.to_string(),
            m if m.starts_with("etcd://") => m.to_string(),
            m if !m.contains("://") => format!("etcd://{m}"),
            m => {
                return complain(&format!(
                    "initialize: metadata server {m:?}: \"P2PHANDSHAKE\" or etcd://host:port are supported"
                ))
            }
        };
        match py.detach(|| Node::start(local_hostname, &metadata, fabric)) {
            Ok(n) => {
                let mut slot = self.node.write().unwrap_or_else(|e| e.into_inner());
                if slot.is_some() {
                    // Another thread's initialize won meanwhile: this node,
                    // which nothing used, stops as it drops.
                    drop(slot);
                    py.detach(|| drop(n));
                    return complain("initialize: already initialised");
                }
                *slot = Some(Arc::new(n));
                SYNC_OK
            }
            Err(e) => complain(&format!("initialize: {e}")),
        }
    }

    pub(super) fn sync(
        &self,
        py: Python<'_>,
        target: &str,
        dir: Direction,
        buffers: &[usize],
        peer_addresses: &[usize],
        lengths: &[usize],
    ) -> i32 {
        let Some(node) = self.node() else {
            return complain("transfer: the engine is not initialised");
        };
        timeline::mark(Step::CallEntered);
        let code = py.detach(|| node.run(target, dir, buffers, peer_addresses, lengths));
        timeline::mark(Step::CallReturned);
        code
    }

    pub(super) fn not_ready(&self) -> Option<Arc<Node>> {
        match self.node_here() {
            Ok(Some(n)) => Some(n),
            Ok(None) => {
                complain("the engine is not initialised");
                None
            }
            Err(e) => {
                complain(&e.to_string());
                None
            }
        }
    }

    /// The node (`None` before `initialize`), or `Forked` in a forked
    /// child's copy: nothing of it runs here (its thread is the parent's),
    /// and a lock of the node that a parent's thread held at the fork
    /// stays held. Every call answers its failure before taking any.
    pub(super) fn node_here(&self) -> Result<Option<Arc<Node>>, SyncError> {
        match self.node() {
            Some(n) => n.engine().not_forked().map(|()| Some(n)),
            None => Ok(None),
        }
    }

    /// `register_memory`, run without the GIL.
    pub(super) fn lend_range(&self, buffer_addr: usize, capacity: usize) -> i32 {
        let Some(node) = self.not_ready() else {
            return SYNC_FAILED;
        };
        if buffer_addr == 0 || capacity == 0 {
            return complain("register_memory: null address or zero capacity");
        }
        let (addr, len) = (buffer_addr as u64, capacity as u64);
        // Counted in the managed buffers it lies in, which stay allocated
        // until it is taken back.
        match node.managed.lending(buffer_addr, capacity) {
            Ok(()) => {}
            Err(NotLendable::BeingFreed(at)) => {
                return complain(&format!(
                    "register_memory {addr:#x}: the managed buffer at {at:#x} is being freed"
                ))
            }
            Err(NotLendable::PastTheAddressSpace) => {
                return complain(&format!(
                    "register_memory {addr:#x}: {len} bytes run past the end of the address space"
                ))
            }
            Err(NotLendable::AlreadyLent) => {
                return complain(&format!(
                    "register_memory {addr:#x}: already registered (unregister it first)"
                ))
            }
        }
        // SAFETY: the caller lends the range until unregister_memory returns
        // 0 (Mooncake's contract for registered memory).
        match unsafe {
            node.engine()
                .lend(&format!("{addr:#x}"), addr, len, node.token)
        } {
            Ok(id) => {
                node.published(id, addr, len);
                SYNC_OK
            }
            Err(e) => {
                node.managed.lent_back(buffer_addr);
                complain(&format!("register_memory {addr:#x}: {e}"))
            }
        }
    }

    /// `unregister_memory`, run without the GIL: 0 once nothing touches
    /// the range, -2 if something still held it after `wait`, -1 if it was
    /// not registered.
    pub(super) fn take_back(&self, buffer_addr: usize, wait: Duration) -> i32 {
        let Some(node) = self.not_ready() else {
            return SYNC_FAILED;
        };
        let id = node.published_id(buffer_addr as u64);
        match node.unregister(buffer_addr, wait) {
            Ok(true) => {
                node.withdrawn(buffer_addr as u64, id);
                SYNC_OK
            }
            Ok(false) => SYNC_UNKNOWN,
            // (`NotLent`: no record of ours to undo. One there belongs to a
            // `register_memory` of that address still starting, which
            // undoes it itself if it fails.)
            Err(e) => complain(&format!("unregister_memory {buffer_addr:#x}: {e}")),
        }
    }

    pub(super) fn submit(
        &self,
        py: Python<'_>,
        target: &str,
        dir: Direction,
        buffers: &[usize],
        peer_addresses: &[usize],
        lengths: &[usize],
    ) -> u64 {
        let Some(node) = self.not_ready() else {
            return 0;
        };
        py.detach(|| node.submit(target, dir, buffers, peer_addresses, lengths))
    }

    /// `free_managed_buffer`'s body (see its docs).
    pub(super) fn free_managed(&self, py: Python<'_>, buffer_addr: usize, length: usize) -> i32 {
        let Some(node) = self.not_ready() else {
            return SYNC_FAILED;
        };
        // No registration may start in it from here, and none but its own
        // may lie in it: peers could write there until it is taken back.
        let held = match node.managed.begin_free(buffer_addr, length) {
            // Perhaps by asynchronous batches that finished but nobody
            // polled: their uses go back first.
            // (Without the GIL: it asks the engine's thread about each
            // unreported -2 batch.)
            Err(Held::InUse) => {
                py.detach(|| node.release_finished());
                node.managed.begin_free(buffer_addr, length)
            }
            held => held,
        };
        match held {
            Ok(()) => {}
            Err(Held::NoSuchBuffer) => {
                return complain(&format!(
                    "free_managed_buffer: no managed buffer of {length} bytes at {buffer_addr:#x}"
                ))
            }
            Err(Held::LentAt(at)) => {
                complain(&format!(
                    "free_managed_buffer {buffer_addr:#x}: the range registered at {at:#x} lies in it (unregister it first)"
                ));
                return SYNC_UNKNOWN;
            }
            // Registered still, so that a batch's retry finds it where it was.
            Err(Held::InUse | Held::Freeing) => return SYNC_UNKNOWN,
        }
        let id = node.published_id(buffer_addr as u64);
        let reclaimed = py.detach(|| node.engine().reclaim(buffer_addr as u64, RECLAIM_WAIT));
        let code = match reclaimed {
            // Nothing holds it now — or nothing was lent there any more (an
            // earlier unregister_memory took it back to the end, and its
            // record with it: one there now is a `register_memory` still
            // starting, which `free` sees).
            Ok(true) | Err(SyncError::NotLent(_)) => {
                // (`NotLent`: that unregister withdrew its record too.)
                if reclaimed.is_ok() {
                    node.managed.lent_back(buffer_addr);
                    node.withdrawn(buffer_addr as u64, id);
                }
                match node.managed.free(buffer_addr, length) {
                    Free::Done => return SYNC_OK,
                    // A batch started on it meanwhile.
                    Free::InUse => SYNC_UNKNOWN,
                    Free::NoSuchBuffer => complain(&format!(
                        "free_managed_buffer: {buffer_addr:#x} was freed meanwhile"
                    )),
                }
            }
            Ok(false) => SYNC_UNKNOWN,
            Err(e) => complain(&format!("free_managed_buffer {buffer_addr:#x}: {e}")),
        };
        node.managed.end_free(buffer_addr);
        code
    }
}

/// Why this machine has no RDMA device to use, if it has none (no verbs
/// library, no kernel support, or no device).
fn rdma_missing() -> Option<String> {
    match quiesce_transports::rdma::device_names() {
        Ok(names) if names.is_empty() => Some("this machine has no RDMA device".into()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// `MC_FORCE_TCP` set to `1`, `true`, `yes` or `on` (any case).
fn force_tcp() -> bool {
    std::env::var("MC_FORCE_TCP").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}
