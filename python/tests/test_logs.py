"""The Rust side's log records reach Python's ``logging``: warnings by
default, more with ``quiesce.set_log_filter``; loggers ``quiesce.<crate>...``."""

import logging
import time

import pytest

import quiesce
from conftest import engine, logged, runs_ok


def test_a_failed_call_is_a_warning_on_a_quiesce_logger(peer_factory, local, caplog):
    target = peer_factory(4096)
    (a, n) = target.regions[0]
    e = engine()
    src = local.buffer(4096, 1)
    assert e.transfer_sync_write(target.session, src, a + n, 4096) == -1
    r = logged(caplog, lambda r: r.levelno == logging.WARNING and "no registered memory" in r.getMessage())
    assert r is not None, [(x.name, x.getMessage()) for x in caplog.records]
    assert r.name.startswith("quiesce.python"), r.name


def batch_quiesced(caplog):
    return logged(caplog, lambda r: "batch quiesced" in r.getMessage())


@pytest.fixture
def quiesce_levels():
    """Restores the levels of the ``quiesce`` loggers a test sets, and the
    filter's link to them."""
    names = ["quiesce", "quiesce.batch", "quiesce.transports"]
    before = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in before.items():
        logging.getLogger(n).setLevel(level)
    quiesce.set_log_filter(None)
    quiesce.flush_logs()


def test_info_events_come_with_their_batch_span_once_asked_for(
    peer_factory, local, caplog, quiesce_levels
):
    # Everything at INFO except the quiesce loggers, left at their default:
    # a root level set for the application's own logs does not make every
    # transfer log (a line per batch).
    caplog.set_level(logging.INFO)
    target = peer_factory(4096)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(4096, 2)
    quiesce.flush_logs()
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    time.sleep(0.2)
    assert logged(caplog, lambda r: "batch quiesced" in r.getMessage(), 0.2) is None, (
        "INFO events under the default filter"
    )
    quiesce.set_log_filter("info")
    try:
        assert e.transfer_sync_write(target.session, src, a, 4096) == 0
        r = batch_quiesced(caplog)
    finally:
        quiesce.set_log_filter(None)
    assert r is not None, [(x.name, x.getMessage()) for x in caplog.records]
    assert r.levelno == logging.INFO
    assert r.name == "quiesce.batch.run", r.name
    assert "batch{id=" in r.getMessage(), r.getMessage()
    assert "outcome=" in r.getMessage(), r.getMessage()


def test_the_quiesce_loggers_levels_choose_the_events(peer_factory, local, caplog, quiesce_levels):
    """A level set on ``quiesce`` or one of its loggers is what the Rust side
    makes, as it would be for a Python library (applied by ``flush_logs``,
    or within a second)."""
    caplog.set_level(logging.INFO)
    target = peer_factory(4096)
    (a, n) = target.regions[0]
    e = engine()
    src = local.buffer(4096, 3)

    # Another crate's logger at INFO: not the batch's events.
    logging.getLogger("quiesce.transports").setLevel(logging.INFO)
    quiesce.flush_logs()
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    time.sleep(0.2)
    assert logged(caplog, lambda r: "batch quiesced" in r.getMessage(), 0.2) is None

    # The batch crate's logger at INFO: they come, without a flush (the
    # log thread applies the levels by itself).
    logging.getLogger("quiesce.batch").setLevel(logging.INFO)
    time.sleep(1.5)
    caplog.clear()
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    r = batch_quiesced(caplog)
    assert r is not None, [(x.name, x.getMessage()) for x in caplog.records]
    assert r.name == "quiesce.batch.run", r.name

    # ``quiesce`` at ERROR, the batch's logger back to its default: not
    # even the warning of a failed call is made.
    logging.getLogger("quiesce.batch").setLevel(logging.NOTSET)
    logging.getLogger("quiesce").setLevel(logging.ERROR)
    quiesce.flush_logs()
    caplog.clear()
    assert e.transfer_sync_write(target.session, src, a + n, 4096) == -1
    time.sleep(0.2)
    quiesce.flush_logs(0.2)
    assert not [r for r in caplog.records if r.name.startswith("quiesce")], [
        (x.name, x.getMessage()) for x in caplog.records
    ]


def test_an_explicit_filter_wins_over_the_levels(peer_factory, local, caplog, quiesce_levels):
    caplog.set_level(logging.INFO)
    target = peer_factory(4096)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(4096, 4)
    quiesce.set_log_filter("warn")
    logging.getLogger("quiesce").setLevel(logging.INFO)
    quiesce.flush_logs()
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    time.sleep(0.2)
    assert logged(caplog, lambda r: "batch quiesced" in r.getMessage(), 0.2) is None
    # None: follow the loggers' levels again.
    quiesce.set_log_filter(None)
    quiesce.flush_logs()
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    assert batch_quiesced(caplog) is not None


def test_a_filter_that_does_not_parse_is_a_value_error():
    with pytest.raises(ValueError, match="not a filter"):
        quiesce.set_log_filter("quiesce_batch=loud")


def test_a_record_made_just_before_exit_is_not_lost():
    """The exit hook closes the queue and logs what it holds; the process
    exits cleanly (the log thread is not left waiting on the queue)."""
    import os
    import subprocess
    import sys

    code = (
        "import ctypes\n"
        "from quiesce.mooncake import TransferEngine\n"
        "e = TransferEngine()\n"
        "assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
        "b = ctypes.create_string_buffer(4096)\n"
        "assert e.transfer_sync_write('127.0.0.1:1', ctypes.addressof(b), 0, 4096) == -1\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, QUIESCE_LOG="warn"),
    )
    assert out.returncode == 0, out.stderr
    # The record: no node answers at that P2P session's address.
    assert "Connection refused" in out.stderr, out.stderr


LEVELS_CODE = """
import ctypes, logging, sys
import quiesce
from quiesce.mooncake import TransferEngine
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
logging.getLogger("quiesce").setLevel(logging.INFO)
quiesce.flush_logs()  # applies the level now rather than within a second
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
b = ctypes.create_string_buffer(8192)
a = ctypes.addressof(b)
assert e.batch_register_memory([a], [8192]) == 0
assert e.transfer_sync_write(f"127.0.0.1:{e.get_rpc_port()}", a, a + 4096, 4096) == 0
quiesce.flush_logs()
"""


@pytest.mark.parametrize("env", [None, "warn"])
def test_quiesce_log_wins_over_the_levels(env):
    """``QUIESCE_LOG`` is the operator's choice: the program's levels do not
    override it (without it they apply)."""
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if k != "QUIESCE_LOG"}
    if env is not None:
        e["QUIESCE_LOG"] = env
    out = subprocess.run(
        [sys.executable, "-c", LEVELS_CODE], capture_output=True, text=True, timeout=60, env=e
    )
    assert out.returncode == 0, out.stderr
    made = "quiesce.batch.run" in out.stdout and "batch quiesced" in out.stdout
    assert made == (env is None), out.stdout


FORK_CODE = """
import ctypes, os, signal, sys, threading, time
import quiesce
from quiesce.mooncake import TransferEngine
quiesce.set_log_filter("info")  # a record per batch, made on the engine's thread
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
b = ctypes.create_string_buffer(8192)
a = ctypes.addressof(b)
assert e.batch_register_memory([a], [8192]) == 0
session = f"127.0.0.1:{e.get_rpc_port()}"
stop = False
def flood():
    while not stop:
        assert e.transfer_sync_write(session, a, a + 4096, 64) == 0
threading.Thread(target=flood, daemon=True).start()
time.sleep(0.2)
for i in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        # The child's first look at the queue: not held, and without the
        # parent's records (the parent logs those).
        os._exit(3 if quiesce._native.next_log_records(0) else 0)
    until = time.monotonic() + 5
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > until:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print(f"fork {i}: the child hung", flush=True)
            os._exit(1)
        time.sleep(0.0005)
    if os.waitstatus_to_exitcode(done[1]) != 0:
        print(f"fork {i}: the child found the parent's records", flush=True)
        os._exit(1)
stop = True
print("ok", flush=True)
"""


def test_a_fork_while_an_engine_thread_logs_does_not_hang_the_child():
    """A child forked while an engine thread held the log queue's lock (it
    logs a record per batch here) must not find the lock held for ever, nor
    log the parent's queued records a second time."""
    runs_ok(FORK_CODE, 400, timeout=300)


FORK_IDLE_CODE = """
import os, sys, threading
import quiesce

sys.setswitchinterval(1e-6)
stop = False


def flusher():
    # Nothing is logged: each flush finds the queue empty.
    while not stop:
        quiesce.flush_logs()


t = threading.Thread(target=flusher, daemon=True)
t.start()
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
stop = True
print("ok", flush=True)
"""


def test_a_fork_while_another_thread_finds_the_queue_empty_does_not_hang():
    """The fork hooks hold the log queue's lock across Python code, where
    the GIL passes to other threads: a thread that then waited for the same
    lock holding the GIL (an empty flush_logs, the log thread's idle
    timeout) hung the parent for good."""
    runs_ok(FORK_IDLE_CODE, 300, timeout=60)


FORK_WARN_CODE = """
import os, sys, threading, time

# Registered before quiesce's own hook, so it runs after it (before-fork
# hooks run in reverse order): Python code while quiesce holds the log
# queue's lock, where the GIL passes to other threads.
os.register_at_fork(before=lambda: time.sleep(0.01))
from quiesce.mooncake import TransferEngine

sys.setswitchinterval(1e-6)
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
stop = False


def warner():
    # Each call logs a warning from Rust on this thread, the GIL held.
    while not stop:
        assert e.unregister_memory(0x1234) == -1


t = threading.Thread(target=warner, daemon=True)
t.start()
time.sleep(0.1)
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
stop = True
print("ok", flush=True)
"""


def test_a_fork_while_another_thread_logs_a_warning_does_not_hang():
    """A warning logged from a Python thread (a call's complaint) takes the
    log queue's lock with the GIL held; the fork hooks hold that lock
    across Python code, where the GIL passes to that thread: it waited for
    the lock, the hooks for the GIL, for good."""
    runs_ok(FORK_WARN_CODE, 50, timeout=60)


FORK_TWO_CODE = """
import os, sys, threading, time

# Python code while quiesce's hook holds the log queue's lock: the GIL
# passes to the other forking thread.
os.register_at_fork(before=lambda: time.sleep(0.01))
import quiesce

sys.setswitchinterval(1e-6)


def forker():
    for _ in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)


ts = [threading.Thread(target=forker) for _ in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print("ok", flush=True)
"""


def test_two_threads_forking_at_once_do_not_hang():
    """The second thread's fork hook waited for the log queue's lock with
    the GIL held, while the first held that lock and waited for the GIL
    (its hooks run Python code): both hung for good."""
    runs_ok(FORK_TWO_CODE, 50, timeout=60)


def test_a_logger_name_that_is_not_a_target_does_not_stop_the_log_thread(quiesce_levels):
    """A ``quiesce.*`` logger whose name cannot be a tracing target (here
    with '='), given a level, is left out of the filter; it used to raise
    from the log thread (which died) and from every flush_logs()."""
    import threading

    bad = logging.getLogger("quiesce.a=b")
    bad.setLevel(logging.INFO)
    try:
        quiesce.flush_logs()
        quiesce.flush_logs()
        time.sleep(1.5)  # the log thread looks at the levels once a second
        assert any(t.name == "quiesce-logs" and t.is_alive() for t in threading.enumerate())
    finally:
        bad.setLevel(logging.NOTSET)


def test_flush_logs_takes_any_timeout():
    """A huge or infinite timeout waits for the first record instead of
    raising a PanicException."""
    import threading

    from quiesce.mooncake import TransferEngine

    stop = threading.Event()

    def warn():
        # Not initialised: a warning from Rust, every 10 ms (the log
        # thread takes some of them; flush_logs gets one soon).
        while not stop.wait(0.01):
            TransferEngine().transfer_sync_write("x:1", 0, 0, 1)

    t = threading.Thread(target=warn, daemon=True)
    t.start()
    try:
        for timeout in (1e20, float("inf")):
            quiesce.flush_logs(timeout)
    finally:
        stop.set()
        t.join()


def test_a_record_after_close_with_stderr_gone_is_dropped_not_a_panic():
    """After the queue closed (at exit) records go to stderr; with stderr a
    pipe nobody reads any more, writing one used to panic in the thread
    that logged (here the caller's, inside a call: a PanicException)."""
    import os
    import subprocess
    import sys

    code = (
        "import time, quiesce, quiesce._native as n\n"
        "from quiesce.mooncake import TransferEngine\n"
        "n.close_log_records()\n"
        "time.sleep(0.5)\n"  # the reader below has closed its end by now
        "print(TransferEngine().transfer_sync_write('x:1', 0, 0, 1), flush=True)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "QUIESCE_LOG"},
    )
    p.stderr.close()
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and out.strip() == "-1", (p.returncode, out)


ENV_RACE_CODE = """
import threading
import quiesce
from quiesce import _logs

applied = []
real = _logs._native


class Native:
    # The native module, recording each filter applied; the first time the
    # environment's filter is applied, another thread's set_log_filter runs
    # first (given half a second: with the fix it waits for the lock).
    def __getattr__(self, name):
        return getattr(real, name)

    def set_log_filter(self, directives):
        if directives == _logs._ENV and not applied:
            applied.append("-")
            t = threading.Thread(target=quiesce.set_log_filter, args=("debug",))
            t.start()
            t.join(0.5)
        applied.append(directives)
        real.set_log_filter(directives)


_logs._native = Native()
quiesce.set_log_filter(None)
for t in threading.enumerate():
    if t is not threading.current_thread() and t.name != "quiesce-logs":
        t.join()
assert _logs._explicit == "debug", _logs._explicit
assert applied[-1] == "debug", applied
print("ok", flush=True)
"""


def test_set_log_filter_none_does_not_undo_another_threads_filter():
    """With QUIESCE_LOG set, set_log_filter(None) applied the environment's
    filter after letting go of its lock: another thread's
    set_log_filter("debug") in between was undone on the Rust side while
    it stayed the explicit choice on the Python side."""
    runs_ok(ENV_RACE_CODE, 0, timeout=60, quiesce_log="warn")
