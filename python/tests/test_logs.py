"""The Rust side's log records reach Python's ``logging``: warnings by
default, more with ``quiesce.set_log_filter``; loggers ``quiesce.<crate>...``."""

import logging
import time

import pytest

import quiesce
from conftest import engine


def wait_for(caplog, pred, timeout=5.0):
    """The first captured record for which ``pred`` holds (the log thread
    hands records over asynchronously)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        quiesce.flush_logs(0.05)
        for r in caplog.records:
            if pred(r):
                return r
    return None


def test_a_failed_call_is_a_warning_on_a_quiesce_logger(peer_factory, local, caplog):
    target = peer_factory(4096)
    (a, n) = target.regions[0]
    e = engine()
    src = local.buffer(4096, 1)
    assert e.transfer_sync_write(target.session, src, a + n, 4096) == -1
    r = wait_for(caplog, lambda r: r.levelno == logging.WARNING and "no registered memory" in r.getMessage())
    assert r is not None, [(x.name, x.getMessage()) for x in caplog.records]
    assert r.name.startswith("quiesce.python"), r.name


def test_info_events_come_with_their_batch_span_once_asked_for(peer_factory, local, caplog):
    caplog.set_level(logging.INFO, logger="quiesce")
    target = peer_factory(4096)
    (a, _) = target.regions[0]
    e = engine()
    src = local.buffer(4096, 2)
    assert e.transfer_sync_write(target.session, src, a, 4096) == 0
    time.sleep(0.2)
    assert wait_for(caplog, lambda r: "batch quiesced" in r.getMessage(), 0.2) is None, (
        "INFO events under the default filter"
    )
    quiesce.set_log_filter("info")
    try:
        assert e.transfer_sync_write(target.session, src, a, 4096) == 0
        r = wait_for(caplog, lambda r: "batch quiesced" in r.getMessage())
    finally:
        quiesce.set_log_filter("warn")
    assert r is not None, [(x.name, x.getMessage()) for x in caplog.records]
    assert r.levelno == logging.INFO
    assert r.name == "quiesce.batch.run", r.name
    assert "batch{id=" in r.getMessage(), r.getMessage()
    assert "outcome=" in r.getMessage(), r.getMessage()


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
    assert "no registered memory" in out.stderr, out.stderr
