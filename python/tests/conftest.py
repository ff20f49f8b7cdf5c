import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).with_name("peer.py")
NATIVE_PEER = Path(__file__).with_name("native_peer.py")
SECRET = "pytest: a secret every peer of this suite shares"


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch):
    monkeypatch.setenv("QUIESCE_SECRET", SECRET)
    monkeypatch.delenv("QUIESCE_OPEN_CLUSTER", raising=False)


class Peer:
    """A target process (tests/peer.py) with registered regions."""

    def __init__(self, *sizes, env=None):
        e = dict(os.environ, QUIESCE_SECRET=SECRET)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), *map(str, sizes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=e,
        )
        first = self.proc.stdout.readline().split()
        assert first and first[0] == "ready", f"peer did not start: {first}"
        self.port = int(first[1])
        self.session = f"127.0.0.1:{self.port}"
        self.regions = []
        for _ in sizes:
            w = self.proc.stdout.readline().split()
            self.regions.append((int(w[1]), int(w[2])))

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def count(self, addr, n, byte) -> int:
        return int(self.ask(f"count {addr} {n} {byte}"))

    def fill(self, addr, n, byte):
        assert self.ask(f"fill {addr} {n} {byte}") == "ok"

    def signal(self, sig):
        os.kill(self.proc.pid, sig)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.wait()


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


class NativePeer:
    """A quiesce.Engine target process (tests/native_peer.py) lending
    bytearrays as named segments."""

    def __init__(self, env=None, **segments):
        e = dict(os.environ, QUIESCE_SECRET=SECRET)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(NATIVE_PEER), *(f"{k}={v}" for k, v in segments.items())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=e,
        )
        first = self.proc.stdout.readline().split()
        assert first and first[0] == "ready", f"peer did not start: {first}"
        self.address = first[1]

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def count(self, name, byte) -> int:
        return int(self.ask(f"count {name} {byte}"))

    def fill(self, name, byte):
        assert self.ask(f"fill {name} {byte}") == "ok"

    signal = Peer.signal
    close = Peer.close


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
