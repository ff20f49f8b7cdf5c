"""The Mooncake drop-in against a target that dies, stops or is replaced
while a call runs: outcomes within the deadline, -2 for memory that stays
pinned, unregister_memory waiting for the batches on its range."""

import signal
import threading
import time

import pytest

from conftest import answers_after_resume, engine, stopped_target

MiB = 1 << 20


def test_a_killed_target_gives_an_outcome_never_a_hang(peer_factory, local):
    target = peer_factory(64 * MiB)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(64 * MiB, 5)
    for _ in range(3):
        out = []
        th = threading.Thread(
            target=lambda: out.append(e.transfer_sync_write(target.session, src, a, 64 * MiB))
        )
        th.start()
        time.sleep(0.002)
        target.signal(signal.SIGKILL)
        th.join(40)
        assert not th.is_alive(), "the transfer hung on a killed target"
        assert out[0] in (0, -1, -2)
        if out[0] == -2:
            assert e.wait_for_quiescence(10) == 0
        target.close()
        target = peer_factory(64 * MiB)
        (a, _) = target.regions[0]


def test_a_stopped_target_with_a_deadline(peer_factory, local, monkeypatch):
    """MC_TRANSFER_TIMEOUT=5: a SIGSTOPped target gives -1 or -2 soon after the
    deadline, never 0 and never a hang; after -2 the memory stays pinned until
    the target resumes and the batch drains."""
    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    t0 = time.monotonic()
    ret = e.transfer_sync_write(target.session, src, a, 64 * MiB)
    took = time.monotonic() - t0
    assert ret in (-1, -2), ret
    assert took < 5 + 10, f"{took:.1f} s"
    import ctypes

    if ret == -1:
        # Nothing reads the source any more: rewrite it before the target
        # resumes; none of the new bytes may ever reach it.
        ctypes.memset(src, 0x77, 64 * MiB)
    else:
        assert e.wait_for_quiescence(0.2) == 1, "drained while the target is stopped?"
    target.signal(signal.SIGCONT)
    assert e.wait_for_quiescence(20) == 0
    time.sleep(0.2)
    assert target.count(a, 64 * MiB, 0x77) == 0, "bytes written after -1 reached the target"
    print(f"stopped target: {ret} after {took:.2f} s")


def test_unregister_memory_waits_for_this_engines_own_batch(peer_factory, local, monkeypatch):
    """unregister_memory answers 0 only once nothing touches the range: not
    while a batch of this engine that answered -2 still holds it as its
    source (a stopped target on this host holds it lent). It answers once
    the target resumed and the batch drained; a batch from the range
    meanwhile is refused."""
    import threading

    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    assert e.register_memory(src, 64 * MiB) == 0
    assert e.transfer_sync_write(target.session, src, a, 64 * MiB) == -2
    out = []
    t = threading.Thread(target=lambda: out.append((e.unregister_memory(src), time.monotonic())))
    t.start()
    time.sleep(1.5)
    assert not out, f"unregister_memory answered {out[0][0]} while the batch held the range"
    assert e.transfer_sync_write(target.session, src, a, 4096) == -1, "a batch from a range being unregistered"
    resumed = time.monotonic()
    target.signal(signal.SIGCONT)
    t.join(40)
    assert out and out[0][0] == 0, out
    assert out[0][1] >= resumed
    assert e.wait_for_quiescence(0) == 0


@pytest.mark.parametrize("other_registration", [False, True])
def test_unregister_memory_waits_for_a_batch_that_started_before_the_registration(
    peer_factory, local, monkeypatch, other_registration
):
    """A batch from memory registered only after it started uses that
    memory all the same: unregister_memory answers 0 only once it is done,
    whether nothing else was registered when it started (the batch counted
    nothing) or another range was (it counted its ranges and found none)."""
    monkeypatch.setenv("QUIESCE_LOCAL", "off")
    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    if other_registration:
        other = local.buffer(4096, 1)
        assert e.register_memory(other, 4096) == 0
    bid = e.batch_transfer_async_write(target.session, [src], [a], [64 * MiB])
    assert bid != 0
    assert e.register_memory(src, 64 * MiB) == 0
    out = []
    t = threading.Thread(target=lambda: out.append((e.unregister_memory(src), time.monotonic())))
    t.start()
    time.sleep(1.0)
    assert not out, f"unregister_memory answered {out[0][0]} while the batch still read the range"
    resumed = time.monotonic()
    target.signal(signal.SIGCONT)
    t.join(40)
    assert out and out[0][0] == 0, out
    assert out[0][1] >= resumed
    assert e.get_batch_transfer_status([bid]) in (0, -1)
    assert e.wait_for_quiescence(20) == 0


def test_another_node_at_a_p2p_sessions_address_is_not_that_session(peer_factory, local, monkeypatch):
    """A P2P session name is where a node was found, not the node: once
    it is gone and another node (another name, the same secret) listens at
    that address, the session does not reach it — no first buffer of it,
    no write into it."""
    monkeypatch.setenv("QUIESCE_LOCAL", "off")
    a = peer_factory(MiB)
    (addr_a, _) = a.regions[0]
    e = engine()
    src = local.buffer(4096, 3)
    assert e.transfer_sync_write(a.session, src, addr_a, 4096) == 0
    port = a.session.rsplit(":", 1)[1]
    a.close()
    b = peer_factory(MiB, env={"QUIESCE_TEST_HOSTNAME": f"localhost:{port}"})
    (addr_b, _) = b.regions[0]
    assert e.get_first_buffer_address(a.session) == 0, "another node's buffer, by the old session"
    for _ in range(3):
        assert e.transfer_sync_write(a.session, src, addr_b, 4096) == -1
    assert b.count(addr_b, 4096, 3) == 0, "the write reached another node"


@pytest.mark.parametrize("registered_before", [False, True])
def test_a_batch_of_no_entries_leaves_nothing_counted(peer_factory, local, registered_before):
    """A batch with nothing to move (no entries, as vLLM's sender makes)
    ends at once and holds nothing: memory registered afterwards is
    unregistered at once, whatever was registered before."""
    target = peer_factory(MiB)
    e = engine()
    if registered_before:
        assert e.register_memory(local.buffer(4096, 1), 4096) == 0
    buf = local.buffer(4096, 2)
    for _ in range(3):
        assert e.batch_transfer_sync_write(target.session, [], [], []) == 0
    assert e.register_memory(buf, 4096) == 0
    started = time.monotonic()
    assert e.unregister_memory(buf) == 0
    assert time.monotonic() - started < 5


def test_the_deadline_grows_with_the_batch_size(peer_factory, local, monkeypatch):
    """As Mooncake's, a batch's deadline is MC_TRANSFER_TIMEOUT plus a
    nanosecond per byte, so a large read at start-up is not cut at the
    timeout: 32 entries of 64 MiB (2 GiB, +2.1 s) to a stopped target answer
    no sooner than 5 + 2.1 s, where a fixed deadline answers at 5.2 s."""
    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    n = 32
    t0 = time.monotonic()
    ret = e.batch_transfer_sync_write(target.session, [src] * n, [a] * n, [64 * MiB] * n)
    took = time.monotonic() - t0
    assert ret in (-1, -2), ret
    assert took >= 5 + n * 64 * MiB / 1e9 - 0.05, f"answered after {took:.2f} s"
    target.signal(signal.SIGCONT)
    assert e.wait_for_quiescence(30) == 0


def test_quiesce_wait_unknown_turns_a_minus_two_into_the_drained_outcome(
    peer_factory, local, monkeypatch
):
    """vLLM and SGLang treat -2 as a failure and reuse the memory at once,
    never calling wait_for_quiescence(). With QUIESCE_WAIT_UNKNOWN=seconds a
    call that would answer -2 first waits that long for its batch to drain,
    and answers the drained outcome (0 or -1): nothing touches the memory
    when it returns. (A stopped target on this host gives -2: it holds the
    source lent through the local transport.)"""
    monkeypatch.setenv("QUIESCE_WAIT_UNKNOWN", "30")
    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 6)
    answers_after_resume(target, e, lambda: e.transfer_sync_write(target.session, src, a, 64 * MiB))


def test_a_call_still_opening_its_segment_holds_its_managed_buffer(peer_factory):
    """A transfer that has not reached its target yet (its first call, the
    connection's handshake waiting on a stopped target) already uses its
    buffer: free_managed_buffer must not free it meanwhile. It counted the
    buffer only once the segment was open, so the free answered 0 and
    released memory the call went on to read into."""
    target = peer_factory(MiB)
    (a, _) = target.regions[0]
    e = engine()
    b = e.allocate_managed_buffer(MiB)
    assert b != 0
    target.signal(signal.SIGSTOP)  # before any contact: the first call opens
    out = []
    t = threading.Thread(target=lambda: out.append(e.transfer_sync_read(target.session, b, a, 4096)))
    t.start()
    time.sleep(0.5)
    assert not out, f"the call answered {out} without its target"
    code = e.free_managed_buffer(b, MiB)
    # Let the call end without reaching the target (and, on the bug, without
    # reading into the freed memory).
    target.signal(signal.SIGKILL)
    t.join(40)
    assert not t.is_alive()
    assert code == -2, f"free_managed_buffer answered {code} while a call was about to read into it"
    assert out == [-1], out
    assert e.free_managed_buffer(b, MiB) == 0, "the buffer was not free once the call ended"


def test_wait_for_quiescence_waits_while_another_thread_waits(peer_factory, local, monkeypatch):
    """Two threads' wait_for_quiescence(20) on a -2 batch whose target
    resumes after a second: both answer 0 once it drained. The second
    answered 1 at once, without waiting: one caller waited at a time, and
    the others got the count as it stood."""
    target, a, e, src = stopped_target(peer_factory, local, monkeypatch, 7)
    assert e.transfer_sync_write(target.session, src, a, 64 * MiB) == -2
    first = []
    t = threading.Thread(target=lambda: first.append(e.wait_for_quiescence(20)))
    t.start()
    time.sleep(0.2)
    threading.Timer(1.0, target.signal, (signal.SIGCONT,)).start()
    t0 = time.monotonic()
    second = e.wait_for_quiescence(20)
    waited = time.monotonic() - t0
    t.join(30)
    assert first == [0], first
    assert second == 0, f"the second waiter answered {second} after {waited:.2f} s"
