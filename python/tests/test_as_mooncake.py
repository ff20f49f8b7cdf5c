"""``quiesce.as_mooncake``: an unmodified caller's ``from mooncake.engine
import TransferEngine`` gets quiesce's, in a process that opts in through
PYTHONPATH, and only there."""

import os
import subprocess
import sys
import textwrap

import pytest

from quiesce import as_mooncake

MiB = 1 << 20

# What vLLM's MooncakeConnector does, imported as it imports it.
CALLER = textwrap.dedent(
    """
    import ctypes, sys
    from mooncake.engine import TransferEngine
    import quiesce.mooncake
    assert TransferEngine is quiesce.mooncake.TransferEngine, TransferEngine
    session, dst = sys.argv[1], int(sys.argv[2])
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = ctypes.create_string_buffer(b"\\x5a" * (1 << 20), 1 << 20)
    addr = ctypes.addressof(src)
    assert e.batch_register_memory([addr], [1 << 20]) == 0
    print(e.batch_transfer_sync_write(session, [addr], [dst], [1 << 20]))
    """
)


def run(code, *args, shim=True, extra=None):
    """Runs ``code`` in a fresh interpreter with quiesce.as_mooncake's
    directory first on PYTHONPATH (unless ``shim`` is false), then
    ``extra`` (where a Mooncake package stands)."""
    env = dict(os.environ)
    path = [as_mooncake.path()] if shim else []
    path += [p for p in (extra, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_unmodified_caller_transfers_through_quiesce(peer_factory):
    target = peer_factory(4 * MiB)
    (a, _) = target.regions[0]
    out = run(CALLER, target.session, a + MiB)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
    assert target.count(a + MiB, MiB, 0x5A) == MiB


def test_the_path_module_prints_the_directory():
    out = subprocess.run(
        [sys.executable, "-m", "quiesce.as_mooncake"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == as_mooncake.path()
    assert os.path.isfile(os.path.join(out.stdout.strip(), "mooncake", "engine.py"))


def test_what_quiesce_does_not_stand_in_for_is_named():
    out = run("import mooncake.engine\nmooncake.engine.CoroRPCInterface")
    assert out.returncode != 0
    assert "quiesce stands in for Mooncake's TransferEngine only" in out.stderr
    # `from ... import` turns it into Python's own ImportError, which still
    # names the stand-in's file.
    out = run("from mooncake.engine import CoroRPCInterface")
    assert "ImportError" in out.stderr and "_as_mooncake" in out.stderr, out.stderr


def test_the_opcodes_are_module_level_names_too():
    # Mooncake's pybind11 enum calls export_values(): `mooncake.engine.Write`
    # and `.Read` are the opcodes themselves, as callers may write them.
    out = run(
        "from mooncake.engine import Read, Write, TransferOpcode, TransferEngine\n"
        "print(Write is TransferOpcode.Write, Read is TransferOpcode.Read,\n"
        "      int(Write), int(Read), TransferEngine.TransferOpcode.Write == Write)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "1", "0", "True"]


@pytest.fixture
def mooncake_wheel(tmp_path):
    """A stand-in for Mooncake's installed package, laid out as its wheel
    is (a top that extends its path and exports BufferPool, an engine, a
    store), so that these tests run where the wheel is not installed."""
    pkg = tmp_path / "mooncake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from pkgutil import extend_path\n"
        "from mooncake.buffer_pool import BufferPool, RegisteredBufferPool\n"
        "__path__ = extend_path(__path__, __name__)\n"
    )
    (pkg / "buffer_pool.py").write_text(
        "class BufferPool: pass\nclass RegisteredBufferPool: pass\n"
    )
    (pkg / "engine.py").write_text("TransferEngine = 'Mooncake\\'s own'\n")
    (pkg / "store.py").write_text("MooncakeDistributedStore = 'Mooncake\\'s store'\n")
    return str(tmp_path)


def test_mooncake_s_other_modules_still_come_from_its_wheel(mooncake_wheel):
    out = run(
        "import mooncake, mooncake.buffer_pool, mooncake.engine, mooncake.store\n"
        "print(mooncake.buffer_pool.__file__)\n"
        "print(mooncake.store.__file__)\n"
        "print(mooncake.engine.__file__)\n"
        "print(mooncake.BufferPool is mooncake.buffer_pool.BufferPool)",
        extra=mooncake_wheel,
    )
    assert out.returncode == 0, out.stderr
    pool, store, engine, exported = out.stdout.split()
    assert pool.startswith(mooncake_wheel), pool
    assert store.startswith(mooncake_wheel), store
    assert engine.startswith(as_mooncake.path()), engine
    assert exported == "True", "Mooncake's top-level exports are its own"


def test_a_process_that_does_not_opt_in_keeps_mooncake_s_own(mooncake_wheel):
    out = run(
        "import mooncake.engine\nprint(mooncake.engine.TransferEngine)",
        shim=False,
        extra=mooncake_wheel,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Mooncake's own"
