"""Both APIs over RDMA verbs (``protocol="rdma"``), against target processes
on the same device. Needs one: ``scripts/softroce-vm.sh test`` runs this
file inside its Soft-RoCE guest; elsewhere every test is skipped."""

import ctypes
import os

import pytest

import quiesce
from conftest import SECRET, engine, seed_round

MiB = 1 << 20
RDMA = {"QUIESCE_TEST_PROTOCOL": "rdma"}

pytestmark = pytest.mark.skipif(
    not (os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")),
    reason="needs an RDMA device: scripts/softroce-vm.sh test",
)


def test_vllm_call_sequence_over_rdma(peer_factory, local):
    target = peer_factory(4 * MiB, env=RDMA)
    e = engine("rdma")
    assert 0 < e.get_rpc_port() < 65536
    srcs = [local.buffer(256 << 10, 0x10 + i) for i in range(4)]
    assert e.batch_register_memory(srcs, [256 << 10] * 4) == 0
    (a, _) = target.regions[0]
    assert e.get_first_buffer_address(target.session) == a
    dsts = [a + i * MiB for i in range(4)]
    assert e.batch_transfer_sync_write(target.session, srcs, dsts, [256 << 10] * 4) == 0
    for i, d in enumerate(dsts):
        assert target.count(d, 256 << 10, 0x10 + i) == 256 << 10
    # The read mirror, into registered memory.
    dst = local.buffer(64 << 10)
    assert e.register_memory(dst, 64 << 10) == 0
    assert e.transfer_sync_read(target.session, dst, a + MiB, 64 << 10) == 0
    assert ctypes.string_at(dst, 64 << 10) == bytes([0x11]) * (64 << 10)
    # RDMA posts only from registered memory: anything else is -1, and
    # nothing moved.
    stray = local.buffer(4096, 9)
    assert e.transfer_sync_write(target.session, stray, a, 4096) == -1
    assert target.count(a, 4096, 9) == 0
    assert e.batch_unregister_memory(srcs + [dst]) == 0


def test_seed_scenario_over_rdma(peer_factory, local):
    target = peer_factory(4096, 64 * MiB, env=RDMA)
    (small, _), (big, _) = target.regions
    e = engine("rdma")
    probe = local.buffer(4096, 1)
    src = local.buffer(64 * MiB)
    assert e.batch_register_memory([probe, src], [4096, 64 * MiB]) == 0
    assert e.transfer_sync_write(target.session, probe, small, 4096) == 0
    assert target.ask(f"unregister {small}") == "0"
    corrupted = 0
    rounds = 5
    for _ in range(rounds):
        corrupted += seed_round(e, target, probe, src, small, big, 64 * MiB)
    assert corrupted == 0, f"{corrupted}/{rounds} rounds had bytes written after -1"


def test_native_api_over_rdma(native_peer):
    t = native_peer(env=RDMA, kv=4 * MiB)
    with quiesce.Engine(secret=SECRET, transport="rdma") as eng:
        mem = bytearray(2 * MiB)
        mine = eng.register("mine", mem)
        kv = eng.open(t.address, "kv")
        src, dst = memoryview(mem)[:MiB], memoryview(mem)[MiB:]
        src[:] = b"\x42" * MiB
        b = eng.batch()
        b.write(src, kv, offset=MiB)
        b.read(dst, kv, offset=0)
        out = b.run()
        assert isinstance(out, quiesce.Completed), out
        assert t.count("kv", 0x42) == MiB
        assert bytes(dst) == bytes(MiB)
        # A buffer outside registered memory fails its task, moving nothing.
        b = eng.batch()
        b.write(bytearray([7]) * 4096, kv)
        out = b.run()
        assert isinstance(out, quiesce.Failed) and "not in registered memory" in out.tasks[0].reason
        assert t.count("kv", 7) == 0
        del src, dst
        assert mine.revoke()


def test_a_post_from_inside_the_larger_of_two_overlapping_registrations(peer_factory, local):
    """Two registrations overlap (a range registered inside a larger one):
    a transfer from the larger one past the smaller one posts from the
    larger one's memory region, not -1 as if unregistered."""
    target = peer_factory(MiB, env=RDMA)
    (a, _) = target.regions[0]
    e = engine("rdma")
    big = local.buffer(MiB, 0x3C)
    assert e.register_memory(big, MiB) == 0
    assert e.register_memory(big + 4096, 4096) == 0
    assert e.transfer_sync_write(target.session, big + 8192, a, 4096) == 0
    assert target.count(a, 4096, 0x3C) == 4096
    assert e.batch_unregister_memory([big + 4096, big]) == 0
