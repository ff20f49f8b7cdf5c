"""The Rust crates' log records, into :mod:`logging`.

The extension formats each ``tracing`` event that passes its filter and
queues it; a daemon thread started here waits for the queue with the GIL
released and hands each record to ``logging.getLogger(name)``, where
``name`` is ``quiesce.<crate>.<module>`` (``quiesce.batch.run``,
``quiesce.transports.tcp``, ``quiesce.python.node``). With no handler
configured, Python's last-resort handler prints warnings and errors to
stderr. At exit the queue is closed and what it still holds is logged;
records made after that (engines dropped while the interpreter shuts
down) go to stderr directly.

Which events are made at all, first match wins:

1. :func:`set_log_filter` with directives;
2. ``QUIESCE_LOG`` (the operator's choice, read at import);
3. the levels set on the ``quiesce`` loggers, as for any Python library:
   ``logging.getLogger("quiesce").setLevel(logging.INFO)`` makes the Rust
   side's INFO events, ``logging.getLogger("quiesce.batch")`` only the
   batch crate's; a ``quiesce`` logger left at ``NOTSET`` means warnings.
   The log thread applies changed levels within a second
   (:func:`flush_logs` at once). A level inherited from the root logger
   does not count: ``logging.basicConfig(level=logging.INFO)`` for an
   application's own logs would otherwise make a line per transfer.
"""

import atexit
import logging
import os
import threading
import time

from quiesce import _native

# How often the log thread looks at the quiesce loggers' levels.
_LEVELS_EVERY = 1.0

# Python level → the least severe tracing level it lets through.
_LEVELS = ((5, "trace"), (10, "debug"), (20, "info"), (30, "warn"), (40, "error"))

# QUIESCE_LOG as the extension read it when it loaded (None: unset).
_ENV = os.environ.get(_native.LOG_ENV)

_lock = threading.Lock()
# Directives given to set_log_filter (they win), or None.
_explicit = None
# What the levels asked for when last applied (None: not applied yet).
_applied = None


def _tracing_level(level):
    for most, name in _LEVELS:
        if level <= most:
            return name
    return "off"


def _target(logger):
    """``quiesce.batch.run`` → ``quiesce_batch::run``;
    ``quiesce.python.node`` → ``_native::node`` (this extension)."""
    crate, *path = logger.split(".")[1:]
    crate = "_native" if crate == "python" else "quiesce_" + crate
    return "::".join([crate, *path])


# What a directive's target cannot hold.
_NOT_IN_A_TARGET = set("=,[]{} \t\n")


def _levels_filter():
    """The filter the ``quiesce`` loggers' own levels ask for."""
    top = logging.getLogger("quiesce").level
    directives = [_tracing_level(top) if top else _native.DEFAULT_LOG_FILTER]
    every = list(logging.Logger.manager.loggerDict.items())
    ours = [(name, logger) for name, logger in every if name.startswith("quiesce.")]
    for name, logger in sorted(ours, key=lambda item: item[0]):
        # A name no tracing target can have ("quiesce.a=b") chooses nothing.
        ok = isinstance(logger, logging.Logger) and not _NOT_IN_A_TARGET & set(name)
        if ok and logger.level:
            directives.append(f"{_target(name)}={_tracing_level(logger.level)}")
    return ",".join(directives)


def _follow_levels():
    """Applies the loggers' levels if nothing more explicit chose the filter
    and they changed since last applied."""
    global _applied
    if _ENV is not None:
        return
    with _lock:
        if _explicit is not None:
            return
        wanted = _levels_filter()
        if wanted != _applied:
            try:
                _native.set_log_filter(wanted)
            except RuntimeError:  # another tracing subscriber owns the events
                pass
            except ValueError as e:  # never raised from the log thread
                logging.getLogger("quiesce").warning("the loggers' levels: %s", e)
            _applied = wanted


def set_log_filter(directives):
    """Chooses which Rust-side events are made: ``tracing-subscriber``
    ``Targets`` directives, as ``QUIESCE_LOG`` (``"warn"``, ``"info"``,
    ``"quiesce_batch=debug,warn"``); ``ValueError`` if they do not parse,
    ``RuntimeError`` if another tracing subscriber handles this process's
    events.
    They win over ``QUIESCE_LOG`` and the loggers' levels until
    ``set_log_filter(None)``, which goes back to those."""
    global _explicit, _applied
    with _lock:
        if directives is not None:
            _native.set_log_filter(directives)
            _explicit = directives
            return
        _explicit = None
        _applied = None
        # Under the lock: another thread's set_log_filter(directives) between
        # the two would be undone by this one while it stayed 'explicit'.
        if _ENV is not None:
            try:
                _native.set_log_filter(_ENV)
            except ValueError:  # reported when the module loaded
                _native.set_log_filter(_native.DEFAULT_LOG_FILTER)
            return
    _follow_levels()


def _emit(records):
    for level, name, message in records:
        try:
            logging.getLogger(name).log(level, message)
        except Exception:  # a handler's failure must not stop the pump
            pass


def _pump():
    looked = time.monotonic()
    while True:
        records = _native.next_log_records(_LEVELS_EVERY)
        if records is None:  # closed
            return
        _emit(records)
        if time.monotonic() - looked >= _LEVELS_EVERY:
            looked = time.monotonic()
            _follow_levels()


_thread = None


def _start():
    global _thread
    _follow_levels()
    _thread = threading.Thread(target=_pump, name="quiesce-logs", daemon=True)
    _thread.start()


def flush_logs(timeout=0.0):
    """Applies the ``quiesce`` loggers' levels and logs the records queued
    so far, in the calling thread (waiting up to ``timeout`` seconds for the
    first), rather than when the log thread gets to them."""
    _follow_levels()
    _emit(_native.next_log_records(timeout) or [])


def _close():
    records = _native.close_log_records()
    if _thread is not None:
        _thread.join(timeout=1.0)
    _emit(records)


def _start_in_child():
    # The parent's log thread is not in the child, and another of its
    # threads may have held this lock when it forked.
    global _lock
    _native.release_log_records_after_fork(True)
    _lock = threading.Lock()
    _start()


_start()
atexit.register(_close)
os.register_at_fork(
    before=_native.hold_log_records_for_fork,
    after_in_parent=lambda: _native.release_log_records_after_fork(False),
    after_in_child=_start_in_child,
)
