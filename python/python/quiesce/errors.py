"""The exceptions of quiesce's native API.

Raised before anything moves: a batch that raises while being built or run
took nothing of yours (no buffer is held, nothing was sent) — except
``EngineClosed`` about memory the engine held when it closed (``run_async``,
``CompletionUnknown.wait``, ``LocalSegment.revoke``), which says in
``buffers_held`` whether it came back. Failures of
transfers themselves are not exceptions but outcomes (``Failed``,
``CompletionUnknown``).
"""


class QuiesceError(Exception):
    """Base of every quiesce exception."""


class InvalidInput(QuiesceError, ValueError):
    """Bad input: a buffer that is not contiguous, read-only where it would be
    written, a batch run twice, a bad policy or deadline."""


class ZeroLength(InvalidInput):
    """A task of zero bytes."""


class OutOfBounds(InvalidInput):
    """A task that crosses the end of its remote segment."""


class SegmentRefused(QuiesceError):
    """The peer refused to open the segment: it has no segment by that name,
    or the secret does not prove access to it (the two look the same)."""


class UnknownPeer(QuiesceError):
    """The peer cannot be resolved: its address does not resolve, the
    directory holds no such node, or its entry is stale (another node
    answers at its address)."""


class PeerUnreachable(QuiesceError):
    """The peer cannot be reached, or its handshake failed."""


class StillLent(QuiesceError):
    """The memory is lent already, or an earlier lending of it has not been
    taken back to the end."""


class SecretMissing(QuiesceError):
    """No shared secret: pass ``secret=``, set ``QUIESCE_SECRET``, or opt into
    an open cluster (``open_cluster=True`` / ``QUIESCE_OPEN_CLUSTER=1``)."""


class EngineClosed(QuiesceError):
    """The engine was closed. Raised by a call made after ``close()``, where
    nothing moved; or about memory the engine held — by ``run`` or
    ``run_async`` for a batch the close overtook, ``CompletionUnknown.wait()`` and
    ``LocalSegment.revoke()`` — where ``buffers_held`` says what became of
    it: False, the engine drained and it is yours; True, it could not drain
    and the memory stays held for good (a transfer may still touch it: never
    reuse or free it)."""

    def __init__(self, *args, buffers_held: bool = False) -> None:
        super().__init__(*args)
        self.buffers_held = buffers_held


class DirectoryUnavailable(QuiesceError):
    """The directory (etcd) cannot be reached, and what was asked is not in
    its cache (or the engine could not publish itself there in time)."""


__all__ = [
    "QuiesceError",
    "InvalidInput",
    "ZeroLength",
    "OutOfBounds",
    "SegmentRefused",
    "UnknownPeer",
    "PeerUnreachable",
    "StillLent",
    "SecretMissing",
    "EngineClosed",
    "DirectoryUnavailable",
]
