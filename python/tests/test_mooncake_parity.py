"""Where the drop-in follows Mooncake's binding in the calls around the
transfers — set-up, registration, probing, the single-write id — each
checked against what `transfer_engine_py.cpp` and `transfer_engine_impl.cpp`
do (kvcache-ai/Mooncake 3b5a594)."""

import signal
import time

from conftest import engine
from quiesce.mooncake import TransferEngine


def test_initialize_ext_with_a_p2p_server_is_p2p_whatever_the_type(peer_factory, local):
    """Mooncake's `buildConnString`: a server of "P2PHANDSHAKE" is P2P
    whatever `metadata_type` says ("etcd" is its default type)."""
    target = peer_factory(4096)
    (a, _) = target.regions[0]
    e = TransferEngine()
    assert e.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "etcd") == 0
    src = local.buffer(4096, 0x21)
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    assert target.count(a, 4096, 0x21) == 4096
    # A scheme quiesce has no directory for is still refused, with a reason.
    assert TransferEngine().initialize_ext("127.0.0.1", "127.0.0.1:1", "tcp", "", "redis") == -1


def test_transfer_submit_write_answers_0_when_nothing_started(peer_factory, local):
    """Mooncake's `transferSubmitWrite` returns a `batch_id_t` (unsigned),
    0 being its failure sentinel; -1 would make a caller's
    `transfer_check_status(id)` raise on the negative id."""
    target = peer_factory(4096)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(4096, 1)
    assert e.transfer_submit_write(target.session, src, a, 0) == 0, "zero length"
    assert e.transfer_submit_write("127.0.0.1:1", src, a, 4096) == 0, "unknown session"
    assert e.transfer_submit_write(target.session, src, a + 8192, 4096) == 0, "out of bounds"
    wid = e.transfer_submit_write(target.session, src, a, 4096)
    assert wid > 0
    deadline = time.monotonic() + 10
    while e.transfer_check_status(wid) == 0 and time.monotonic() < deadline:
        pass
    assert e.transfer_check_status(wid) == 1


def test_batch_register_memory_is_all_or_nothing(local):
    """Mooncake's `registerLocalMemoryBatch` registers every range or none
    (it rolls back what it registered when one fails): a range left
    registered by a failed call would make the caller's retry fail as
    "already registered"."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    n = 1 << 16
    reserved = libc.mmap(None, n, 0, 0x22, -1, 0)  # PROT_NONE: refused
    e = engine()
    good = [local.buffer(n), local.buffer(n)]
    assert e.batch_register_memory([good[0], reserved, good[1]], [n, n, n]) == -1
    # None of the call's ranges stayed registered: a retry of the good ones works.
    assert e.batch_register_memory(good, [n, n]) == 0
    assert e.batch_unregister_memory(good) == 0
    # The same range twice in one call: refused whole, nothing left behind.
    assert e.batch_register_memory([good[0], good[0]], [n, n]) == -1
    assert e.register_memory(good[0], n) == 0
    assert e.unregister_memory(good[0]) == 0


def test_send_probe_needs_an_answer_not_only_a_connection(peer_factory):
    """SGLang takes a session off its failed list when `send_probe` answers
    0. Mooncake's probe is a request its peer must answer; a connection
    alone is accepted by the kernel for a stopped (or wedged) process too."""
    target = peer_factory(4096)
    e = engine()
    assert e.send_probe(target.session) == 0
    target.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert e.send_probe(target.session) == -1, "a stopped peer answered the probe"
        assert time.monotonic() - t0 < 5
    finally:
        target.signal(signal.SIGCONT)
    assert e.send_probe(target.session) == 0
