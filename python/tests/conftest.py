import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PEER = Path(__file__).with_name("peer.py")
NATIVE_PEER = Path(__file__).with_name("native_peer.py")
SECRET = "pytest: a secret every peer of this suite shares"


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch):
    monkeypatch.setenv("QUIESCE_SECRET", SECRET)
    monkeypatch.delenv("QUIESCE_OPEN_CLUSTER", raising=False)


def wait_stopped(pid, within=10.0):
    """Waits until every thread of `pid` is in the stopped state (but
    io_uring's kernel workers, "iou-*", which run no code of the process)."""
    deadline = time.monotonic() + within
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    # "tid (comm) STATE ...": comm may hold spaces and ")".
                    head, tail = f.read().split("(", 1)[1].rsplit(")", 1)
                if not head.startswith("iou-"):
                    states.append(tail.split()[0])
            except FileNotFoundError:
                pass  # a thread that ended
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.001)


class PeerProcess:
    """A target process driven over stdin/stdout: it prints ``ready ...``
    first, then answers one command a line."""

    def __init__(self, script, args, env=None):
        e = dict(os.environ, QUIESCE_SECRET=SECRET)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=e,
        )
        self.ready = self.proc.stdout.readline().split()
        assert self.ready and self.ready[0] == "ready", f"peer did not start: {self.ready}"

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def signal(self, sig):
        """Sends `sig`; for SIGSTOP, returns only once every thread of the
        process has stopped. The kernel wakes one thread for a stop signal
        and that one stops the others, so right after kill(2) another
        thread (the engine's reactor) can still answer for a while."""
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGSTOP:
            wait_stopped(self.proc.pid)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.wait()


class Peer(PeerProcess):
    """A quiesce.mooncake target process (tests/peer.py) with registered regions."""

    def __init__(self, *sizes, env=None):
        super().__init__(PEER, map(str, sizes), env)
        self.port = int(self.ready[1])
        self.session = f"127.0.0.1:{self.port}"
        self.regions = []
        for _ in sizes:
            w = self.proc.stdout.readline().split()
            self.regions.append((int(w[1]), int(w[2])))

    def count(self, addr, n, byte) -> int:
        return int(self.ask(f"count {addr} {n} {byte}"))

    def fill(self, addr, n, byte):
        assert self.ask(f"fill {addr} {n} {byte}") == "ok"


@pytest.fixture
def peer_factory():
    made = []

    def make(*sizes, env=None):
        p = Peer(*sizes, env=env)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


class NativePeer(PeerProcess):
    """A quiesce.Engine target process (tests/native_peer.py) lending
    bytearrays as named segments."""

    def __init__(self, env=None, **segments):
        super().__init__(NATIVE_PEER, (f"{k}={v}" for k, v in segments.items()), env)
        self.address = self.ready[1]

    def count(self, name, byte) -> int:
        return int(self.ask(f"count {name} {byte}"))

    def fill(self, name, byte):
        assert self.ask(f"fill {name} {byte}") == "ok"


@pytest.fixture
def native_peer():
    made = []

    def make(env=None, **segments):
        p = NativePeer(env, **segments)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def engine(protocol="tcp"):
    """An initialised quiesce.mooncake.TransferEngine on loopback."""
    from quiesce.mooncake import TransferEngine

    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    return e


class Local:
    """Local buffers for an initiator (kept alive by this object)."""

    def __init__(self):
        self.bufs = []

    def buffer(self, n, byte=0):
        b = ctypes.create_string_buffer(n)
        if byte:
            ctypes.memset(b, byte, n)
        self.bufs.append(b)
        return ctypes.addressof(b)


@pytest.fixture
def local():
    return Local()


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler, for tests that interrupt the main
    thread (``_thread.interrupt_main``): Python does not install it when it
    starts with SIGINT ignored — as a background job of a non-interactive
    shell does — and then the interrupt does nothing."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def seed_round(e, target, probe, src, small, big, length):
    """One round of the seed scenario through the Mooncake drop-in: [4 KiB to
    ``small``, which the target withdrew, ``length`` bytes to ``big``] must
    return -1, after which the source is rewritten at once. True if any
    rewritten byte reached the target (counted there 0.1 s later)."""
    target.fill(big, length, 0)
    ctypes.memset(src, 0xAA, length)
    ret = e.batch_transfer_sync_write(target.session, [probe, src], [small, big], [4096, length])
    assert ret == -1, ret
    # -1: nothing reads the source any more. Rewrite it at once.
    ctypes.memset(src, 0xBB, length)
    time.sleep(0.1)
    return target.count(big, length, 0xBB) != 0


def logged(caplog, pred, timeout=5.0):
    """The first captured record for which ``pred`` holds, waiting up to
    ``timeout`` s: the log thread hands records to ``logging`` on its own
    time (it may hold one it took from the queue when ``flush_logs`` runs)."""
    import quiesce

    until = time.monotonic() + timeout
    while True:
        quiesce.flush_logs(0.05)
        for r in caplog.records:
            if pred(r):
                return r
        if time.monotonic() >= until:
            return None


def stopped_target(peer_factory, local, monkeypatch, byte):
    """A target of 64 MiB, an engine whose transfers have a 5 s deadline
    and that wrote to it once (connected), and a 64 MiB source of ``byte``;
    the target then stopped (SIGSTOP). Returns (target, its range's
    address, engine, source)."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    target = peer_factory(64 << 20)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(64 << 20, byte)
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    target.signal(signal.SIGSTOP)
    return target, a, e, src


def answers_after_resume(target, e, call):
    """Runs ``call`` (a transfer call on ``e`` to the stopped ``target``) in
    a thread; checks that it is still waiting 7 s in — past a 5 s deadline
    and the fence's grace, where a -2 would have come — then resumes the
    target and checks that the call answers 0 or -1 and leaves nothing
    pending."""
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(call()))
    t0 = time.monotonic()
    t.start()
    time.sleep(7)
    assert not out, f"answered {out} while the target is stopped"
    target.signal(signal.SIGCONT)
    t.join(30)
    assert out and out[0] in (0, -1), out
    assert time.monotonic() - t0 < 37
    assert e.wait_for_quiescence(0) == 0, "a ticket left pending"


def runs_ok(code, n, timeout, quiesce_log=None):
    """Runs ``code`` with argument ``n`` in a fresh interpreter (with
    ``QUIESCE_LOG`` only if given); it must print "ok" within ``timeout``
    seconds."""
    env = {k: v for k, v in os.environ.items() if k != "QUIESCE_LOG"}
    if quiesce_log is not None:
        env["QUIESCE_LOG"] = quiesce_log
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(n)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"hung: no answer in {timeout} s")
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr[-2000:]


def resizable(buf: bytearray) -> bool:
    """Whether nothing holds an export of ``buf`` (a held buffer cannot be resized)."""
    try:
        buf.append(0)
    except BufferError:
        return False
    buf.pop()
    return True


@pytest.fixture
def eng():
    """A native quiesce.Engine with the tests' shared secret, closed after."""
    import quiesce

    e = quiesce.Engine(secret=SECRET)
    yield e
    e.close()
