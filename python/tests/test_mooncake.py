"""quiesce.mooncake.TransferEngine used as vLLM and SGLang use Mooncake's,
against targets in other processes (tests/peer.py)."""

import ctypes
import threading
import time

import pytest

from conftest import engine, logged, runs_ok, seed_round
from quiesce.mooncake import TransferEngine, TransferOpcode

MiB = 1 << 20


def test_vllm_call_sequence(peer_factory, local):
    """vLLM's MooncakeConnector: initialize, get_rpc_port,
    batch_register_memory, batch_transfer_sync_write to "host:port"."""
    target = peer_factory(4 * MiB, 4 * MiB)
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    port = e.get_rpc_port()
    assert 0 < port < 65536
    srcs = [local.buffer(256 << 10, 0x10 + i) for i in range(4)]
    assert e.batch_register_memory(srcs, [256 << 10] * 4) == 0
    (a, _), (b, _) = target.regions
    dsts = [a, a + (1 << 20), b + 4096, b + (3 << 20)]
    ret = e.batch_transfer_sync_write(target.session, srcs, dsts, [256 << 10] * 4)
    assert ret == 0
    for i, d in enumerate(dsts):
        assert target.count(d, 256 << 10, 0x10 + i) == 256 << 10
    assert target.count(a + (256 << 10), 4096, 0) == 4096, "bytes outside the ranges"
    assert e.batch_unregister_memory(srcs) == 0


def test_read_mirror(peer_factory, local):
    target = peer_factory(MiB)
    (a, n) = target.regions[0]
    target.fill(a, n, 0x7E)
    e = engine()
    dst = local.buffer(64 << 10)
    assert e.transfer_sync_read(target.session, dst, a + 4096, 64 << 10) == 0
    import ctypes

    assert ctypes.string_at(dst, 64 << 10) == b"\x7e" * (64 << 10)


def test_a_call_with_more_entries_than_a_native_batch_holds(peer_factory, local):
    """Mooncake takes a batch of any length; vLLM and SGLang pass one entry
    per KV block and layer, past the native batch's 4,096 tasks on long
    prompts (which answered -1, "batch is full")."""
    n, size = 10_000, 512
    target = peer_factory(n * size)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(n * size, 0x5A)
    assert e.register_memory(src, n * size) == 0
    offsets = [i * size for i in range(n)]
    srcs = [src + o for o in offsets]
    dsts = [a + o for o in offsets]
    assert e.batch_transfer_sync_write(target.session, srcs, dsts, [size] * n) == 0
    assert target.count(a, n * size, 0x5A) == n * size
    ctypes.memset(src, 0x3C, n * size)
    bid = e.batch_transfer_async_write(target.session, srcs, dsts, [size] * n)
    assert bid > 0
    assert e.get_batch_transfer_status([bid]) == 0
    assert target.count(a, n * size, 0x3C) == n * size
    back = local.buffer(n * size)
    backs = [back + o for o in offsets]
    assert e.batch_transfer_sync_read(target.session, backs, dsts, [size] * n) == 0
    assert ctypes.string_at(back, n * size) == b"\x3c" * (n * size)


def test_a_refused_entry_fences_a_call_of_ten_thousand(peer_factory, local):
    """The seed scenario at that size: one entry the target refuses among
    10,000 valid ones. -1 means the fence covered every one of them: the
    sources rewritten at once never reach the target."""
    n, size = 10_000, 4096
    target = peer_factory(4096, n * size)
    (small, _), (big, _) = target.regions
    e = engine()
    probe = local.buffer(4096, 1)
    src = local.buffer(n * size)
    assert e.transfer_sync_write(target.session, probe, small, 4096) == 0
    assert target.ask(f"unregister {small}") == "0"
    target.fill(big, n * size, 0)
    ctypes.memset(src, 0xAA, n * size)
    srcs = [probe] + [src + i * size for i in range(n)]
    dsts = [small] + [big + i * size for i in range(n)]
    assert e.batch_transfer_sync_write(target.session, srcs, dsts, [size] * (n + 1)) == -1
    ctypes.memset(src, 0xBB, n * size)
    time.sleep(0.1)
    assert target.count(big, n * size, 0xBB) == 0


def test_seed_scenario_minus_one_means_nothing_touches_the_source(peer_factory, local):
    """[a 4 KiB write the target refuses, a valid 64 MiB write]: -1, and the
    source rewritten at once never shows up at the target (Mooncake 0.3.13:
    50 of 50 rounds still reading the source after -1)."""
    target = peer_factory(4096, 64 * MiB)
    (small, _), (big, _) = target.regions
    e = engine()
    probe = local.buffer(4096, 1)
    src = local.buffer(64 * MiB)
    corrupted = 0
    rounds = 50
    for _ in range(rounds):
        # The small range is opened (cached), then withdrawn by the target:
        # its next write is refused there.
        assert e.transfer_sync_write(target.session, probe, small, 4096) == 0
        assert target.ask(f"unregister {small}") == "0"
        corrupted += seed_round(e, target, probe, src, small, big, 64 * MiB)
        assert target.ask(f"register {small} 4096") == "0"
    assert corrupted == 0, f"{corrupted}/{rounds} rounds had bytes written after -1"


def test_overlapping_ranges_open_the_one_reaching_furthest(peer_factory, local):
    """A target registers a small range, then one around it (one token, as
    every range of a node has): a write from inside the small range that
    runs past its end lands in the larger one."""
    target = peer_factory(2 * MiB)
    (a, _) = target.regions[0]
    assert target.ask(f"unregister {a}") == "0"
    assert target.ask(f"register {a + 16384} 4096") == "0"
    assert target.ask(f"register {a} {2 * MiB}") == "0"
    e = engine()
    src = local.buffer(8192, 0x5A)
    assert e.transfer_sync_write(target.session, src, a + 16384 + 100, 8192) == 0
    assert target.count(a + 16384 + 100, 8192, 0x5A) == 8192


def test_a_range_registered_again_larger_is_written_past_its_old_end(peer_factory, local):
    """The initiator keeps the ranges it opened. The target withdraws one
    and registers a larger one at the same address: a write past the old
    end goes to the new range, not refused by the kept one."""
    target = peer_factory(2 * MiB)
    (a, _) = target.regions[0]
    assert target.ask(f"unregister {a}") == "0"
    assert target.ask(f"register {a} {MiB}") == "0"
    e = engine()
    src = local.buffer(MiB, 0x3C)
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    assert target.ask(f"unregister {a}") == "0"
    assert target.ask(f"register {a} {2 * MiB}") == "0"
    assert e.transfer_sync_write(target.session, src, a + MiB // 2, MiB) == 0
    assert target.count(a + MiB // 2, MiB, 0x3C) == MiB


def test_sixteen_threads_at_once(peer_factory, local):
    """SGLang fans batch_transfer_sync_write out on a thread pool."""
    target = peer_factory(16 * MiB)
    (a, _) = target.regions[0]
    e = engine()
    chunk = 64 << 10
    srcs = [[local.buffer(chunk, 1 + t) for _ in range(4)] for t in range(16)]
    codes = []

    def work(t):
        for it in range(10):
            base = a + t * MiB
            dsts = [base + k * chunk for k in range(4)]
            codes.append(e.batch_transfer_sync_write(target.session, srcs[t], dsts, [chunk] * 4))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert codes == [0] * 160
    for t in range(16):
        assert target.count(a + t * MiB, 4 * chunk, 1 + t) == 4 * chunk


def test_bad_input_is_a_clear_code_and_loses_nothing(peer_factory, local, monkeypatch):
    target = peer_factory(MiB)
    (a, n) = target.regions[0]
    e = TransferEngine()
    buf = local.buffer(4096, 9)
    assert e.transfer_sync_write(target.session, buf, a, 4096) == -1, "before initialize"
    assert e.get_rpc_port() == -1
    monkeypatch.delenv("QUIESCE_SECRET")
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1, "no secret"
    monkeypatch.setenv("QUIESCE_SECRET", "short")
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1, "short secret"
    monkeypatch.setenv("QUIESCE_SECRET", "pytest: a secret every peer of this suite shares")
    assert e.initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1, "twice"
    s = target.session
    assert e.transfer_sync_write(s, buf, a + n + 4096, 4096) == -1, "unregistered address"
    assert e.transfer_sync_write(s, buf, a + n - 100, 4096) == -1, "crosses the end"
    assert e.transfer_sync_write(s, buf, a, 0) == -1, "zero length"
    assert e.transfer_sync_write(s, 0, a, 4096) == -1, "null buffer"
    assert e.transfer_sync_write("127.0.0.1:1", buf, a, 4096) == -1, "unknown session"
    assert e.transfer_sync_write("no-such-host.invalid:1", buf, a, 4096) == -1
    assert e.batch_transfer_sync_write(s, [buf], [a, a], [4096]) == -1, "counts differ"
    assert e.register_memory(0, 4096) == -1
    assert e.unregister_memory(buf) == -1, "never registered"
    assert target.count(a, n, 0) == n, "a refused write landed"
    # The engine still works.
    assert e.transfer_sync_write(s, buf, a, 4096) == 0
    assert target.count(a, 4096, 9) == 4096


def test_zero_length_entries_among_others_are_no_ops(peer_factory, local):
    """SGLang sends a model's state items in one batch, and an item can be 0
    bytes (a conv-only model's SSM state), with whatever pointer it has.
    Mooncake completes such an entry as a no-op; so does the drop-in. A call
    of nothing but zero lengths is still bad input."""
    target = peer_factory(MiB)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(8192, 0x21)
    s = target.session
    assert e.batch_transfer_sync_write(s, [src, 0, src + 4096], [a, a + 4096, a + 8192], [4096, 0, 4096]) == 0
    assert target.count(a, 4096, 0x21) == 4096
    assert target.count(a + 4096, 4096, 0) == 4096
    assert target.count(a + 8192, 4096, 0x21) == 4096
    bid = e.batch_transfer_async_write(s, [src, src], [a, a], [0, 4096])
    assert bid > 0 and e.get_batch_transfer_status([bid]) == 0
    assert e.batch_transfer_sync_write(s, [src, src], [a, a], [0, 0]) == -1, "nothing to move"


def test_a_batch_of_no_entries_completes(peer_factory, local):
    """Mooncake answers 0 for a batch with no entries (the status of a
    batch of no tasks is COMPLETED), sync or not; a caller that builds its
    lists from the blocks left to send (vLLM's sender) can make one, and -1
    there raises and strands the request. A session whose name does not
    resolve is still -1."""
    target = peer_factory(MiB)
    e = engine()
    s = target.session
    assert e.batch_transfer_sync_write(s, [], [], []) == 0
    assert e.batch_transfer_sync_read(s, [], [], []) == 0
    assert e.batch_transfer_sync(s, [], [], [], TransferOpcode.Write) == 0
    for submit in (e.batch_transfer_async_write, e.batch_transfer_async_read):
        bid = submit(s, [], [], [])
        assert bid > 0
        assert e.get_batch_transfer_status([bid]) == 0
    bid = e.batch_transfer_async(s, [], [], [], TransferOpcode.Read)
    assert bid > 0 and e.transfer_check_status(bid) == 1
    assert e.batch_transfer_sync_write("no-such-host.invalid:1", [], [], []) == -1
    assert e.batch_transfer_async_write("no-such-host.invalid:1", [], [], []) == 0
    assert e.wait_for_quiescence(1.0) == 0


def test_a_failed_batch_is_one_short_warning(peer_factory, local, caplog):
    """Each reason once, with its count: a failed batch of 10,000 entries
    made a warning line naming every entry (5 MB for 262,144)."""
    n = 10_000
    target = peer_factory(4096, n * 64)
    (small, _), (big, _) = target.regions
    e = engine()
    src = local.buffer(n * 64)
    assert e.transfer_sync_write(target.session, src, small, 4096) == 0
    assert target.ask(f"unregister {small}") == "0"
    srcs = [src] + [src + i * 64 for i in range(n)]
    dsts = [small] + [big + i * 64 for i in range(n)]
    caplog.clear()
    assert e.batch_transfer_sync_write(target.session, srcs, dsts, [64] * (n + 1)) == -1
    r = logged(caplog, lambda r: "failed:" in r.getMessage())
    assert r is not None, [x.getMessage() for x in caplog.records]
    assert f"of {n + 1} tasks" in r.getMessage(), r.getMessage()
    assert len(r.getMessage()) < 1000, len(r.getMessage())


def test_mc_force_tcp_makes_an_rdma_engine_a_tcp_one(peer_factory, local, monkeypatch):
    """SGLang's switch: with MC_FORCE_TCP=1 it blanks the device and keeps
    protocol "rdma" (its default), and Mooncake installs TCP."""
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    target = peer_factory(4096)
    (a, _) = target.regions[0]
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    src = local.buffer(4096, 0x33)
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    assert target.count(a, 4096, 0x33) == 4096


def test_rdma_on_a_machine_without_rdma_is_tcp_as_in_mooncake(peer_factory, local, monkeypatch, caplog):
    """vLLM's default protocol is "rdma". Mooncake, finding no RDMA device,
    installs TCP and answers 0 (checked with mooncake-transfer-engine in
    this venv); so does the drop-in, with a warning that says so. A device
    named that is not there is -1."""
    import os

    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has RDMA devices")
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    target = peer_factory(4096)
    (a, _) = target.regions[0]
    e = TransferEngine()
    caplog.clear()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    r = logged(caplog, lambda r: "using TCP" in r.getMessage())
    assert r is not None and r.levelname == "WARNING", [x.getMessage() for x in caplog.records]
    src = local.buffer(4096, 0x34)
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    assert target.count(a, 4096, 0x34) == 4096
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_9") == -1


def test_addresses_and_lengths_are_ints_of_at_most_64_bits(peer_factory, local):
    """Addresses and lengths are read as Mooncake's binding reads them:
    any non-negative int of 64 bits (a list or a tuple of them in the batch
    calls, NumPy integers too); anything else raises before a transfer
    starts, and nothing lands."""
    np = pytest.importorskip("numpy")
    target = peer_factory(MiB)
    (a, n) = target.regions[0]
    e = engine()
    buf = local.buffer(4096, 0x31)
    s = target.session
    assert e.transfer_sync_write(s, np.uint64(buf), np.int64(a), np.uint32(4096)) == 0
    assert target.count(a, 4096, 0x31) == 4096
    buf2 = local.buffer(4096, 0x32)
    assert e.batch_transfer_sync_write(s, (buf2,), (a + 4096,), (4096,)) == 0
    assert e.batch_transfer_sync_write(s, [np.uint64(buf2)], np.array([a + 8192]), [4096]) == 0
    assert target.count(a + 4096, 8192, 0x32) == 8192
    for bad, kind in [
        (-1, OverflowError),
        (1 << 64, OverflowError),
        (4096.0, TypeError),
        ("4096", TypeError),
    ]:
        with pytest.raises(kind):
            e.transfer_sync_write(s, buf, a + 16384, bad)
        with pytest.raises(kind):
            e.transfer_sync_write(s, bad, a + 16384, 4096)
        with pytest.raises(kind):
            e.batch_transfer_sync_write(s, [buf], [bad], [4096])
    with pytest.raises(TypeError):
        e.batch_transfer_sync_write(s, "abc", [a], [4096])
    # (1 << 64) - 1 is a 64-bit value: read exactly (and refused as an
    # address outside every segment, not mistaken for an error marker).
    assert e.transfer_sync_write(s, buf, (1 << 64) - 1, 4096) == -1
    assert target.count(a + 16384, n - 16384, 0) == n - 16384, "a refused call landed"


def test_memory_this_process_cannot_read_and_write_is_not_registered(local, caplog):
    """A GPU pointer handed to the TCP drop-in (vLLM's KV caches live on the
    device) is a reserved, inaccessible range in this process: registering
    it is -1 with a message that says so, rather than 0 and a crash at the
    first transfer (the process died in the copy of a 4 KiB write from it)."""
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    private_anonymous = 0x22
    n = 1 << 20
    reserved = libc.mmap(None, n, 0, private_anonymous, -1, 0)  # PROT_NONE
    read_only = libc.mmap(None, n, 1, private_anonymous, -1, 0)  # PROT_READ
    assert reserved not in (None, ctypes.c_void_p(-1).value)
    assert read_only not in (None, ctypes.c_void_p(-1).value)
    e = engine()
    assert e.register_memory(reserved, n) == -1
    assert e.register_memory(read_only, n) == -1
    assert e.batch_register_memory([local.buffer(n), reserved], [n, n]) == -1
    ok = local.buffer(n)
    assert e.register_memory(ok, n) == 0
    assert e.unregister_memory(ok) == 0
    assert logged(caplog, lambda r: "not memory this process can read and write" in r.getMessage())


def ipv6_loopback():
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("hostname", ["::1", "[::1]", "[::1]:0"])
def test_an_ipv6_host_as_sglang_writes_it(hostname, local):
    """SGLang builds session ids with NetworkAddress(...).to_host_port_str(),
    "[::1]:port", and may pass the host bracketed to initialize."""
    t = TransferEngine()
    assert t.initialize(hostname, "P2PHANDSHAKE", "tcp", "") == 0
    dst = local.buffer(4096)
    assert t.register_memory(dst, 4096) == 0
    e = engine()
    src = local.buffer(4096, 0x61)
    assert e.transfer_sync_write(f"[::1]:{t.get_rpc_port()}", src, dst, 4096) == 0
    assert ctypes.string_at(dst, 4096) == b"\x61" * 4096
    for bad in ("[::1", "[::1]x", "[::1]:port"):
        assert TransferEngine().initialize(bad, "P2PHANDSHAKE", "tcp", "") == -1, bad


BAD_LOCAL_CODE = """
import ctypes, sys
from quiesce.mooncake import TransferEngine, TransferOpcode
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
n = 1 << 20
reserved = libc.mmap(None, n, 0, 0x22, -1, 0)  # PROT_NONE: a GPU pointer's look here
read_only = libc.mmap(None, n, 1, 0x22, -1, 0)
t = TransferEngine(); assert t.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
dst = ctypes.create_string_buffer(n); assert t.register_memory(ctypes.addressof(dst), n) == 0
e = TransferEngine(); assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
s = f"127.0.0.1:{t.get_rpc_port()}"
d = ctypes.addressof(dst)
ok = ctypes.create_string_buffer(b"\\x44" * 4096, 4096)
codes = [
    e.transfer_sync_write(s, reserved, d, 4096),
    e.transfer_sync_write(s, reserved, d, n),
    e.batch_transfer_sync_write(s, [ctypes.addressof(ok), reserved], [d, d + 4096], [4096, 4096]),
    e.transfer_sync_read(s, read_only, d, 4096),
    e.transfer_sync_read(s, reserved + n - 2048, d, 4096),
]
assert dst.raw[:8192] == bytes(8192), "a refused batch moved bytes"
codes.append(e.transfer_sync_write(s, ctypes.addressof(ok), d, 4096))
# A write's source need only be readable (a read-only file mapping).
codes.append(e.transfer_sync_write(s, read_only, d + 8192, 4096))
print(codes, flush=True)
"""


def test_a_local_buffer_this_process_cannot_touch_is_refused_not_a_crash():
    """SGLang ignores a failed registration and then transfers from the same
    GPU pointers: the drop-in copied from them and the process died
    (SIGSEGV). A local source or destination that is not memory this
    process may read and write is now -1, and the engine goes on. A
    write's source need only be readable: one from a read-only mapping
    was refused too."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", BAD_LOCAL_CODE], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.strip() == "[-1, -1, -1, -1, -1, 0, 0]", out.stdout + out.stderr[-2000:]


def test_another_secret_opens_nothing(peer_factory, local, monkeypatch):
    target = peer_factory(MiB)
    (a, _) = target.regions[0]
    monkeypatch.setenv("QUIESCE_SECRET", "a different secret, also 16+ bytes")
    e = engine()
    buf = local.buffer(4096, 3)
    assert e.transfer_sync_write(target.session, buf, a, 4096) == -1
    assert target.count(a, 4096, 0) == 4096


def test_get_first_buffer_address(peer_factory, local, monkeypatch):
    """The peer's first registered buffer, as Mooncake's callers locate a
    peer's memory; the next one once it is withdrawn; 0 when nothing is open
    to this engine."""
    target = peer_factory(MiB, 64 << 10)
    (a, _), (b, _) = target.regions
    e = engine()
    assert e.get_first_buffer_address(target.session) == a
    buf = local.buffer(4096, 4)
    assert e.transfer_sync_write(target.session, buf, a + 4096, 4096) == 0
    assert target.count(a + 4096, 4096, 4) == 4096
    assert target.ask(f"unregister {a}") == "0"
    assert e.get_first_buffer_address(target.session) == b
    assert e.get_first_buffer_address("127.0.0.1:1") == 0
    monkeypatch.setenv("QUIESCE_SECRET", "a different secret, also 16+ bytes")
    assert engine().get_first_buffer_address(target.session) == 0
    assert TransferEngine().get_first_buffer_address(target.session) == 0


def test_the_opcode_is_built_from_its_int_as_in_mooncake():
    """Mooncake's pybind11 enum: TransferOpcode(1) is Write, and it converts
    to and compares with its int."""
    assert TransferOpcode(1) == TransferOpcode.Write
    assert TransferOpcode(0) == TransferOpcode.Read
    assert int(TransferOpcode.Write) == 1 and TransferOpcode.Read == 0
    assert TransferEngine.TransferOpcode(1) == TransferOpcode.Write
    with pytest.raises(ValueError):
        TransferOpcode(2)
    # Hashable as pybind11's enums are (it had __hash__ None: a dict or a
    # set of opcodes raised TypeError), and named.
    assert hash(TransferOpcode.Write) == hash(1)
    assert {TransferOpcode.Read: "r"}[TransferOpcode(0)] == "r"
    assert TransferOpcode.Write in {TransferOpcode.Write, TransferOpcode.Read}
    assert (TransferOpcode.Write.name, TransferOpcode.Write.value) == ("Write", 1)


FORKED_ENGINE_CODE = """
import os, sys, time
import quiesce
from quiesce.mooncake import TransferEngine

e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = e.allocate_managed_buffer(4096)
assert buf
region = bytearray(4096)
import ctypes
reg = ctypes.addressof((ctypes.c_char * 4096).from_buffer(region))
assert e.register_memory(reg, 4096) == 0
# The parent's own session answers every call below in the parent (checked
# after the child), so each -1 or 0 in the child is the fork's refusal.
me = f"127.0.0.1:{e.get_rpc_port()}"
pid = os.fork()
if pid == 0:
    # The engine's thread is the parent's: nothing here serves this call.
    code = e.transfer_sync_write(me, buf, reg, 8)
    # Taking memory back waits for nothing the parent's engine would send.
    t0 = time.monotonic()
    codes = (code, e.unregister_memory(reg), e.free_managed_buffer(buf, 4096))
    # Every other call answers its failure too, before taking any lock a
    # parent's thread may have held at the fork.
    codes += (e.send_probe(me), e.get_first_buffer_address(me))
    for call in (lambda: e.read_bytes_from_buffer(buf, 8), lambda: e.wait_for_quiescence(1.0)):
        try:
            codes += (call(),)
        except quiesce.QuiesceError as err:
            codes += ("forked" in str(err),)
    took = time.monotonic() - t0
    print("child", codes, took, flush=True)
    ok = codes == (-1, -1, -1, -1, 0, True, True) and took < 5
    sys.exit(0 if ok else 3)  # an interpreter exit drops the engine
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
# The parent's engine is untouched, and answers what the child could not.
assert e.send_probe(me) == 0
assert e.get_first_buffer_address(me) != 0
assert e.transfer_sync_write(me, buf, reg, 8) == 0
assert e.transfer_sync_write("127.0.0.1:1", buf, 0x1000, 8) == -1
assert e.free_managed_buffer(buf, 4096) == 0
assert e.unregister_memory(reg) == 0
print("ok", flush=True)
"""


def test_an_engine_used_in_a_forked_child_answers_minus_1():
    """A forked child has none of the parent's threads, the engine's among
    them: a call there answers -1 at once (nothing started; the parent's
    engine is not its to use), and the child's exit does not wait for the
    thread. It hung in the call, and again dropping the engine."""
    runs_ok(FORKED_ENGINE_CODE, 0, timeout=60)
