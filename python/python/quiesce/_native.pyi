from typing import List

SECRET_ENV: str
OPEN_CLUSTER_ENV: str

class TransferEngine:
    """Mooncake's TransferEngine; codes: 0 completed, -1 failed (nothing
    touches your memory any more), -2 completion unknown (memory pinned until
    wait_for_quiescence() returns 0)."""

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
    def register_memory(self, addr: int, capacity: int) -> int: ...
    def unregister_memory(self, addr: int) -> int: ...
    def batch_register_memory(self, addrs: List[int], capacities: List[int]) -> int: ...
    def batch_unregister_memory(self, addrs: List[int]) -> int: ...
    def transfer_sync_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int
    ) -> int: ...
    def transfer_sync_read(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int
    ) -> int: ...
    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
    ) -> int: ...
    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: List[int],
        peer_buffer_addresses: List[int],
        lengths: List[int],
    ) -> int: ...
    def wait_for_quiescence(self, timeout: float = 30.0) -> int: ...
