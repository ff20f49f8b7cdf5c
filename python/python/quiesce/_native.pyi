from typing import Any, Callable, ClassVar, List, Optional, Tuple

SECRET_ENV: str
OPEN_CLUSTER_ENV: str
LOG_ENV: str
DEFAULT_LOG_FILTER: str

def set_log_filter(directives: str) -> None:
    """Which Rust-side events are made: ``tracing-subscriber`` ``Targets``
    directives, as ``QUIESCE_LOG`` (``"warn"``, ``"info"``,
    ``"quiesce_batch=debug,warn"``). ``ValueError`` if they do not parse;
    ``RuntimeError`` if another tracing subscriber handles this process's
    events."""

def next_log_records(timeout: Optional[float] = None) -> Optional[List[Tuple[int, str, str]]]:
    """Waits (GIL released) for queued log records: ``(level, logger name,
    message)``; empty if ``timeout`` passed first, ``None`` once the queue
    closed and is empty."""

def close_log_records() -> List[Tuple[int, str, str]]:
    """Closes the log queue (later records go to stderr); returns what it held."""

def hold_log_records_for_fork() -> None:
    """Takes the log queue's lock before ``os.fork()`` (no engine thread holds
    it when the process is copied)."""

def release_log_records_after_fork(child: bool) -> None:
    """Releases it after the fork; in the child, empties the queue and opens
    it for the child's log thread."""

class TransferOpcode:
    """Mooncake's opcode: ``TransferOpcode.Read`` (0), ``.Write`` (1), or
    ``TransferOpcode(0|1)``; compares equal to its int and converts with
    ``int()``."""

    Read: ClassVar["TransferOpcode"]
    Write: ClassVar["TransferOpcode"]
    def __init__(self, value: int) -> None: ...
    def __int__(self) -> int: ...
    def __hash__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class TransferEngine:
    """Mooncake's TransferEngine; codes: 0 completed, -1 failed (nothing
    touches your memory any more), -2 completion unknown (memory pinned until
    wait_for_quiescence() returns 0)."""

    TransferOpcode: type[TransferOpcode]

    def __init__(self) -> None: ...
    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int: ...
    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def get_first_buffer_address(self, segment_name: str) -> int: ...
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int: ...
    def unregister_memory(self, buffer_addr: int) -> int: ...
    def batch_register_memory(
        self, buffer_addresses: List[int], capacities: List[int], location: str = "*"
    ) -> int: ...
    def batch_unregister_memory(self, buffer_addresses: List[int]) -> int: ...
    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: TransferOpcode | int,
        notify: Optional[object] = None,
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
        opcode: TransferOpcode | int,
        notify: Optional[object] = None,
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
        opcode: TransferOpcode | int,
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
        transport_hint: str = "",
    ) -> int: ...
    def get_batch_transfer_status(self, batch_ids: List[int]) -> int: ...
    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_check_status(self, batch_id: int) -> int: ...
    def allocate_managed_buffer(self, length: int) -> int: ...
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int: ...
    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int: ...
    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes: ...
    def send_probe(self, peer_server_name: str) -> int: ...
    def wait_for_quiescence(self, timeout: float = 30.0) -> int: ...

# The native API's Rust half; use quiesce.Engine / quiesce.Batch instead.
# Report: (code, [(status, reason, bytes, attempts, remote)], remote_confirmed, ticket)
Report = Tuple[int, List[Tuple[str, Optional[str], int, int, str]], bool, Optional[int]]

class NativeBatch:
    def __init__(self) -> None: ...
    def add(
        self, write: bool, buffer: Any, segment: int, segment_len: int, offset: int
    ) -> int: ...
    def __len__(self) -> int: ...
    def ran(self) -> Optional[Report]: ...

class NativeEngine:
    def __init__(
        self,
        listen: str,
        secret_bytes: Optional[bytes] = None,
        open_cluster: bool = False,
        transport: str = "tcp",
        device: Optional[str] = None,
        directory: Optional[str] = None,
        node: Optional[str] = None,
    ) -> None: ...
    @property
    def address(self) -> str: ...
    def lend(self, name: str, buffer: Any) -> Tuple[int, int, int]: ...
    def reclaim(self, address: int, timeout: float, segment: int | None = None) -> bool: ...
    def open(self, peer: str, name: str) -> Tuple[int, int, int]: ...
    def run(self, batch: NativeBatch, policy: str, deadline: float) -> Report: ...
    def submit(
        self,
        batch: NativeBatch,
        policy: str,
        deadline: float,
        callback: Callable[[Optional[Report], bool], None],
    ) -> None: ...
    def wait(self, ticket: int, timeout: float) -> Optional[Report]: ...
    def pending(self) -> List[int]: ...
    def wait_for_quiescence(self, timeout: float) -> bool: ...
    def close(self) -> bool: ...
