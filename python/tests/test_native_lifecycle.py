"""quiesce.Engine, the native API, across its end: closing an engine with
batches in flight or calls waiting, and CompletionUnknown tickets that
outlive a sweep, a Ctrl-C or the engine."""

import asyncio
import signal
import threading
import time

import pytest

import quiesce
from conftest import SECRET, resizable

MiB = 1 << 20


@pytest.mark.parametrize("local", ["off", "auto"])
def test_close_answers_batches_in_flight(native_peer, monkeypatch, local):
    """close() answers a batch in flight to a stopped target. Over TCP it
    drains (the kernel copied the bytes): True, and the buffer is the
    caller's. On this host (auto: the local transport) the target's own
    process reads the buffer, and a stopped one may still: close() says
    False and the buffer stays held for good (it said True and let it go)."""
    monkeypatch.setenv("QUIESCE_LOCAL", local)
    t = native_peer(kv=64 * MiB)
    e = quiesce.Engine(secret=SECRET)
    kv = e.open(t.address, "kv")
    t.signal(signal.SIGSTOP)
    src = bytearray(64 * MiB)

    async def main():
        b = e.batch(deadline=60.0)
        b.write(src, kv)
        task = asyncio.ensure_future(b.run_async())
        await asyncio.sleep(0.1)
        assert e.close() == (local == "off")
        try:
            return await asyncio.wait_for(task, 10)
        except quiesce.EngineClosed as err:
            return err

    got = asyncio.run(main())
    assert isinstance(got, (quiesce.EngineClosed, quiesce.Failed)), got
    if local == "off":
        assert resizable(src), "closed and drained, yet the buffer is held"
    else:
        assert not resizable(src), "let go while the stopped target can still read it"
    if isinstance(got, quiesce.EngineClosed):
        # The exception says which: a caller must not reuse held buffers.
        assert got.buffers_held == (local != "off"), (got, got.buffers_held)
    # So does the closed engine: nothing it held for good comes back.
    assert e.wait_for_quiescence(0) == (local == "off")
    assert e.pending() == []
    with pytest.raises(quiesce.EngineClosed):
        e.open(t.address, "kv")
    t.signal(signal.SIGCONT)


def test_a_batch_started_on_a_closed_engine_gives_its_buffers_back(native_peer):
    """EngineClosed from run_async (or run) means the batch took nothing:
    its buffers are the caller's again. run_async took them before it
    learned the engine was closed, and kept them for good."""
    t = native_peer(kv=MiB)
    e = quiesce.Engine(secret=SECRET)
    kv = e.open(t.address, "kv")
    src = bytearray(4096)
    b = e.batch()
    b.write(src, kv)
    assert e.close()
    with pytest.raises(quiesce.EngineClosed):
        asyncio.run(b.run_async())
    assert resizable(src), "the batch raised EngineClosed, yet holds the buffer"
    # Opening on a closed engine is EngineClosed too, whatever the peer
    # (it was DirectoryUnavailable: the closed directory answered first).
    for peer in ("localhost:1", t.address):
        with pytest.raises(quiesce.EngineClosed):
            e.open(peer, "kv")


def test_a_close_waiting_for_a_blocking_call_does_not_freeze_python(native_peer):
    """While one thread's run() blocks on a stopped target and another's
    close() waits for it, reading eng.address waited for the engine's lock
    with the GIL held: every Python thread stalled until the run ended."""
    import threading

    t = native_peer(kv=MiB)
    e = quiesce.Engine(secret=SECRET)
    kv = e.open(t.address, "kv")
    t.signal(signal.SIGSTOP)
    gaps, stop = [], threading.Event()

    def heartbeat():
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    def run():
        b = e.batch(deadline=3.0)
        b.write(bytearray(4096), kv)
        b.run()

    beat = threading.Thread(target=heartbeat)
    runner = threading.Thread(target=run)
    closer = threading.Thread(target=e.close)
    beat.start()
    runner.start()
    time.sleep(0.3)
    closer.start()
    time.sleep(0.3)
    # (So did pending(), asking whether the engine closed.)
    e.pending()
    try:
        e.address
    except quiesce.EngineClosed:
        pass
    runner.join()
    closer.join()
    stop.set()
    beat.join()
    t.signal(signal.SIGCONT)
    assert max(gaps) < 1.0, f"Python stalled for {max(gaps):.1f} s"


def blocked_run(native_peer):
    """A stopped target's 1 MiB segment open on a new engine, and a thread
    0.3 s into run() of a 4 KiB write to it (3 s deadline). Returns
    (target, engine, segment, that thread)."""
    t = native_peer(kv=MiB)
    e = quiesce.Engine(secret=SECRET)
    kv = e.open(t.address, "kv")
    t.signal(signal.SIGSTOP)

    def run():
        b = e.batch(deadline=3.0)
        b.write(bytearray(4096), kv)
        try:
            b.run()
        except quiesce.QuiesceError:
            pass

    runner = threading.Thread(target=run)
    runner.start()
    time.sleep(0.3)
    return t, e, kv, runner


def test_run_async_while_a_close_waits_does_not_block_the_event_loop(native_peer):
    """While one thread's run() blocks on a stopped target and another's
    close() waits for it, an asyncio task's run_async() submitted on the
    loop's thread, waiting for the engine behind that close: the loop froze
    until the run's deadline ended, then got EngineClosed."""
    t, e, kv, runner = blocked_run(native_peer)
    closer = threading.Thread(target=e.close)
    closer.start()
    time.sleep(0.3)

    async def main():
        gaps, done = [], asyncio.Event()

        async def heartbeat():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.05)
        b = e.batch(deadline=3.0)
        b.write(bytearray(4096), kv)
        with pytest.raises(quiesce.EngineClosed):
            await b.run_async()
        await asyncio.sleep(0.05)
        done.set()
        await beat
        return max(gaps)

    try:
        worst = asyncio.run(main())
    finally:
        t.signal(signal.SIGCONT)
        runner.join()
        closer.join()
    assert worst < 1.0, f"the event loop stalled for {worst:.1f} s"


def test_a_forked_childs_close_does_not_wait_for_the_parents_threads(native_peer):
    """A thread of the parent was inside run() (holding the engine's read
    lock) when another forked: the child's close() waited for that lock,
    which no thread of the child will ever release."""
    import os

    t, e, kv, runner = blocked_run(native_peer)
    pid = os.fork()
    if pid == 0:
        e.close()
        os._exit(0)
    try:
        until = time.monotonic() + 10
        while time.monotonic() < until:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's close() hung")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    finally:
        t.signal(signal.SIGCONT)
        runner.join()
        e.close()


def test_wait_for_quiescence_after_a_close_says_true_only_once_buffers_are_let_go(native_peer, monkeypatch):
    """After a close that drained, wait_for_quiescence() said True while a
    submitted batch's buffer was still held: the delivery thread, which
    lets it go, needs the GIL the caller held."""
    monkeypatch.setenv("QUIESCE_LOCAL", "off")
    t = native_peer(kv=MiB)
    engines = [quiesce.Engine(secret=SECRET) for _ in range(10)]
    opened = [(e, e.open(t.address, "kv")) for e in engines]
    t.signal(signal.SIGSTOP)
    try:

        async def main(e, kv, src):
            b = e.batch(deadline=5.0)
            b.write(src, kv)
            task = asyncio.ensure_future(b.run_async())
            await asyncio.sleep(0)  # submitted
            e.close()
            said = e.wait_for_quiescence(0)
            free = resizable(src)
            try:
                await task
            except quiesce.EngineClosed:
                pass
            return said, free

        for round, (e, kv) in enumerate(opened):
            src = bytearray(4096)
            said, free = asyncio.run(main(e, kv, src))
            assert free or not said, f"round {round}: True while the batch's buffer was still held"
    finally:
        t.signal(signal.SIGCONT)


def test_a_wait_for_quiescence_across_an_undrained_close_says_false(native_peer, monkeypatch):
    """A wait_for_quiescence() that began before a close() which could not
    drain (a stopped target on this host reads the source itself) must not
    say True: the batch's buffers are held for good. It found the tickets
    and flights emptied by the close and said True."""
    import threading

    monkeypatch.setenv("QUIESCE_LOCAL", "auto")
    t = native_peer(kv=64 * MiB)
    e = quiesce.Engine(secret=SECRET)
    kv = e.open(t.address, "kv")
    t.signal(signal.SIGSTOP)
    src = bytearray(64 * MiB)
    out = []

    async def main():
        b = e.batch(deadline=60.0)
        b.write(src, kv)
        task = asyncio.ensure_future(b.run_async())
        await asyncio.sleep(0.1)
        waiter = threading.Thread(target=lambda: out.append(e.wait_for_quiescence(60)))
        waiter.start()
        await asyncio.sleep(0.2)
        assert e.close() is False
        waiter.join(30)
        try:
            await asyncio.wait_for(task, 10)
        except quiesce.EngineClosed:
            pass

    asyncio.run(main())
    t.signal(signal.SIGCONT)
    assert out == [False], out


def test_a_tickets_wait_from_two_threads_keeps_to_its_timeout():
    """Two threads wait on one CompletionUnknown: the second waited for the
    first's turn and then for its whole timeout again (twice as long)."""
    import threading

    class Undrained:
        def wait(self, ticket, timeout):
            time.sleep(timeout)
            return None

    unknown = quiesce.CompletionUnknown(1, Undrained(), [])
    took = []

    def wait():
        t0 = time.monotonic()
        assert unknown.wait(1.0) is None
        took.append(time.monotonic() - t0)

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(took) < 1.6, took


def stalled_batch(e, t, kv):
    """A batch of 64 MiB to the native peer ``t``, which is stopped (on
    this host: its own process reads the source, and may still once
    resumed), with a 1 s deadline; not run yet."""
    warm = e.batch()
    warm.write(bytearray(4096), kv)
    assert isinstance(warm.run(), quiesce.Completed)
    t.signal(signal.SIGSTOP)
    b = e.batch(deadline=1.0)
    b.write(bytearray([5]) * (64 * MiB), kv)
    return b


def completion_unknown(e, t, kv):
    """A ``stalled_batch`` run: CompletionUnknown after its deadline; the
    target is left stopped."""
    out = stalled_batch(e, t, kv).run()
    assert isinstance(out, quiesce.CompletionUnknown), out
    return out


def test_a_tickets_wait_racing_a_sweep_gets_the_outcome(native_peer, eng, monkeypatch):
    """A CompletionUnknown's wait() while another thread sweeps (pending())
    gets the drained outcome, whichever of the two the engine answered, and
    the sweep raises nothing: the loser of the race was told "unknown
    ticket" (InvalidInput)."""
    monkeypatch.setenv("QUIESCE_LOCAL", "auto")
    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    for _ in range(3):
        out = completion_unknown(eng, t, kv)
        stop, errors = threading.Event(), []

        def sweep():
            while not stop.is_set():
                try:
                    eng.pending()
                except Exception as err:  # noqa: BLE001 - any is the bug
                    errors.append(err)
                    return

        sweeper = threading.Thread(target=sweep)
        sweeper.start()
        t.signal(signal.SIGCONT)
        try:
            got = out.wait(30)
        finally:
            stop.set()
            sweeper.join(30)
        assert errors == [], errors
        assert isinstance(got, (quiesce.Completed, quiesce.Failed)), got
        assert eng.pending() == []


def test_a_wait_interrupted_by_ctrl_c_keeps_the_outcome(native_peer, eng, monkeypatch, python_sigint):
    """Ctrl-C while a CompletionUnknown's wait() blocks: the wait goes on
    until the batch drained (the engine's wait cannot be cut), and the
    KeyboardInterrupt comes as it returns — before the Python side kept the
    outcome. The engine answers a ticket once, so the next wait() raised
    InvalidInput ('unknown ticket'); the outcome must survive."""
    import _thread

    monkeypatch.setenv("QUIESCE_LOCAL", "auto")
    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    out = completion_unknown(eng, t, kv)

    def interrupt_then_resume():
        time.sleep(0.5)
        _thread.interrupt_main()
        time.sleep(0.2)
        t.signal(signal.SIGCONT)

    th = threading.Thread(target=interrupt_then_resume)
    th.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            out.wait(20)
            time.sleep(5)  # the interrupt, had the wait kept it first
    finally:
        th.join(30)
    got = out.wait(5)
    assert isinstance(got, (quiesce.Completed, quiesce.Failed)), got
    assert eng.pending() == []


def test_a_tickets_wait_after_an_undrained_close_says_its_buffers_are_held(native_peer, monkeypatch):
    """wait() on a CompletionUnknown, and revoke() of a registered range,
    after a close() that could not drain raise EngineClosed with
    buffers_held=True: the memory stays held for good and must not be
    reused. They said buffers_held=False."""
    monkeypatch.setenv("QUIESCE_LOCAL", "auto")
    t = native_peer(kv=64 * MiB)
    e = quiesce.Engine(secret=SECRET)
    kv = e.open(t.address, "kv")
    mine = e.register("mine", bytearray(4096))
    out = completion_unknown(e, t, kv)
    try:
        assert e.close() is False
        with pytest.raises(quiesce.EngineClosed) as waited:
            out.wait(1)
        assert waited.value.buffers_held is True
        with pytest.raises(quiesce.EngineClosed) as revoked:
            mine.revoke(1)
        assert revoked.value.buffers_held is True
    finally:
        t.signal(signal.SIGCONT)


def test_a_call_after_a_drained_close_says_nothing_is_held(native_peer):
    """After a close() that drained, wait() and revoke() raise EngineClosed
    with buffers_held=False: the memory is the caller's again."""
    t = native_peer(kv=MiB)
    e = quiesce.Engine(secret=SECRET)
    mine = e.register("mine", bytearray(4096))
    assert e.close() is True
    with pytest.raises(quiesce.EngineClosed) as revoked:
        mine.revoke(1)
    assert revoked.value.buffers_held is False
    with pytest.raises(quiesce.EngineClosed) as opened:
        e.open(t.address, "kv")
    assert opened.value.buffers_held is False


def test_wait_for_quiescence_waits_for_a_blocking_run_on_another_thread(native_peer, eng):
    """A blocking run() on another thread (an executor's, say, whose
    awaiting task was cancelled) still moves its buffers:
    wait_for_quiescence() must not say True meanwhile. It looked only at
    submitted batches and tickets."""
    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    src = bytearray([5]) * (64 * MiB)
    t.signal(signal.SIGSTOP)
    b = eng.batch(deadline=3.0)
    b.write(src, kv)
    done = []
    th = threading.Thread(target=lambda: done.append(b.run()))
    th.start()
    time.sleep(0.3)
    try:
        assert not eng.wait_for_quiescence(0.2), "True while another thread's run moves its buffer"
        assert not resizable(src)
    finally:
        t.signal(signal.SIGCONT)
    th.join(30)
    assert done, "the run never returned"
    assert eng.wait_for_quiescence(30)


def test_a_forked_child_is_refused_even_with_the_engine_lock_held_at_the_fork(native_peer, eng):
    """At the fork a parent's thread is inside run() (the engine's read lock
    held) and another waits in close() for the write lock: no thread of the
    child ever lets go of either, so every native call that took the lock
    before asking whether it runs in a forked child parked for good."""
    import os

    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    t.signal(signal.SIGSTOP)
    b = eng.batch(deadline=2.0)
    b.write(bytearray(64 * MiB), kv)
    runner = threading.Thread(target=b.run)
    runner.start()
    time.sleep(0.3)
    closer = threading.Thread(target=eng.close)
    closer.start()
    time.sleep(0.3)
    pid = os.fork()
    if pid == 0:
        threading.Timer(5, lambda: os._exit(7)).start()
        code = 0
        small = eng.batch()
        small.write(bytearray(8), kv)
        for call in (eng.pending, lambda: eng.wait_for_quiescence(0), small.run):
            try:
                call()
                code = 1
            except quiesce.QuiesceError:
                pass
            except BaseException:
                code = 2
        os._exit(code)
    t.signal(signal.SIGCONT)
    _, status = os.waitpid(pid, 0)
    runner.join(30)
    closer.join(30)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"the child's calls: exit {os.WEXITSTATUS(status) if os.WIFEXITED(status) else status} "
        "(7: parked on a lock, 1: no error, 2: another error)"
    )


def test_a_run_interrupted_by_ctrl_c_keeps_its_outcome(native_peer, eng, monkeypatch, python_sigint):
    """Ctrl-C while run() blocks: the run goes on to its outcome (it cannot
    be cut), and the KeyboardInterrupt comes as it returns — before the
    caller got the outcome. A CompletionUnknown lost so is the only handle
    on buffers still pinned; the caller, told nothing, would reuse them.
    ``Batch.outcome`` keeps it. It was lost."""
    import _thread

    monkeypatch.setenv("QUIESCE_LOCAL", "auto")
    t = native_peer(kv=64 * MiB)
    kv = eng.open(t.address, "kv")
    b = stalled_batch(eng, t, kv)
    assert b.outcome is None
    th = threading.Timer(0.5, _thread.interrupt_main)
    th.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            b.run()
            time.sleep(5)  # the interrupt, had the run kept it first
    finally:
        th.join(30)
    out = b.outcome
    assert isinstance(out, quiesce.CompletionUnknown), out
    assert out is b.outcome, "one outcome per batch"
    t.signal(signal.SIGCONT)
    assert isinstance(out.wait(20), (quiesce.Completed, quiesce.Failed))
    assert eng.pending() == []
