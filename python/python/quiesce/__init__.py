"""quiesce: transfer batches that resolve only once every transfer in them has
quiesced.

``quiesce.mooncake.TransferEngine`` is a drop-in for Mooncake's
``mooncake.engine.TransferEngine`` (the calls vLLM's and SGLang's connectors
make), whose return codes keep quiesce's contract:

* ``0``  -- completed;
* ``-1`` -- failed, and nothing touches the caller's memory any more;
* ``-2`` -- completion unknown: the memory stays pinned until
  ``wait_for_quiescence()`` returns 0.

Peers prove access with a secret they share: set ``QUIESCE_SECRET`` (16 or
more bytes, the same on every peer), or ``QUIESCE_OPEN_CLUSTER=1`` on a
trusted network.

Logs: the Rust side's warnings and errors go to Python's ``logging``
(loggers ``quiesce.<crate>.<module>``). Which events are made at all:
:func:`set_log_filter` (``"info"``, ``"quiesce_batch=debug,warn"``), else
``QUIESCE_LOG``, else the levels set on the ``quiesce`` loggers
(``logging.getLogger("quiesce").setLevel(logging.INFO)``).

``quiesce.Engine`` is the native API: named segments lent from your
buffers, batches over buffer-protocol objects, outcome objects
(``Completed``, ``Failed``, ``CompletionUnknown``) and ``await``-able runs.
"""

from quiesce._native import LOG_ENV, OPEN_CLUSTER_ENV, SECRET_ENV
from quiesce._logs import flush_logs, set_log_filter
from quiesce.engine import Batch, Engine, LocalSegment, RemoteSegment
from quiesce import errors
from quiesce.errors import (
    DirectoryUnavailable,
    EngineClosed,
    InvalidInput,
    OutOfBounds,
    PeerUnreachable,
    QuiesceError,
    SecretMissing,
    SegmentRefused,
    StillLent,
    UnknownPeer,
    ZeroLength,
)
from quiesce.outcome import Completed, CompletionUnknown, Failed, Outcome, TaskReport

OK = 0
FAILED = -1
COMPLETION_UNKNOWN = -2

__all__ = [
    "OK",
    "FAILED",
    "COMPLETION_UNKNOWN",
    "SECRET_ENV",
    "OPEN_CLUSTER_ENV",
    "LOG_ENV",
    "set_log_filter",
    "flush_logs",
    "Engine",
    "Batch",
    "LocalSegment",
    "RemoteSegment",
    "Completed",
    "Failed",
    "CompletionUnknown",
    "Outcome",
    "TaskReport",
    "mooncake",
    *errors.__all__,
]
