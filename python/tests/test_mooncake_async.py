"""The rest of Mooncake's surface: opcodes, asynchronous batches and their
status, managed buffers, probes."""

import ctypes
import signal
import time

from conftest import answers_after_resume, engine, logged, stopped_target
from quiesce.mooncake import TransferEngine, TransferOpcode

MiB = 1 << 20


def test_opcodes_as_enum_and_int(peer_factory, local):
    target = peer_factory(MiB)
    (a, _) = target.regions[0]
    e = engine()
    assert TransferEngine.TransferOpcode.Write == TransferOpcode.Write
    src = local.buffer(4096, 0x31)
    assert e.transfer_sync(target.session, src, a, 4096, TransferEngine.TransferOpcode.Write) == 0
    assert e.transfer_sync(target.session, src, a + 4096, 4096, 1) == 0
    assert target.count(a, 8192, 0x31) == 8192
    dst = local.buffer(8192)
    ret = e.batch_transfer_sync(
        target.session, [dst, dst + 4096], [a, a + 4096], [4096, 4096], TransferOpcode.Read
    )
    assert ret == 0
    assert ctypes.string_at(dst, 8192) == b"\x31" * 8192
    try:
        e.transfer_sync(target.session, src, a, 4096, 7)
        raise AssertionError("opcode 7 accepted")
    except ValueError:
        pass


def test_a_finished_async_batch_does_not_hold_its_range_until_its_status_is_read(
    peer_factory, local
):
    """unregister_memory waits for this engine's batches on the range; an
    asynchronous batch that finished holds nothing, read or not: the call
    answers at once, and the batch's status is still there to read."""
    target = peer_factory(MiB)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(MiB, 0x24)
    assert e.register_memory(src, MiB) == 0
    bid = e.batch_transfer_async_write(target.session, [src], [a], [MiB])
    assert bid != 0
    time.sleep(0.5)
    t0 = time.monotonic()
    assert e.unregister_memory(src) == 0
    assert time.monotonic() - t0 < 5, "waited for a batch that had finished"
    assert e.get_batch_transfer_status([bid]) == 0
    assert target.count(a, MiB, 0x24) == MiB


def test_a_drained_async_minus_two_does_not_hold_its_range_until_its_status_is_read(
    peer_factory, local, monkeypatch, caplog
):
    """An asynchronous batch that gave -2 (its target stopped past the
    deadline) and drained since (the target resumed) touches nothing any
    more: unregister_memory of its source answers 0 without a status call
    first, and the status call after it reports the drained outcome."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    target = peer_factory(64 * MiB)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(64 * MiB, 0x25)
    assert e.register_memory(src, 64 * MiB) == 0
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    target.signal(signal.SIGSTOP)
    bid = e.batch_transfer_async_write(target.session, [src], [a], [64 * MiB])
    assert bid != 0
    # Past the 5 s deadline and the fence's grace: the batch has said -2,
    # and nobody asked.
    time.sleep(8)
    unknown = logged(caplog, lambda r: "CompletionUnknown" in r.getMessage(), timeout=5)
    assert unknown, "the batch did not answer -2 while the target was stopped"
    target.signal(signal.SIGCONT)
    time.sleep(1)
    t0 = time.monotonic()
    assert e.unregister_memory(src) == 0
    assert time.monotonic() - t0 < 10, "waited for a -2 batch that had drained"
    assert e.get_batch_transfer_status([bid]) in (0, -1)
    assert e.wait_for_quiescence(0) == 0


def test_async_batches_and_their_status(peer_factory, local):
    target = peer_factory(4 * MiB)
    (a, _) = target.regions[0]
    e = engine()
    srcs = [local.buffer(MiB, 0x40 + i) for i in range(4)]
    ids = [
        e.batch_transfer_async_write(target.session, [srcs[i]], [a + i * MiB], [MiB])
        for i in range(2)
    ]
    ids.append(
        e.batch_transfer_async(
            target.session, srcs[2:], [a + 2 * MiB, a + 3 * MiB], [MiB, MiB], TransferOpcode.Write
        )
    )
    assert all(i > 0 for i in ids) and len(set(ids)) == 3
    assert e.get_batch_transfer_status(ids) == 0
    for i in range(4):
        assert target.count(a + i * MiB, MiB, 0x40 + i) == MiB
    # Reported ids answer their code again (-1 for a -2 another call took
    # would say its pinned memory is free).
    assert e.get_batch_transfer_status(ids) == 0, "reported ids answer the same again"
    dst = local.buffer(MiB)
    rid = e.batch_transfer_async_read(target.session, [dst], [a + MiB], [MiB])
    assert e.get_batch_transfer_status([rid]) == 0
    assert ctypes.string_at(dst, MiB) == b"\x41" * MiB
    # One write submitted and polled, Mooncake's way: 0 running, 1 completed.
    wid = e.transfer_submit_write(target.session, srcs[0], a, MiB)
    assert wid > 0
    deadline = time.monotonic() + 10
    status = 0
    while status == 0 and time.monotonic() < deadline:
        status = e.transfer_check_status(wid)
    assert status == 1
    assert e.transfer_check_status(wid) == 1, "already reported: the same again"
    assert e.transfer_check_status(wid + 1000) == -1, "never issued"
    # Refused before it starts: no id.
    assert e.batch_transfer_async_write(target.session, [srcs[0]], [a + 64 * MiB], [MiB]) == 0
    assert e.transfer_submit_write(target.session, srcs[0], a, 0) == 0, "Mooncake's sentinel"


def test_async_seed_scenario(peer_factory, local):
    """The seed scenario through the asynchronous calls: -1 from the status,
    and the source rewritten at once never reaches the target."""
    target = peer_factory(4096, 64 * MiB)
    (small, _), (big, _) = target.regions
    e = engine()
    probe = local.buffer(4096, 1)
    src = local.buffer(64 * MiB, 0xAA)
    assert e.transfer_sync_write(target.session, probe, small, 4096) == 0
    assert target.ask(f"unregister {small}") == "0"
    bid = e.batch_transfer_async_write(target.session, [probe, src], [small, big], [4096, 64 * MiB])
    assert bid > 0
    assert e.get_batch_transfer_status([bid]) == -1
    ctypes.memset(src, 0xBB, 64 * MiB)
    time.sleep(0.05)
    assert target.count(big, 64 * MiB, 0xBB) == 0


def test_managed_buffers(peer_factory):
    target = peer_factory(MiB)
    (a, _) = target.regions[0]
    e = engine()
    buf = e.allocate_managed_buffer(MiB)
    assert buf != 0 and buf % 4096 == 0
    assert e.read_bytes_from_buffer(buf, 16) == b"\0" * 16
    assert e.write_bytes_to_buffer(buf + 100, b"quiesce!", 8) == 0
    assert e.read_bytes_from_buffer(buf + 100, 8) == b"quiesce!"
    assert e.transfer_sync_write(target.session, buf + 100, a, 8) == 0
    assert target.ask(f"crc {a} 8") == str(__import__("zlib").crc32(b"quiesce!"))
    # Out of bounds of every managed buffer: refused, nothing written.
    assert e.write_bytes_to_buffer(buf + MiB - 4, b"12345678", 8) == -1
    assert e.write_bytes_to_buffer(buf, b"abc", 8) == -1, "length past the data"
    try:
        e.read_bytes_from_buffer(buf + MiB, 1)
        raise AssertionError("read outside a managed buffer")
    except ValueError:
        pass
    # A failed batch (past the target's range: -1) gives its use back too,
    # and a wrong length frees (and unregisters) nothing.
    assert e.transfer_sync_write(target.session, buf, a + MiB - 8, 16) == -1
    assert e.free_managed_buffer(buf, MiB // 2) == -1
    assert engine().get_first_buffer_address(f"127.0.0.1:{e.get_rpc_port()}") == buf
    assert e.free_managed_buffer(buf, MiB) == 0
    assert e.free_managed_buffer(buf, MiB) == -1, "freed twice"


def test_send_probe(peer_factory):
    target = peer_factory(4096)
    e = engine()
    assert e.send_probe(target.session) == 0
    port = target.port
    target.close()
    # A dead io_uring process's listening socket lingers while its ring is
    # torn down (asynchronously, in the kernel): probe until it is gone.
    deadline = time.monotonic() + 5
    while e.send_probe(f"127.0.0.1:{port}") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert e.send_probe(f"127.0.0.1:{port}") == -1


def test_a_second_status_call_while_one_waits_says_running(peer_factory, local, monkeypatch):
    """transfer_check_status from one thread while get_batch_transfer_status
    waits on the same batch in another: 0 (running), never -1 — which would
    tell the caller its buffer is free while the batch still reads it."""
    import signal
    import threading

    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 9)
    bid = e.batch_transfer_async_write(target.session, [src], [a], [64 * MiB])
    assert bid > 0
    waited = []
    t = threading.Thread(target=lambda: waited.append(e.get_batch_transfer_status([bid])))
    t.start()
    time.sleep(0.3)
    assert e.transfer_check_status(bid) == 0, "told done while another call waits on it"
    t.join(30)
    assert waited and waited[0] in (-1, -2)
    target.signal(signal.SIGCONT)
    assert e.wait_for_quiescence(20) == 0


def test_quiesce_wait_unknown_holds_get_batch_transfer_status_too(peer_factory, local, monkeypatch):
    """The asynchronous form of test_mooncake's QUIESCE_WAIT_UNKNOWN test:
    get_batch_transfer_status waits out a -2 as a sync call does."""
    monkeypatch.setenv("QUIESCE_WAIT_UNKNOWN", "30")
    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 10)
    bid = e.batch_transfer_async_write(target.session, [src], [a], [64 * MiB])
    assert bid > 0
    answers_after_resume(target, e, lambda: e.get_batch_transfer_status([bid]))


def test_a_managed_buffer_a_minus_two_batch_holds_is_not_freed(peer_factory, local, monkeypatch):
    """-2 means the memory stays pinned: free_managed_buffer must not hand
    a managed buffer back to the allocator while a batch that answered -2
    still has it as its source (the stopped target holds it lent), and
    frees it once wait_for_quiescence() said the batch drained."""
    target, a, e, _ = stopped_target(peer_factory, local, monkeypatch, 6)
    b = e.allocate_managed_buffer(64 * MiB)
    assert b
    assert e.transfer_sync_write(target.session, b, a, 64 * MiB) == -2
    assert e.free_managed_buffer(b, 64 * MiB) == -2, "freed under a -2 batch"
    target.signal(signal.SIGCONT)
    assert e.wait_for_quiescence(20) == 0
    assert e.free_managed_buffer(b, 64 * MiB) == 0


def test_an_asynchronous_batch_in_flight_keeps_its_managed_buffer(peer_factory, local, monkeypatch):
    """The same for a batch started with batch_transfer_async_write and not
    yet reported: its buffer is not freed under it."""
    target, a, e, _ = stopped_target(peer_factory, local, monkeypatch, 6)
    b = e.allocate_managed_buffer(MiB)
    bid = e.batch_transfer_async_write(target.session, [b], [a], [MiB])
    assert bid
    assert e.free_managed_buffer(b, MiB) == -2, "freed under a running batch"
    target.signal(signal.SIGCONT)
    assert e.get_batch_transfer_status([bid]) in (0, -2)
    assert e.wait_for_quiescence(20) == 0
    assert e.free_managed_buffer(b, MiB) == 0


def test_a_batch_crossing_into_a_managed_buffer_keeps_it(peer_factory, local, monkeypatch):
    """A batch's local range that starts before a managed buffer and runs
    into it uses that buffer too: it is not freed under the batch (only the
    buffer a range starts in was counted, and the 64 bytes before an
    allocation are mapped, so the range passed the host check)."""
    target, a, e, _ = stopped_target(peer_factory, local, monkeypatch, 6)
    b = e.allocate_managed_buffer(MiB)
    bid = e.batch_transfer_async_write(target.session, [b - 64], [a], [MiB])
    assert bid, "the range before the buffer is mapped"
    assert e.free_managed_buffer(b, MiB) == -2, "freed under a running batch"
    target.signal(signal.SIGCONT)
    assert e.wait_for_quiescence(20) == 0
    assert e.get_batch_transfer_status([bid]) == 0
    assert e.free_managed_buffer(b, MiB) == 0


def test_a_finished_unpolled_batch_does_not_hold_its_managed_buffer(peer_factory):
    """An asynchronous batch that finished holds nothing, polled or not:
    its managed buffer frees (it answered -2, 'in use', until someone
    polled the batch or unregistered memory)."""
    target = peer_factory(MiB)
    (a, _) = target.regions[0]
    e = engine()
    b = e.allocate_managed_buffer(MiB)
    bid = e.batch_transfer_async_write(target.session, [b], [a], [MiB])
    assert bid
    deadline = time.monotonic() + 20
    while e.free_managed_buffer(b, MiB) != 0:
        assert time.monotonic() < deadline, "a finished batch still holds its buffer"
        time.sleep(0.05)
    assert e.get_batch_transfer_status([bid]) == 0


def test_a_poll_after_another_call_reported_minus_2_is_never_minus_1(peer_factory, local, monkeypatch):
    """Once one call reported a batch's -2 (its memory pinned), a status
    call on the same id never says -1 ('nothing touches the buffer'): it
    answered -1 for an id whose outcome another call had taken."""
    import threading

    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    bid = e.batch_transfer_async_write(target.session, [src], [a], [64 * MiB])
    assert bid
    out = []
    t = threading.Thread(target=lambda: out.append(e.get_batch_transfer_status([bid])))
    t.start()
    polled = 0
    deadline = time.monotonic() + 30
    while polled == 0 and time.monotonic() < deadline:
        polled = e.transfer_check_status(bid)
        time.sleep(0.01)
    t.join(30)
    assert out == [-2], "the stopped target's batch is unknown"
    assert polled == -2, f"a poller was told {polled} for a batch whose memory is pinned"
    assert e.transfer_check_status(bid) == -2
    assert e.get_batch_transfer_status([bid]) == -2
    assert e.transfer_check_status(bid + 1000) == -1, "an id never issued"
    target.signal(signal.SIGCONT)
    assert e.wait_for_quiescence(20) == 0


def test_a_batch_waited_on_is_running_to_every_other_caller(peer_factory, local, monkeypatch):
    """While get_batch_transfer_status waits out a -2 (QUIESCE_WAIT_UNKNOWN),
    another thread asking about the same batch hears 'running' (0), never
    -1: -1 would tell it the memory is free while the target may still
    read it."""
    import threading

    monkeypatch.setenv("QUIESCE_WAIT_UNKNOWN", "30")
    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    bid = e.batch_transfer_async_write(target.session, [src], [a], [64 * MiB])
    assert bid
    out = []
    t = threading.Thread(target=lambda: out.append(e.get_batch_transfer_status([bid])))
    t.start()
    time.sleep(7)  # past the 5 s deadline and the fence: the -2 is being waited out
    assert not out
    assert e.transfer_check_status(bid) == 0, "the waited-on batch is unknown to others"
    target.signal(signal.SIGCONT)
    t.join(30)
    assert out and out[0] in (0, -1), out
    assert e.wait_for_quiescence(0) == 0


def test_wait_for_quiescence_takes_any_timeout(peer_factory, local, monkeypatch):
    """An infinite or huge timeout waits (it used to raise a PanicException
    and, for 1e19, leave wait_for_quiescence() answering 'pending' for good
    after the next -2)."""
    e0 = engine()
    assert e0.wait_for_quiescence(float("inf")) == 0
    assert e0.wait_for_quiescence(1e19) == 0
    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    assert e.wait_for_quiescence(1e19) == 0
    assert e.transfer_sync_write(target.session, src, a, 64 * MiB) == -2
    target.signal(signal.SIGCONT)
    assert e.wait_for_quiescence(1e19) == 0


def test_initialize_from_two_threads_at_once_starts_one_engine():
    """Both calls checked 'not initialised' before either stored its engine,
    so both answered 0 and the second engine replaced the first (memory
    registered on it in between vanished)."""
    import threading

    e = TransferEngine()
    go = threading.Barrier(2)
    codes = []

    def init():
        go.wait()
        codes.append(e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""))

    ts = [threading.Thread(target=init) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(codes) == [-1, 0], codes


def test_two_status_calls_on_one_batch_never_hear_minus_one_for_a_minus_two(
    peer_factory, local, monkeypatch
):
    """Two threads wait on the same batch with get_batch_transfer_status;
    the one that takes its outcome hears -2 (a stopped target on this host
    holds the source); the other heard -1 ('no batch'), which says the
    memory is free. It hears -2 too: wait_for_quiescence() says when."""
    import threading

    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    bid = e.batch_transfer_async_write(target.session, [src], [a], [64 * MiB])
    assert bid
    codes = []
    ts = [
        threading.Thread(target=lambda: codes.append(e.get_batch_transfer_status([bid])))
        for _ in range(2)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert codes == [-2, -2], codes
    target.signal(signal.SIGCONT)
    assert e.wait_for_quiescence(20) == 0


def test_a_managed_buffer_another_registration_lies_in_is_not_freed(local):
    """free_managed_buffer takes back its own registration only: while
    another registration lies in the buffer, peers may still write there,
    so the buffer must stay allocated (-2) until that one is taken back."""
    e = engine()
    buf = e.allocate_managed_buffer(MiB)
    assert buf != 0
    assert e.register_memory(buf + 4096, 4096) == 0
    assert e.free_managed_buffer(buf, MiB) == -2, "freed under a live registration"
    # Still the engine's and served: a peer's write lands in live memory.
    peer = engine()
    src = local.buffer(64, 0x5A)
    assert peer.transfer_sync_write(f"127.0.0.1:{e.get_rpc_port()}", src, buf + 4096, 64) == 0
    assert e.read_bytes_from_buffer(buf + 4096, 64) == b"\x5a" * 64
    # Taken back: now it frees.
    assert e.unregister_memory(buf + 4096) == 0
    assert e.free_managed_buffer(buf, MiB) == 0


def test_an_engine_dropped_with_a_batch_it_could_not_drain_warns(peer_factory, local, monkeypatch):
    """An engine dropped while a stopped target on this host still holds a
    loan of an async batch (the target will write the destination itself
    once it resumes) cannot drain it, and Mooncake's API has no close()
    whose code could say -2: the drop must say so where Python sees it. It
    said so only in a log line, and the caller, told nothing, could reuse the
    destination."""
    import gc

    import pytest

    target, a, e, _ = stopped_target(peer_factory, local, monkeypatch, 6)
    # Past the mailbox's slots (whose bytes the initiator copies itself):
    # the target writes this destination.
    dst = local.buffer(MiB)
    try:
        assert e.batch_transfer_async_read(target.session, [dst], [a], [MiB]) != 0
        time.sleep(2)  # its request goes out, lending dst, on the engine's thread
        with pytest.warns(RuntimeWarning, match="could not drain"):
            del e
            gc.collect()
    finally:
        target.signal(signal.SIGCONT)


def test_an_engine_dropped_undrained_while_an_exception_unwinds_keeps_that_exception(
    peer_factory, local, monkeypatch
):
    """The same undrained drop, made while an exception leaves the code
    that held the engine's last reference (a temporary on the interpreter's
    stack, dropped with the exception already set): the warning must not
    take that exception's place. Issued with it pending, it did."""
    import pytest

    target, a, e, _ = stopped_target(peer_factory, local, monkeypatch, 6)
    dst = local.buffer(MiB)
    held = [e]
    del e

    def lent():
        e = held.pop()
        assert e.batch_transfer_async_read(target.session, [dst], [a], [MiB]) != 0
        time.sleep(2)  # its request goes out, lending dst, on the engine's thread
        return e

    try:
        with pytest.warns(RuntimeWarning, match="could not drain"):
            with pytest.raises(ZeroDivisionError):
                (lent(), 1 / 0)
    finally:
        target.signal(signal.SIGCONT)
