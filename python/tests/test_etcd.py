"""Mooncake's ``initialize(..., "etcd://host:port", ...)``: engines publish
themselves in a private etcd (Debian's etcd-server, started per test) and
find each other there by name. Without an etcd binary the tests are
skipped, and fail under CI=true."""

import ctypes
import itertools
import os
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from quiesce.mooncake import TransferEngine


def _ephemeral_ports():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(p) for p in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


_probes = itertools.count(os.getpid() * 7919)


def _free_port():
    """A port nothing is bound to now, outside the ephemeral range: a port
    the kernel picked (bind to 0) can be handed to any connecting socket
    before etcd binds it, and etcd then exits "address already in use"."""
    lo, hi = _ephemeral_ports()
    ports = [p for p in range(10000, 65535) if not lo <= p <= hi]
    for _ in range(4096):
        port = ports[next(_probes) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free port outside the ephemeral range")


def _start_etcd(binary, tmp_path):
    """Starts etcd on free ports; returns (process, client port), or None
    when a port was taken before etcd bound it."""
    client, peer = _free_port(), _free_port()
    c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    with open(tmp_path / "etcd.log", "w") as log:
        proc = subprocess.Popen(
            [binary, "--name=py", f"--data-dir={tmp_path / 'data'}",
             f"--listen-client-urls={c}", f"--advertise-client-urls={c}",
             f"--listen-peer-urls={p}", f"--initial-advertise-peer-urls={p}",
             f"--initial-cluster=py={p}"],
            stdout=log, stderr=log,
        )
    deadline = time.monotonic() + 20
    while True:
        try:
            if b'"health":"true"' in urllib.request.urlopen(c + "/health", timeout=1).read():
                return proc, client
        except OSError:
            pass
        if proc.poll() is not None:
            if "address already in use" in (tmp_path / "etcd.log").read_text():
                shutil.rmtree(tmp_path / "data", ignore_errors=True)
                return None
            raise AssertionError("etcd exited: " + (tmp_path / "etcd.log").read_text()[-500:])
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError("etcd did not start within 20 s")
        time.sleep(0.05)


@pytest.fixture
def etcd(tmp_path):
    binary = shutil.which("etcd")
    if binary is None:
        assert os.environ.get("CI") != "true", "CI=true but no etcd binary"
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    for _ in range(4):
        started = _start_etcd(binary, tmp_path)
        if started is not None:
            break
    else:
        raise AssertionError("etcd's ports were taken four times over")
    proc, client = started
    yield f"127.0.0.1:{client}"
    proc.kill()
    proc.wait()


def _engine(name, metadata, ext=None):
    e = TransferEngine()
    if ext is None:
        assert e.initialize(name, metadata, "tcp", "") == 0
    else:
        assert e.initialize_ext(name, metadata, "tcp", "", ext) == 0
    return e


def test_engines_find_each_other_by_name_through_etcd(etcd):
    # Distinct loopback addresses: the name is the address, as in Mooncake.
    target = _engine("127.0.0.2", f"etcd://{etcd}/pytest")
    initiator = _engine("127.0.0.3", etcd, ext="etcd")  # Mooncake's bare form
    dst = target.allocate_managed_buffer(1 << 20)
    src = initiator.allocate_managed_buffer(4096)
    try:
        initiator.write_bytes_to_buffer(src, b"\x5a" * 4096, 4096)
        # Prefixes keep clusters apart: this initiator looks under the
        # default prefix, the target published under "pytest".
        assert initiator.transfer_sync_write("127.0.0.2", src, dst, 4096) < 0
        other = _engine("127.0.0.4", f"etcd://{etcd}/pytest")
        src2 = other.allocate_managed_buffer(4096)
        other.write_bytes_to_buffer(src2, b"\x5a" * 4096, 4096)
        assert other.get_first_buffer_address("127.0.0.2") == dst
        # A probe finds the peer by its name, as a transfer does.
        assert other.send_probe("127.0.0.2") == 0
        assert other.send_probe("127.0.0.9") == -1
        assert other.transfer_sync_write("127.0.0.2", src2, dst, 4096) == 0
        assert target.read_bytes_from_buffer(dst, 4096) == b"\x5a" * 4096
        assert other.transfer_sync_write("127.0.0.9", src2, dst, 4096) == -1
        other.free_managed_buffer(src2, 4096)
    finally:
        initiator.free_managed_buffer(src, 4096)
        target.free_managed_buffer(dst, 1 << 20)


def test_registered_memory_is_published_and_withdrawn(etcd):
    target = _engine("127.0.0.5", f"etcd://{etcd}")
    initiator = _engine("127.0.0.6", f"etcd://{etcd}")
    buf = ctypes.create_string_buffer(8192)
    addr = ctypes.addressof(buf)
    src = initiator.allocate_managed_buffer(4096)
    try:
        assert target.register_memory(addr, 8192) == 0
        assert initiator.transfer_sync_write("127.0.0.5", src, addr + 4096, 4096) == 0
        assert target.unregister_memory(addr) == 0
        assert initiator.transfer_sync_write("127.0.0.5", src, addr, 4096) == -1
    finally:
        initiator.free_managed_buffer(src, 4096)


def test_an_unreachable_metadata_server_fails_initialize():
    port = _free_port()
    e = TransferEngine()
    started = time.monotonic()
    assert e.initialize("127.0.0.7", f"etcd://127.0.0.1:{port}", "tcp", "") == -1
    assert time.monotonic() - started < 15
    assert TransferEngine().initialize("127.0.0.7", "zk://x:1", "tcp", "") == -1



def test_initialize_with_etcd_refuses_an_address_peers_cannot_reach(etcd):
    """The directory tells peers where this engine listens: 0.0.0.0 would
    send each peer to its own host (and, under one shared name, into its
    own memory), so initialize with etcd refuses it, as the native
    Engine does."""
    e = TransferEngine()
    assert e.initialize("0.0.0.0", f"etcd://{etcd}", "tcp", "") == -1
    assert e.initialize(f"0.0.0.0:{_free_port()}", f"etcd://{etcd}", "tcp", "") == -1

SECRET = b"test_etcd: a secret both engines share"


def test_native_engines_find_each_other_and_segments_by_path(etcd):
    import quiesce

    url = f"etcd://{etcd}/native"
    target = quiesce.Engine("127.0.0.1:0", secret=SECRET, directory=url, node="prefill-0")
    initiator = quiesce.Engine(secret=SECRET, directory=url, node="decode-0")
    kv = bytearray(1 << 20)
    try:
        seg = target.register("kv", kv)
        # By node/segment path, and by node name and segment.
        remote = initiator.open("prefill-0/kv")
        assert (remote.address, remote.length) == (seg.address, seg.length)
        assert initiator.open("prefill-0", "kv").length == 1 << 20
        b = initiator.batch()
        b.write(bytearray(b"\x7e" * 4096), remote, offset=8192)
        assert isinstance(b.run(), quiesce.Completed)
        assert kv[8192 : 8192 + 4096] == b"\x7e" * 4096
        # A name the directory does not hold; a path without a segment.
        with pytest.raises(quiesce.UnknownPeer):
            initiator.open("nobody/kv")
        with pytest.raises(quiesce.InvalidInput):
            initiator.open("prefill-0")
        # Closing the target takes its entry with it: a fresh engine (empty
        # cache) finds nothing.
        assert seg.revoke()
        assert target.close()
        late = quiesce.Engine(secret=SECRET, directory=url, node="decode-1")
        try:
            deadline = time.monotonic() + 5
            while True:
                try:
                    late.open("prefill-0/kv")
                except quiesce.UnknownPeer:
                    break
                except quiesce.PeerUnreachable:
                    pass  # still listed a moment after the close
                assert time.monotonic() < deadline, "the closed engine is still listed"
                time.sleep(0.1)
        finally:
            late.close()
    finally:
        target.close()
        initiator.close()


def test_a_native_engine_refuses_an_unreachable_directory():
    import quiesce

    started = time.monotonic()
    with pytest.raises(quiesce.DirectoryUnavailable):
        quiesce.Engine(secret=SECRET, directory=f"etcd://127.0.0.1:{_free_port()}", node="n")
    assert time.monotonic() - started < 15
    with pytest.raises(quiesce.InvalidInput):
        quiesce.Engine(secret=SECRET, directory="zk://x:1")


def _node_keys(etcd, prefix):
    """The node entries under `prefix`, read through etcd's JSON gateway."""
    import base64
    import json

    body = json.dumps({"key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode()})
    req = urllib.request.Request(f"http://{etcd}/v3/kv/range", data=body.encode(), method="POST")
    kvs = json.loads(urllib.request.urlopen(req, timeout=5).read()).get("kvs", [])
    keys = [base64.b64decode(kv["key"]).decode() for kv in kvs]
    return sorted(k.split("/nodes/", 1)[1] for k in keys if prefix in k and "/nodes/" in k)


def test_a_native_engine_is_published_under_its_bound_address(etcd):
    import quiesce

    url = f"etcd://{etcd}/bound"
    # A wildcard would tell peers nothing they can reach.
    with pytest.raises(quiesce.InvalidInput):
        quiesce.Engine("0.0.0.0:0", secret=SECRET, directory=url)
    # Unnamed engines are their bound "ip:port": two never share an entry,
    # and one's close takes only its own.
    a = quiesce.Engine(secret=SECRET, directory=url)
    b = quiesce.Engine(secret=SECRET, directory=url)
    try:
        assert a.address != b.address
        assert _node_keys(etcd, "bound") == sorted([a.address, b.address])
        b.close()
        deadline = time.monotonic() + 5
        while _node_keys(etcd, "bound") != [a.address]:
            assert time.monotonic() < deadline, _node_keys(etcd, "bound")
            time.sleep(0.05)
    finally:
        a.close()
        b.close()


def _copy_entry(etcd, key_from, key_to):
    """Writes etcd's value at `key_from` under `key_to` too (no lease: an
    entry that outlives its node, as a dead node's does within its TTL)."""
    import base64
    import json

    def call(path, body):
        req = urllib.request.Request(f"http://{etcd}/v3/kv/{path}", data=json.dumps(body).encode(), method="POST")
        return json.loads(urllib.request.urlopen(req, timeout=5).read())

    enc = lambda s: base64.b64encode(s.encode()).decode()
    kvs = call("range", {"key": enc(key_from)}).get("kvs", [])
    assert kvs, f"no entry at {key_from}"
    call("put", {"key": enc(key_to), "value": kvs[0]["value"]})


def test_a_stale_entry_at_a_cached_peers_address_writes_nothing(etcd):
    """As above, but the caller wrote to the live node first, so the range
    at that address is kept: a transfer by the dead node's name must be
    refused, not land in the kept range. The kept range skipped the check
    of who is at the address, and the write answered 0."""
    target = _engine("127.0.0.21", f"etcd://{etcd}/stale3")
    caller = _engine("127.0.0.22", f"etcd://{etcd}/stale3")
    dst = target.allocate_managed_buffer(1 << 20)
    src = caller.allocate_managed_buffer(4096)
    try:
        caller.write_bytes_to_buffer(src, b"\x11" * 4096, 4096)
        assert caller.transfer_sync_write("127.0.0.21", src, dst, 4096) == 0
        _copy_entry(etcd, "stale3/nodes/127.0.0.21", "stale3/nodes/127.0.0.23")
        caller.write_bytes_to_buffer(src, b"\x77" * 4096, 4096)
        assert caller.transfer_sync_write("127.0.0.23", src, dst, 4096) == -1
        assert target.read_bytes_from_buffer(dst, 4096) == b"\x11" * 4096
        # The live node's own name still reaches it.
        assert caller.transfer_sync_write("127.0.0.21", src, dst, 4096) == 0
        assert target.read_bytes_from_buffer(dst, 4096) == b"\x77" * 4096
    finally:
        caller.free_managed_buffer(src, 4096)
        target.free_managed_buffer(dst, 1 << 20)


def test_a_stale_entry_at_another_nodes_address_opens_nothing(etcd):
    """A dead node's entry names an address another node listens on now,
    with a segment of the same name and the same secret: opening by the
    dead node's name must not open the live node's memory."""
    import quiesce

    url = f"etcd://{etcd}/stale"
    other = quiesce.Engine("127.0.0.1:0", secret=SECRET, directory=url, node="decode-7")
    initiator = quiesce.Engine(secret=SECRET, directory=url, node="prefill-0")
    kv = bytearray(1 << 20)
    try:
        seg = other.register("kv", kv)
        _copy_entry(etcd, "stale/nodes/decode-7", "stale/nodes/decode-3")
        with pytest.raises(quiesce.UnknownPeer, match="stale"):
            initiator.open("decode-3/kv")
        assert initiator.open("decode-7/kv").length == 1 << 20
        assert seg.revoke()
    finally:
        other.close()
        initiator.close()
    # The drop-in, whose session names are its etcd entries.
    target = _engine("127.0.0.11", f"etcd://{etcd}/stale2")
    caller = _engine("127.0.0.12", f"etcd://{etcd}/stale2")
    dst = target.allocate_managed_buffer(1 << 20)
    src = caller.allocate_managed_buffer(4096)
    try:
        _copy_entry(etcd, "stale2/nodes/127.0.0.11", "stale2/nodes/127.0.0.13")
        caller.write_bytes_to_buffer(src, b"\x5a" * 4096, 4096)
        assert caller.transfer_sync_write("127.0.0.13", src, dst, 4096) == -1
        assert caller.get_first_buffer_address("127.0.0.13") == 0
        assert target.read_bytes_from_buffer(dst, 4096) == b"\0" * 4096
        assert caller.transfer_sync_write("127.0.0.11", src, dst, 4096) == 0
    finally:
        caller.free_managed_buffer(src, 4096)
        target.free_managed_buffer(dst, 1 << 20)


def test_two_initialize_calls_at_once_leave_the_winner_published(etcd):
    """Two threads initialise one engine at once: one answers 0, the other
    -1, and the engine that answered 0 stays in the directory. The loser
    started a node of its own, published under the same name and, dropped,
    revoked its lease: when its write came last, etcd deleted the winner's
    entry, and peers could not find an engine that said 0."""
    import threading

    for k in range(6):
        name = f"127.0.0.{20 + k}"
        e = TransferEngine()
        start = threading.Barrier(2)
        codes = []

        def init():
            start.wait()
            codes.append(e.initialize(name, f"etcd://{etcd}/twice", "tcp", ""))

        threads = [threading.Thread(target=init) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [-1, 0], (k, codes)
        time.sleep(0.3)
        assert any(n.startswith(name) for n in _node_keys(etcd, "twice")), (
            k, name, _node_keys(etcd, "twice"))
        del e
