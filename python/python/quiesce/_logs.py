"""The Rust crates' log records, into :mod:`logging`.

The extension formats each ``tracing`` event that passes its filter
(``QUIESCE_LOG``, default ``warn``; :func:`quiesce.set_log_filter`) and
queues it; a daemon thread started here waits for the queue with the GIL
released and hands each record to ``logging.getLogger(name)``, where
``name`` is ``quiesce.<crate>.<module>`` (``quiesce.batch.run``,
``quiesce.transports.tcp``, ``quiesce.python.node``). With no handler
configured, Python's last-resort handler prints warnings and errors to
stderr. At exit the queue is closed and what it still holds is logged;
records made after that (engines dropped while the interpreter shuts
down) go to stderr directly.
"""

import atexit
import logging
import os
import threading

from quiesce import _native


def _emit(records):
    for level, name, message in records:
        try:
            logging.getLogger(name).log(level, message)
        except Exception:  # a handler's failure must not stop the pump
            pass


def _pump():
    while True:
        records = _native.next_log_records(None)
        if not records:  # closed
            return
        _emit(records)


_thread = None


def _start():
    global _thread
    _native.open_log_records()
    _thread = threading.Thread(target=_pump, name="quiesce-logs", daemon=True)
    _thread.start()


def flush_logs(timeout=0.0):
    """Logs the records queued so far now, in the calling thread (waiting up
    to ``timeout`` seconds for the first), rather than when the log thread
    gets to them."""
    _emit(_native.next_log_records(timeout))


def _close():
    records = _native.close_log_records()
    if _thread is not None:
        _thread.join(timeout=1.0)
    _emit(records)


_start()
atexit.register(_close)
os.register_at_fork(after_in_child=_start)
