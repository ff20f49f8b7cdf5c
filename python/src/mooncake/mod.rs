//! The Mooncake-compatible `TransferEngine`: the names, argument order,
//! keywords and return conventions of Mooncake's Python binding
//! (`mooncake-integration/transfer_engine/transfer_engine_py.cpp`), for the
//! calls vLLM's and SGLang's connectors make, on quiesce's contract.
//!
//! Addressing is Mooncake's: a target registers ranges of its memory
//! (`register_memory(buffer_addr, capacity)`), each a segment; an initiator
//! names remote memory by the target's virtual addresses and its session
//! name `"host:rpc_port"`. Access is proven with a token every peer derives
//! from a secret the cluster shares (`QUIESCE_SECRET`); `QUIESCE_OPEN_CLUSTER=1`
//! runs an open cluster on a trusted network instead.

mod calls;

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use quiesce_batch::sync::Direction;
use quiesce_batch::{SYNC_FAILED, SYNC_OK};

use crate::native::error::from_sync;
use crate::node::{complain, seconds, Node, Progress};
use crate::opcode::{direction, refuse_notify, TransferOpcode};
use crate::word::{Word, Words};

/// How long `send_probe` waits for the peer's answer.
const PROBE_WAIT: Duration = Duration::from_secs(2);
/// How long `unregister_memory` waits for nothing to hold the range.
const RECLAIM_WAIT: Duration = Duration::from_secs(30);
/// How long `get_batch_transfer_status` waits at most: without a limit, as
/// Mooncake's does. Every batch has an outcome by its own deadline and
/// fence (`MC_TRANSFER_TIMEOUT` plus a nanosecond per byte, then the fence's
/// grace): 0, -1, or -2 with its ticket kept for `wait_for_quiescence()`.
/// (A fixed hour answered -2 for a batch with a later deadline, and left it
/// where `wait_for_quiescence()` did not look.)
const STATUS_WAIT: Duration = Duration::MAX;

/// Mooncake's `TransferEngine`, whose codes keep quiesce's contract.
///
/// `0`: completed. `-1`: failed, and nothing touches the caller's memory any
/// more (its sources, and a read's destinations, may be reused at once; a
/// write whose target did not confirm the fence — it stopped answering —
/// may still land bytes in the *target's* range until the target revokes it,
/// e.g. by `unregister_memory` there). `-2`: completion
/// unknown (a target stopped answering while the batch was being cut): the
/// memory stays pinned — do not free or reuse it until
/// `wait_for_quiescence()` returns 0. Callers that test `ret == 0` (vLLM) or
/// `ret < 0` (SGLang) treat -2 as a failure, but reuse the memory at once:
/// `QUIESCE_WAIT_UNKNOWN` makes a call that would answer -2 wait for the
/// drained outcome first (README).
#[pyclass(module = "quiesce._native")]
pub struct TransferEngine {
    node: RwLock<Option<Arc<Node>>>,
    /// An `initialize` is under way: another answers -1 at once rather
    /// than start a node of its own (two would publish under one name in
    /// etcd, and the loser's lease, revoked as it dropped, could take the
    /// winner's entry with it).
    starting: AtomicBool,
}
#[pymethods]
impl TransferEngine {
    /// An engine that does nothing until `initialize`.
    #[new]
    fn new() -> Self {
        TransferEngine {
            node: RwLock::new(None),
            starting: AtomicBool::new(false),
        }
    }

    /// `TransferEngine.TransferOpcode`, as in Mooncake.
    #[classattr]
    #[pyo3(name = "TransferOpcode")]
    fn transfer_opcode(py: Python<'_>) -> Py<pyo3::types::PyType> {
        py.get_type::<TransferOpcode>().unbind()
    }

    /// Starts the engine: listens on `local_hostname` (`"host"` picks a free
    /// port, `"host:port"` that one) for peers. `metadata_server` is
    /// `"P2PHANDSHAKE"` (peers are named by `"host:rpc_port"`) or
    /// `"etcd://host:port[/prefix]"` (this engine publishes itself as
    /// `local_hostname`, under a lease, and peers are found by their names); `protocol` `"tcp"` or `"rdma"` (on `device_name`,
    /// the first of a comma-separated list, or the first device with an
    /// active port when empty).
    /// Needs the cluster's secret in `QUIESCE_SECRET` (or
    /// `QUIESCE_OPEN_CLUSTER=1`). 0 on success, -1 otherwise (why: stderr).
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> i32 {
        self.start(py, local_hostname, metadata_server, protocol, device_name)
    }

    /// `initialize` with Mooncake's explicit `metadata_type`: `"etcd"`
    /// (`metadata_server` is then `host:port` or `etcd://host:port`) or
    /// `"P2PHANDSHAKE"`; a `metadata_server` of `"P2PHANDSHAKE"` is P2P
    /// whatever the type, as in Mooncake.
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
        metadata_type: &str,
    ) -> i32 {
        // Mooncake's `buildConnString`: a "P2PHANDSHAKE" server is P2P
        // whatever the type; a server with a scheme keeps it; a bare one
        // takes the type's ("etcd://host:port"). (The type "P2PHANDSHAKE"
        // with another server, which Mooncake would make a URL of, is P2P.)
        let server = match (metadata_type, metadata_server) {
            (_, "P2PHANDSHAKE") => "P2PHANDSHAKE".to_string(),
            (_, s) if s.contains("://") => s.to_string(),
            ("P2PHANDSHAKE", _) => "P2PHANDSHAKE".to_string(),
            ("etcd", s) => format!("etcd://{s}"),
            (t, s) => {
                return complain(&format!(
                    "initialize_ext: metadata type {t:?} with server {s:?}: \"etcd\" and \"P2PHANDSHAKE\" are supported"
                ))
            }
        };
        self.start(py, local_hostname, &server, protocol, device_name)
    }

    /// The port peers reach this engine on (its session name is
    /// `"host:port"`); -1 before `initialize`.
    fn get_rpc_port(&self) -> i32 {
        self.node()
            .map_or(SYNC_FAILED, |n| n.engine().local_addr().port() as i32)
    }

    /// Lets authenticated peers read and write `buffer_addr..+capacity`,
    /// which must stay valid until `unregister_memory` returns 0.
    /// `location` (Mooncake's NUMA/device hint) is ignored.
    #[pyo3(signature = (buffer_addr, capacity, location = "*"))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: usize,
        capacity: usize,
        location: &str,
    ) -> i32 {
        let _ = location;
        // Without the GIL: over RDMA, registering a KV pool pins it (seconds).
        py.detach(|| self.lend_range(buffer_addr, capacity))
    }

    /// Takes the range at `buffer_addr` back: writes landing in it are cut
    /// and none issued before lands later, and this engine's own batches
    /// that read or write it are waited for (new ones refused meanwhile).
    /// 0: nothing touches it any more; -1: not registered; -2: something
    /// still held it after 30 s (do not free it; call again).
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: usize) -> i32 {
        py.detach(|| self.take_back(buffer_addr, RECLAIM_WAIT))
    }

    /// `register_memory` for each pair, all or nothing, as Mooncake's: 0 if
    /// every one succeeded; else -1 (the same range twice included), and
    /// those this call registered are taken back — or -2 if one of them
    /// could not be in 30 s (a peer holds it: do not free it; unregister
    /// it again).
    #[pyo3(signature = (buffer_addresses, capacities, location = "*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: Vec<usize>,
        capacities: Vec<usize>,
        location: &str,
    ) -> i32 {
        let _ = location;
        if buffer_addresses.len() != capacities.len() {
            return complain("batch_register_memory: addresses and capacities differ in count");
        }
        py.detach(|| {
            for (i, (&a, &c)) in buffer_addresses.iter().zip(&capacities).enumerate() {
                let code = self.lend_range(a, c);
                if code != SYNC_OK {
                    let undone = buffer_addresses[..i]
                        .iter()
                        .rev()
                        .map(|&r| self.take_back(r, RECLAIM_WAIT));
                    return undone.fold(code, i32::min);
                }
            }
            SYNC_OK
        })
    }

    /// `unregister_memory` for each address; 0 if every one succeeded, else
    /// the worst code (-2 before -1).
    fn batch_unregister_memory(&self, py: Python<'_>, buffer_addresses: Vec<usize>) -> i32 {
        let codes: Vec<i32> = buffer_addresses
            .iter()
            .map(|&a| self.unregister_memory(py, a))
            .collect();
        codes.into_iter().min().unwrap_or(SYNC_OK)
    }

    /// Writes `length` bytes at `buffer` to `peer_buffer_address` at the
    /// peer whose session name is `target_hostname` (`"host:port"`).
    /// `transport_hint` is ignored (TCP).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: Word,
        peer_buffer_address: Word,
        length: Word,
        transport_hint: &str,
    ) -> i32 {
        let _ = transport_hint;
        let (b, a, l) = ([buffer.0], [peer_buffer_address.0], [length.0]);
        self.sync(py, target_hostname, Direction::Write, &b, &a, &l)
    }

    /// Reads `length` bytes at the peer's `peer_buffer_address` into
    /// `buffer`.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: Word,
        peer_buffer_address: Word,
        length: Word,
        transport_hint: &str,
    ) -> i32 {
        let _ = transport_hint;
        let (b, a, l) = ([buffer.0], [peer_buffer_address.0], [length.0]);
        self.sync(py, target_hostname, Direction::Read, &b, &a, &l)
    }

    /// One transfer in direction `opcode` (`TransferOpcode` or 0/1).
    /// `notify` is not supported (it must be `None`).
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: Word,
        peer_buffer_address: Word,
        length: Word,
        opcode: &Bound<'_, PyAny>,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        refuse_notify(notify)?;
        let dir = direction(opcode)?;
        let (b, a, l) = ([buffer.0], [peer_buffer_address.0], [length.0]);
        Ok(self.sync(py, target_hostname, dir, &b, &a, &l))
    }

    /// One batch of writes: it resolves only once every write in it has
    /// quiesced, whatever its code.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        transport_hint: &str,
    ) -> i32 {
        let _ = transport_hint;
        let (b, a, l) = (buffers, peer_buffer_addresses, lengths);
        self.sync(py, target_hostname, Direction::Write, &b, &a, &l)
    }

    /// One batch of reads.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        transport_hint: &str,
    ) -> i32 {
        let _ = transport_hint;
        let (b, a, l) = (buffers, peer_buffer_addresses, lengths);
        self.sync(py, target_hostname, Direction::Read, &b, &a, &l)
    }

    /// One batch in direction `opcode`.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        opcode: &Bound<'_, PyAny>,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        refuse_notify(notify)?;
        let dir = direction(opcode)?;
        let (b, a, l) = (buffers, peer_buffer_addresses, lengths);
        Ok(self.sync(py, target_hostname, dir, &b, &a, &l))
    }

    /// Starts a batch in direction `opcode` and returns its id at once (0:
    /// it could not start). Its buffers stay the batch's until
    /// `get_batch_transfer_status` reports it.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        opcode: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let _ = transport_hint;
        let dir = direction(opcode)?;
        let (b, a, l) = (buffers, peer_buffer_addresses, lengths);
        Ok(self.submit(py, target_hostname, dir, &b, &a, &l))
    }

    /// `batch_transfer_async` of writes.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let (b, a, l) = (buffers, peer_buffer_addresses, lengths);
        self.submit(py, target_hostname, Direction::Write, &b, &a, &l)
    }

    /// `batch_transfer_async` of reads.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Words,
        peer_buffer_addresses: Words,
        lengths: Words,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let (b, a, l) = (buffers, peer_buffer_addresses, lengths);
        self.submit(py, target_hostname, Direction::Read, &b, &a, &l)
    }

    /// Waits for every batch in `batch_ids`: 0 if all completed, -1 if any
    /// failed (and none is unknown), -2 if any ended with completion
    /// unknown (its memory pinned until `wait_for_quiescence()` returns 0).
    /// A reported batch answers its code again to a later status call (the
    /// last 4,096 reported; -2 for one reported longer ago, never -1: its
    /// memory may be pinned). An id never issued is -1.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> i32 {
        let Some(node) = self.not_ready() else {
            return SYNC_FAILED;
        };
        py.detach(|| node.wait_all(&batch_ids, STATUS_WAIT))
    }

    /// Starts one write and returns its id, or 0 if it could not start
    /// (Mooncake's sentinel: its ids are unsigned); poll it with
    /// `transfer_check_status`.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: Word,
        peer_buffer_address: Word,
        length: Word,
        transport_hint: &str,
    ) -> u64 {
        let _ = transport_hint;
        let (b, a, l) = ([buffer.0], [peer_buffer_address.0], [length.0]);
        self.submit(py, target_hostname, Direction::Write, &b, &a, &l)
    }

    /// Mooncake's codes: 1 completed, 0 still running, -1 failed (nothing
    /// touches the buffer any more). -2 is quiesce's completion unknown
    /// where Mooncake's is its TIMEOUT: either way not done — here the
    /// buffer stays pinned until `wait_for_quiescence()` returns 0. A
    /// reported batch (1, -1 or -2) answers the same again (the last
    /// 4,096 reported; -2 for one longer ago); an id never issued is -1.
    fn transfer_check_status(&self, py: Python<'_>, batch_id: u64) -> i32 {
        let Some(node) = self.not_ready() else {
            return SYNC_FAILED;
        };
        // Without the GIL, as Mooncake's: it may wait for the batches'
        // lock and ask the engine's thread about a -2 batch.
        match py.detach(|| node.progress(batch_id, Duration::ZERO)) {
            Progress::Running => 0,
            Progress::Done(SYNC_OK) => 1,
            Progress::Done(c) => c,
            Progress::Unknown => complain(&format!("transfer_check_status: no batch {batch_id}")),
        }
    }

    /// A zeroed, page-aligned buffer of `length` bytes, registered for
    /// peers; its address (0 on failure).
    fn allocate_managed_buffer(&self, py: Python<'_>, length: usize) -> usize {
        let Some(node) = self.not_ready() else {
            return 0;
        };
        py.detach(|| {
            let Some(addr) = node.managed.allocate(length) else {
                complain(&format!(
                    "allocate_managed_buffer: cannot allocate {length} bytes"
                ));
                return 0;
            };
            if self.lend_range(addr, length) != SYNC_OK {
                node.managed.free(addr, length);
                return 0;
            }
            addr
        })
    }

    /// Unregisters and frees a managed buffer: 0 once freed, -1 if there is
    /// no such buffer (of that length), -2 if something still holds it — a
    /// peer, a batch of this engine whose outcome is not final (one that
    /// answered -2 and has not drained), or another registration lying in
    /// it (`register_memory` of a range inside it: peers may write there
    /// until `unregister_memory` takes it back): it stays allocated; call
    /// again (after `wait_for_quiescence()` for a -2, or the
    /// `unregister_memory`).
    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: usize, length: usize) -> i32 {
        self.free_managed(py, buffer_addr, length)
    }

    /// Copies `length` bytes of `data` into the managed buffer at
    /// `dest_address`: 0, or -1 outside every managed buffer.
    fn write_bytes_to_buffer(&self, dest_address: usize, src_ptr: &[u8], length: usize) -> i32 {
        let Some(node) = self.not_ready() else {
            return SYNC_FAILED;
        };
        let Some(data) = src_ptr.get(..length) else {
            return complain("write_bytes_to_buffer: length exceeds the data");
        };
        match node.managed.write(dest_address, data) {
            true => SYNC_OK,
            false => complain("write_bytes_to_buffer: the range is not inside a managed buffer"),
        }
    }

    /// The `length` bytes of the managed buffer at `source_address` (a
    /// `ValueError` outside every managed buffer).
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: usize,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let node = self.node_here().map_err(|e| from_sync(py, &e))?;
        let data = node
            .and_then(|n| n.managed.read(source_address, length))
            .ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(
                    "read_bytes_from_buffer: the range is not inside a managed buffer",
                )
            })?;
        Ok(PyBytes::new(py, &data))
    }

    /// The address of the first buffer `segment_name` (`"host:port"`)
    /// registered among those it serves now; 0 if there is none open to
    /// this secret (or the peer cannot be reached).
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> u64 {
        let node = match self.node_here() {
            Ok(Some(n)) => n,
            Ok(None) => {
                complain("get_first_buffer_address: not initialised");
                return 0;
            }
            Err(e) => {
                complain(&format!("get_first_buffer_address: {e}"));
                return 0;
            }
        };
        py.detach(|| node.first_buffer(segment_name))
            .unwrap_or_else(|e| {
                complain(&format!("get_first_buffer_address: {e}"));
                0
            })
    }

    /// Whether the peer `peer_server_name` — a session name, found as a
    /// transfer finds it (`"host:port"`, or a name in etcd) — answers a
    /// hello within 2 s (a connection of its own, closed after; before
    /// `initialize`, whether it accepts a connection): 0 if so, -1
    /// otherwise. As Mooncake's probe, an answer is needed: the kernel
    /// accepts connections for a stopped process too.
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> i32 {
        let node = match self.node_here() {
            Ok(n) => n,
            Err(e) => return complain(&format!("send_probe: {e}")),
        };
        py.detach(|| {
            let addr = match &node {
                Some(node) => node.peer(peer_server_name),
                // Before `initialize` only an address can be probed.
                None => peer_server_name
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| format!("cannot resolve {peer_server_name:?}")),
            };
            let addr = match addr {
                Ok(a) => a,
                Err(e) => return complain(&format!("send_probe: {e}")),
            };
            let answered = match &node {
                Some(node) => node
                    .engine()
                    .probe(addr, PROBE_WAIT)
                    .map(drop)
                    .map_err(|e| e.to_string()),
                None => TcpStream::connect_timeout(&addr, PROBE_WAIT)
                    .map(drop)
                    .map_err(|e| e.to_string()),
            };
            match answered {
                Ok(()) => SYNC_OK,
                Err(e) => complain(&format!("send_probe {peer_server_name} ({addr}): {e}")),
            }
        })
    }

    /// Waits up to `timeout` seconds for the batches that returned -2 to
    /// drain; returns how many have not (0: no memory of any is pinned any
    /// more). Raises `QuiesceError` in a forked child of the process that
    /// initialised the engine: the batches are the parent's to wait for.
    #[pyo3(signature = (timeout = 30.0))]
    fn wait_for_quiescence(&self, py: Python<'_>, timeout: f64) -> PyResult<usize> {
        let Some(node) = self.node_here().map_err(|e| from_sync(py, &e))? else {
            return Ok(0);
        };
        let t = seconds(timeout);
        Ok(py.detach(|| node.quiesce_pending(t)))
    }
}
