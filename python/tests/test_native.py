"""quiesce.Engine, the native API: named segments, batches over
buffer-protocol objects, outcome objects, revoke, asyncio."""

import asyncio
import gc
import signal
import threading
import time
import weakref

import pytest

import quiesce
from conftest import SECRET, resizable

MiB = 1 << 20


class Tensorish:
    """An object giving its memory by data_ptr()/nbytes, as torch tensors do
    (and, unlike a bytearray, one a weakref can watch)."""

    def __init__(self, n, byte=0):
        self._mem = bytearray([byte]) * n
        import ctypes

        self._c = (ctypes.c_char * n).from_buffer(self._mem)
        self.nbytes = n
        self.device = type("Device", (), {"type": "cpu"})()

    def data_ptr(self):
        import ctypes

        return ctypes.addressof(self._c)

    def is_contiguous(self):
        return True


def test_write_then_read_back(native_peer, eng):
    np = pytest.importorskip("numpy")
    t = native_peer(kv=4 * MiB)
    kv = eng.open(t.address, "kv")
    assert (kv.name, kv.length) == ("kv", 4 * MiB)
    src = np.full(MiB // 4, 0x09090909, dtype=np.uint32)  # 1 MiB of uint32
    b = eng.batch()
    b.write(src, kv, offset=MiB)
    b.write(bytes([7]) * 4096, kv)
    out = b.run()
    assert isinstance(out, quiesce.Completed), out
    assert out.code == 0 and out.remote_confirmed
    assert [r.status for r in out.tasks] == ["completed"] * 2
    assert out.buffers[0] is src
    assert t.count("kv", 7) == 4096
    assert t.count("kv", 9) == MiB
    back = np.zeros(MiB // 4, dtype=np.uint32)
    mv = bytearray(4096)
    b = eng.batch()
    b.read(back, kv, offset=MiB)
    b.read(memoryview(mv), kv)
    assert b.run()
    assert (back == src).all()
    assert mv == bytes([7]) * 4096


def test_a_batch_of_many_small_tasks(native_peer, eng):
    """A batch holds as many tasks as its caller adds (no hidden limit of
    4,096: a KV cache's blocks times its layers pass it)."""
    n, size = 5000, 256
    t = native_peer(kv=n * size)
    kv = eng.open(t.address, "kv")
    b = eng.batch()
    for i in range(n):
        b.write(bytes([11]) * size, kv, offset=i * size)
    out = b.run()
    assert isinstance(out, quiesce.Completed), out
    assert len(out.tasks) == n
    assert t.count("kv", 11) == n * size

    async def run():
        b = eng.batch()
        for i in range(n):
            b.write(bytes([12]) * size, kv, offset=i * size)
        return await b.run_async()

    assert isinstance(asyncio.run(run()), quiesce.Completed)
    assert t.count("kv", 12) == n * size


def test_a_batch_holds_its_buffers_from_add_to_outcome(native_peer, eng):
    t = native_peer(kv=MiB)
    kv = eng.open(t.address, "kv")
    buf = bytearray(4096)
    b = eng.batch()
    b.write(buf, kv)
    assert not resizable(buf), "the batch does not hold its buffer"
    assert b.run()
    assert resizable(buf), "the buffer is still held after the outcome"


BAD_POINTER_CODE = """
import sys
import quiesce

class Pointer:
    nbytes = 4096
    def data_ptr(self):
        return int(sys.argv[2])

e = quiesce.Engine(secret=sys.argv[3])
kv = e.open(sys.argv[1], "kv")
for op in ("write", "read"):
    b = e.batch()
    try:
        getattr(b, op)(Pointer(), kv)
    except quiesce.InvalidInput:
        continue
    b.run()
    print(op, "took the pointer", flush=True)
    sys.exit(1)
print("ok", flush=True)
"""


def test_a_data_ptr_that_is_not_host_memory_is_refused(native_peer):
    """An object giving its memory by data_ptr() (a tensor) whose pointer
    is not memory this process can read and write — a device pointer, a
    wrong one — is refused as InvalidInput, as the Mooncake API refuses it:
    the first copy from it would kill the interpreter (SIGSEGV)."""
    import subprocess
    import sys

    t = native_peer(kv=MiB)
    for ptr in (4096, 0x7FFF_0000_0000_0000):
        out = subprocess.run(
            [sys.executable, "-c", BAD_POINTER_CODE, t.address, str(ptr), SECRET],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "ok" in out.stdout, (ptr, out.returncode, out.stdout + out.stderr[-1500:])


def test_bad_input_raises_a_typed_error_and_loses_nothing(native_peer, eng):
    t = native_peer(kv=MiB)
    kv = eng.open(t.address, "kv")
    b = eng.batch()
    buf = bytearray(4096)
    with pytest.raises(quiesce.ZeroLength):
        b.write(bytearray(), kv)
    with pytest.raises(quiesce.OutOfBounds):
        b.write(buf, kv, offset=MiB - 100)
    with pytest.raises(quiesce.OutOfBounds):
        b.write(buf, kv, offset=2**64 - 1)
    with pytest.raises(quiesce.InvalidInput):
        b.read(bytes(4096), kv)  # read-only destination
    with pytest.raises(quiesce.InvalidInput):
        b.write(object(), kv)
    with pytest.raises(quiesce.InvalidInput):
        b.write(memoryview(bytearray(8192))[::2], kv)  # not contiguous
    with pytest.raises(quiesce.InvalidInput):
        b.write(buf, kv, offset=-1)
    assert resizable(buf), "a refused task kept its buffer"
    assert len(b) == 0
    with pytest.raises(quiesce.SegmentRefused):
        eng.open(t.address, "nosuch")
    with pytest.raises(quiesce.SegmentRefused):
        quiesce.Engine(secret="another secret, 16+ bytes").open(t.address, "kv")
    with pytest.raises(quiesce.UnknownPeer):
        eng.open("no-such-host.invalid:1", "kv")
    with pytest.raises(quiesce.PeerUnreachable):
        eng.open("127.0.0.1:1", "kv")
    # A bad policy or deadline is refused when the batch is made, before
    # any buffer is given to it (it was refused only at run()).
    # (Under a nanosecond, or an int that rounds to 2**64 as a float, the
    # engine reads as no deadline: they passed here and failed at run().)
    for bad in ({"policy": "sometimes"}, {"deadline": 0}, {"deadline": float("nan")}, {"deadline": -1.0},
                {"deadline": 1e-10}, {"deadline": 2**64 - 1}, {"deadline": 10**400}):
        with pytest.raises(quiesce.InvalidInput):
            eng.batch(**bad)
    with pytest.raises(quiesce.InvalidInput):
        eng.batch().run()  # no tasks
    # Numbers of other types are numbers (numpy's were InvalidInput).
    np = pytest.importorskip("numpy")
    for good in (np.int64(5), np.float32(2.5), 3):
        eng.batch(deadline=good)
    # A tensor-like object that says wrong things is InvalidInput (it was
    # AttributeError for a device given as a string, OverflowError for a
    # negative pointer or size).
    cuda = Tensorish(4096)
    cuda.device = "cuda:0"
    negative = Tensorish(4096)
    negative.data_ptr = lambda: -4096
    short = Tensorish(4096)
    short.nbytes = -1
    for odd in (cuda, negative, short):
        with pytest.raises(quiesce.InvalidInput):
            b.write(odd, kv)
    with pytest.raises(quiesce.SecretMissing):
        quiesce.Engine(secret="short")
    # A segment name no directory can hold (it was lent and served, and
    # only its publication failed, in a log line): refused, nothing lent.
    for bad in ("a/b", "kv 0", "", "x" * 256):
        lent = bytearray(4096)
        with pytest.raises(quiesce.InvalidInput):
            eng.register(bad, lent)
        assert resizable(lent), f"{bad!r}: a refused registration kept its buffer"
    assert issubclass(quiesce.OutOfBounds, ValueError)
    assert t.count("kv", 0) == MiB, "a refused task wrote"
    # The engine and the batch still work.
    b.write(bytearray([5]) * 4096, kv)
    assert b.run()
    assert t.count("kv", 5) == 4096
    with pytest.raises(quiesce.InvalidInput):
        b.run()  # once


def test_seed_scenario_failed_means_nothing_touches_the_source(native_peer, eng):
    """[4 KiB to a segment the target revoked, 64 MiB valid]: Failed with the
    reason, and the source rewritten at once never reaches the target."""
    t = native_peer(small=4096, big=64 * MiB)
    src = bytearray(64 * MiB)
    small = eng.open(t.address, "small")
    big = eng.open(t.address, "big")
    assert t.ask("revoke small") == "True"
    corrupted = 0
    rounds = 5
    for r in range(rounds):
        t.fill("big", 0)
        src[:] = b"\xaa" * len(src)
        b = eng.batch()
        b.write(bytearray(4096), small)
        b.write(src, big)
        out = b.run()
        assert isinstance(out, quiesce.Failed), f"round {r}: {out}"
        assert out.tasks[0].status == "failed" and out.tasks[0].reason
        assert out.buffers[1] is src
        # Failed: nothing reads the source any more. Rewrite it at once.
        src[:] = b"\xbb" * len(src)
        time.sleep(0.05)
        if t.count("big", 0xBB) != 0:
            corrupted += 1
    assert corrupted == 0, f"{corrupted}/{rounds} rounds had bytes written after Failed"


def test_revoke_stops_every_earlier_write(native_peer):
    """The target revokes a segment while a 64 MiB write into it is under
    way: once revoke() returns True no more bytes land, and the outcome says
    what landed."""
    target = quiesce.Engine(secret=SECRET)
    initiator = quiesce.Engine(secret=SECRET)
    cut = 0
    for r in range(5):
        mem = bytearray(64 * MiB)
        seg = target.register(f"kv{r}", mem)
        assert not resizable(mem), "a lent buffer is not held"
        kv = initiator.open(target.address, f"kv{r}")
        b = initiator.batch()
        b.write(bytearray([1]) * (64 * MiB), kv)
        done = []
        th = threading.Thread(target=lambda: done.append(b.run()))
        th.start()
        while mem.find(1) == -1 and th.is_alive():
            pass  # until the write is under way
        assert seg.revoke()
        landed = mem.count(1)
        assert resizable(mem), "revoke returned True but the buffer is still held"
        th.join(30)
        out = done[0]
        time.sleep(0.05)
        assert mem.count(1) == landed, f"round {r}: bytes landed after revoke"
        if isinstance(out, quiesce.Failed):
            cut += 1
            assert out.remote_confirmed
            assert "revoked" in (out.tasks[0].reason or ""), out.tasks[0]
            assert out.tasks[0].bytes == landed, out.tasks[0]
    assert cut > 0, "no write was cut by a revoke"
    target.close()
    initiator.close()


def test_asyncio_batches(native_peer, eng):
    t = native_peer(kv=8 * MiB)
    kv = eng.open(t.address, "kv")

    async def one(i):
        b = eng.batch()
        b.write(bytearray([i + 1]) * MiB, kv, offset=i * MiB)
        return await b.run_async()

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    outs = asyncio.run(main())
    assert all(isinstance(o, quiesce.Completed) for o in outs), outs
    for i in range(8):
        assert t.count("kv", i + 1) == MiB


def test_a_dropped_awaiter_leaves_the_buffers_held_until_quiesced(native_peer, eng):
    """Cancel the asyncio task awaiting a batch to a stopped target and drop
    every reference: the batch still holds its buffers (a bytearray's
    export, a tensor-like object) until its outcome, then lets them go."""
    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    raw = bytearray([2]) * (32 * MiB)
    tensor = Tensorish(32 * MiB, 3)
    gone = weakref.ref(tensor)
    t.signal(signal.SIGSTOP)

    async def main():
        b = eng.batch(deadline=2.0)
        b.write(raw, kv)
        b.write(tensor, kv, offset=32 * MiB)
        task = asyncio.ensure_future(b.run_async())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    del tensor
    gc.collect()
    assert not resizable(raw), "the buffer was let go while the batch could still read it"
    assert gone() is not None, "the tensor was let go while the batch could still read it"
    t.signal(signal.SIGCONT)
    # Nothing of the batch is left to the caller (its awaiting task and any
    # CompletionUnknown are gone): the engine's own wait lets it go.
    assert eng.wait_for_quiescence(30), eng.pending()
    assert eng.pending() == []
    gc.collect()
    assert resizable(raw), "the buffer is still held after the batch quiesced"
    assert gone() is None, "the tensor is still held after the batch quiesced"


def test_a_stopped_target_gives_failed_or_unknown_never_corruption(native_peer, eng):
    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    src = bytearray([6]) * (64 * MiB)
    t.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    b = eng.batch(deadline=1.0)
    b.write(src, kv)
    out = b.run()
    took = time.monotonic() - t0
    assert took < 1 + 10, f"{took:.1f} s"
    assert isinstance(out, (quiesce.Failed, quiesce.CompletionUnknown)), out
    if isinstance(out, quiesce.CompletionUnknown):
        assert not resizable(src), "completion unknown, yet the buffer is let go"
        assert eng.pending() == [out.ticket]
        assert out.wait(0.2) is None, "drained while the target is stopped?"
        t.signal(signal.SIGCONT)
        # The engine's sweep drains it; the ticket's own wait still gets
        # the outcome afterwards.
        assert eng.wait_for_quiescence(30)
        assert eng.pending() == []
        out = out.wait(0)
        assert isinstance(out, (quiesce.Completed, quiesce.Failed)), out
    else:
        # Nothing reads the source any more: rewrite it before the target
        # resumes; none of the new bytes may ever reach it.
        src[:] = b"\x77" * len(src)
        t.signal(signal.SIGCONT)
    assert resizable(src)
    time.sleep(0.2)
    assert t.count("kv", 0x77) == 0, "bytes written after Failed reached the target"
    print(f"stopped target: {type(out).__name__} after {took:.2f} s")


def test_a_killed_target_gives_an_outcome(native_peer, eng):
    for _ in range(3):
        t = native_peer(kv=64 * MiB)
        kv = eng.open(t.address, "kv")
        b = eng.batch(deadline=10.0)
        b.write(bytearray(64 * MiB), kv)
        done = []
        th = threading.Thread(target=lambda: done.append(b.run()))
        th.start()
        time.sleep(0.002)
        t.signal(signal.SIGKILL)
        th.join(40)
        assert not th.is_alive(), "the batch hung on a killed target"
        assert isinstance(done[0], (quiesce.Completed, quiesce.Failed, quiesce.CompletionUnknown))
        if isinstance(done[0], quiesce.CompletionUnknown):
            assert done[0].wait(15) is not None
        t.close()


def test_sixteen_threads_at_once(native_peer, eng):
    """Batches from 16 Python threads at once on one engine (the GIL is
    released while each waits)."""
    t = native_peer(kv=16 * MiB)
    kv = eng.open(t.address, "kv")
    chunk = 64 << 10
    outs = []

    def work(i):
        srcs = [bytearray([1 + i]) * chunk for _ in range(4)]
        for _ in range(10):
            b = eng.batch()
            for k, s in enumerate(srcs):
                b.write(s, kv, offset=i * MiB + k * chunk)
            outs.append(b.run())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(outs) == 160 and all(isinstance(o, quiesce.Completed) for o in outs)
    for i in range(16):
        assert t.count("kv", 1 + i) == 4 * chunk


def test_the_engines_tcp_congestion_control_comes_from_the_environment(native_peer, monkeypatch):
    # A name the kernel lacks: InvalidInput naming the variable, no engine.
    monkeypatch.setenv("QUIESCE_TCP_CONGESTION", "no-such-cc")
    with pytest.raises(quiesce.InvalidInput, match="QUIESCE_TCP_CONGESTION.*no-such-cc"):
        quiesce.Engine(secret=SECRET)
    # One it has (reno is always built in): transfers go as before.
    monkeypatch.setenv("QUIESCE_TCP_CONGESTION", "reno")
    t = native_peer(kv=MiB)
    e = quiesce.Engine(secret=SECRET)
    try:
        b = e.batch()
        b.write(bytes([5]) * 8192, e.open(t.address, "kv"))
        assert isinstance(b.run(), quiesce.Completed)
        assert t.count("kv", 5) == 8192
    finally:
        e.close()


def test_a_deadline_past_what_a_clock_holds_is_no_limit(native_peer, eng):
    """deadline=1e19 passed the check and panicked (PanicException, or a
    dead engine thread) where the batch added it to the clock."""
    t = native_peer(kv=MiB)
    kv = eng.open(t.address, "kv")
    for run in ("run", "run_async"):
        b = eng.batch(deadline=1e19)
        b.write(bytearray(b"\x42" * 4096), kv)
        out = b.run() if run == "run" else asyncio.run(b.run_async())
        assert isinstance(out, quiesce.Completed), (run, out)


def test_an_abandoned_wait_async_does_not_lose_the_outcome(native_peer, eng):
    """asyncio.wait_for(out.wait_async(30), 0.5) gives up, but its worker
    thread waits on and takes the drained outcome; a later out.wait() then
    raised InvalidInput ('unknown ticket') instead of answering it."""
    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    src = bytearray(64 * MiB)
    t.signal(signal.SIGSTOP)
    b = eng.batch(deadline=1.0)
    b.write(src, kv)
    out = b.run()
    assert isinstance(out, quiesce.CompletionUnknown), out  # lent on this host

    async def abandon():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(out.wait_async(30), 0.5)
        t.signal(signal.SIGCONT)

    asyncio.run(abandon())  # returns once the abandoned worker is done
    got = out.wait(30)
    assert isinstance(got, (quiesce.Completed, quiesce.Failed)), got
    assert out.wait(0) is got
    assert resizable(src)


def test_a_batch_used_while_it_runs_is_a_typed_error(native_peer, eng):
    """run() held the batch borrowed through the whole transfer, so another
    thread's write() or run() on it raised pyo3's RuntimeError ('Already
    borrowed') instead of quiesce's InvalidInput; and an offset past 64
    bits raised OverflowError instead of OutOfBounds."""
    import threading

    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    b = eng.batch(deadline=5.0)
    b.write(bytearray(64 * MiB), kv)
    t.signal(signal.SIGSTOP)  # the run blocks until its deadline
    runner = threading.Thread(target=b.run)
    runner.start()
    time.sleep(0.3)
    try:
        with pytest.raises(quiesce.InvalidInput):
            b.write(bytearray(16), kv)
        with pytest.raises(quiesce.InvalidInput):
            b.run()
    finally:
        t.signal(signal.SIGCONT)
        runner.join()
    with pytest.raises(quiesce.OutOfBounds):
        eng.batch().write(bytearray(16), kv, offset=2**64)


def test_a_segment_of_another_engine_is_refused(native_peer):
    """A RemoteSegment names a handle of the engine that opened it; every
    engine numbers its handles from 0, so another engine's batch took it as
    its own segment with that number and wrote the bytes there."""
    t = native_peer(a=MiB, b=MiB)
    e1 = quiesce.Engine(secret=SECRET)
    e2 = quiesce.Engine(secret=SECRET)
    try:
        a = e1.open(t.address, "a")
        e2.open(t.address, "b")
        b = e2.batch()
        with pytest.raises(quiesce.InvalidInput):
            b.write(bytearray([9]) * 4096, a)
        assert len(b) == 0
        assert t.count("a", 9) == 0 and t.count("b", 9) == 0
    finally:
        e1.close()
        e2.close()


def test_a_stale_revoke_leaves_a_new_lending_alone(native_peer, eng):
    """revoke() of a segment already revoked must not take back what was
    lent at the same address since: it raised nothing and revoked the new
    segment (peers refused, the buffer resizable while still lent)."""
    buf = bytearray(MiB)
    s1 = eng.register("a", buf)
    assert s1.revoke()
    s2 = eng.register("b", buf)
    with pytest.raises(quiesce.InvalidInput):
        s1.revoke()
    assert not resizable(buf), "the new lending was taken back"
    peer = quiesce.Engine(secret=SECRET)
    try:
        peer.open(eng.address, "b")
    finally:
        peer.close()
    assert s2.revoke()
    assert resizable(buf)


@pytest.mark.parametrize("direction", ["read_into", "write_from"])
def test_revoke_waits_for_this_engines_own_batch_in_the_buffer(native_peer, eng, direction):
    """A lent buffer that this engine's own batch also uses — a read landing
    in it, or a write's source — with the batch held by a stopped peer:
    revoke() must not say the buffer is the caller's while that batch can
    still write it or read it; once the batch quiesced it does."""
    t = native_peer(kv=MiB)
    kv = eng.open(t.address, "kv")
    mem = bytearray([4]) * (2 * MiB)
    seg = eng.register("lent", mem)
    view = memoryview(mem)[:MiB]
    t.signal(signal.SIGSTOP)
    b = eng.batch(deadline=30.0)
    if direction == "read_into":
        b.read(view, kv)
    else:
        b.write(view, kv)
    done = []
    th = threading.Thread(target=lambda: done.append(b.run()))
    th.start()
    time.sleep(0.3)  # the batch is under way, held by the stopped peer
    try:
        assert not seg.revoke(timeout=0.5), (
            "revoke() gave the buffer back while this engine's batch can still touch it"
        )
    finally:
        t.signal(signal.SIGCONT)
    th.join(30)
    assert isinstance(done[0], quiesce.Completed), done
    assert seg.revoke(timeout=5)
    view.release()
    assert resizable(mem)


def test_revoke_settles_a_drained_batch_of_unknown_completion_in_the_buffer(native_peer, eng):
    """A batch writing from a view of a lent buffer ends CompletionUnknown
    (its target stopped; on this host the target's own process reads the
    buffer) and then drains once the target resumes. revoke() settles it
    itself: it said False for its whole timeout until the caller collected
    the ticket (pending(), wait(), ...)."""
    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    mem = bytearray(64 * MiB)
    seg = eng.register("lent", mem)
    view = memoryview(mem)
    t.signal(signal.SIGSTOP)
    b = eng.batch(deadline=1.0)
    b.write(view, kv)
    out = b.run()
    assert isinstance(out, quiesce.CompletionUnknown), out  # lent on this host
    assert not seg.revoke(timeout=0.2), "revoked while the stopped target may read it"
    t.signal(signal.SIGCONT)
    assert seg.revoke(timeout=30), "the drained batch still held the buffer"
    view.release()
    assert resizable(mem)
