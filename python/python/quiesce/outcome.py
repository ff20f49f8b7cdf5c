"""Outcomes of a native-API batch.

An outcome exists only once nothing can touch the batch's buffers any more
(``Completed``, ``Failed``), or says that this could not be established in
time (``CompletionUnknown``: the buffers stay held by the engine until its
ticket drains). Codes are Mooncake's and the C ABI's: 0, -1, -2.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

from quiesce.errors import InvalidInput


@dataclass(frozen=True)
class TaskReport:
    """How one task ended."""

    index: int
    #: "completed", "failed" or "fenced" (cancelled by the batch's fence).
    status: str
    #: Why it failed (None unless status is "failed").
    reason: Optional[str]
    #: Bytes moved (for a fenced write: bytes that landed before the fence).
    bytes: int
    #: Attempts made.
    attempts: int
    #: What the target confirmed: "answered", "fenced" (nothing more of the
    #: task lands) or "unconfirmed" (bytes of a write may still land there).
    remote: str


@dataclass(frozen=True)
class Completed:
    """Every task completed; the buffers are yours again."""

    buffers: List[Any]
    tasks: List[TaskReport]
    code: int = 0
    remote_confirmed: bool = True

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class Failed:
    """The batch failed; nothing touches its buffers any more (they are
    yours again). ``remote_confirmed`` says whether every target confirmed
    that nothing more of the batch lands in its memory; if False, bytes of a
    write may still land there until the target revokes the range."""

    buffers: List[Any]
    tasks: List[TaskReport]
    remote_confirmed: bool
    code: int = -1

    def __bool__(self) -> bool:
        return False

    @property
    def failures(self) -> List[TaskReport]:
        """The tasks that did not complete."""
        return [t for t in self.tasks if t.status != "completed"]


@dataclass(frozen=True)
class CompletionUnknown:
    """The batch could not be fenced in time: its buffers stay held (by the
    engine, even if you drop this object) until ``wait()`` returns an
    outcome. Do not reuse or free them before."""

    ticket: int
    _engine: Any = field(repr=False, compare=False)
    _buffers: List[Any] = field(repr=False, compare=False)
    code: int = -2
    # The drained outcome once one wait has it (the engine answers a ticket
    # once), and the lock that lets one wait at a time ask the engine.
    _drained: List[Any] = field(default_factory=list, repr=False, compare=False)
    _asking: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    def __bool__(self) -> bool:
        return False

    def wait(self, timeout: float = 30.0) -> Optional[Union[Completed, Failed]]:
        """Blocks (without the GIL) up to ``timeout`` s for the batch to
        drain: its outcome, or None if it still has not. Every wait after
        the batch drained answers the same outcome — also one made while a
        wait abandoned by its caller (``asyncio.wait_for``) still ran. If a
        sweep (``Engine.pending()``, ``wait_for_quiescence()``) collected the
        drained batch before any wait here did, its outcome is kept among
        the engine's last 4,096 such; a first wait after more drained
        raises ``InvalidInput`` (the buffers were let go either way)."""
        if timeout != timeout:  # NaN: Lock.acquire raised ValueError
            raise InvalidInput(f"timeout {timeout!r}: a number of seconds")
        timeout = min(max(timeout, 0.0), threading.TIMEOUT_MAX)
        deadline = time.monotonic() + timeout
        if not self._asking.acquire(timeout=timeout):
            return self._drained[0] if self._drained else None
        try:
            if self._drained:
                return self._drained[0]
            # What is left of the timeout after waiting for another wait.
            r = self._engine.wait(self.ticket, max(deadline - time.monotonic(), 0.0))
            if r is None:
                return None
            self._drained.append(outcome(r, self._buffers, self._engine))
            return self._drained[0]
        finally:
            self._asking.release()

    async def wait_async(self, timeout: float = 30.0) -> Optional[Union[Completed, Failed]]:
        """``wait`` for asyncio (on a worker thread)."""
        return await asyncio.to_thread(self.wait, timeout)


Outcome = Union[Completed, Failed, CompletionUnknown]


def outcome(report, buffers: List[Any], engine) -> Outcome:
    """The outcome object for a report from the native engine."""
    code, tasks, remote_confirmed, ticket = report
    if code == -2:
        return CompletionUnknown(ticket, engine, buffers)
    reports = [TaskReport(i, *t) for i, t in enumerate(tasks)]
    if code == 0:
        return Completed(buffers, reports)
    return Failed(buffers, reports, remote_confirmed)


__all__ = ["TaskReport", "Completed", "Failed", "CompletionUnknown", "Outcome"]
