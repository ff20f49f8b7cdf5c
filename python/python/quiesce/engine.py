"""quiesce's native API: an ``Engine``, named segments lent from your
buffers, and batches of reads and writes whose outcomes exist only once
nothing can touch their buffers any more.

Target side::

    eng = quiesce.Engine("0.0.0.0:5555", secret=SECRET)
    kv = eng.register("kv", bytearray(64 << 20))   # peers may read and write it
    ...
    assert kv.revoke()        # no earlier write lands after this; buffer is yours

Initiator side::

    eng = quiesce.Engine(secret=SECRET)
    kv = eng.open("10.0.0.2:5555", "kv")
    b = eng.batch(deadline=5.0)
    b.write(numpy_array, kv, offset=0)
    b.read(bytearray(4096), kv, offset=1 << 20)
    out = b.run()            # or: out = await b.run_async()
    if isinstance(out, quiesce.CompletionUnknown):
        out = out.wait()     # the buffers stay held until then

Buffers are any C-contiguous buffer-protocol object of plain data
(bytearray, memoryview, numpy arrays, mmap; not of Python objects) or an
object with ``data_ptr()`` and ``nbytes`` on the CPU (torch tensors). A
batch holds each buffer from ``write``/``read`` until its outcome — even if
you drop your references, the batch, or the asyncio task awaiting it — and
your code must not touch them meanwhile. Exports lock a bytearray's size.
A tensor's storage is held too (``set_()`` leaves it alive), but tensors
cannot be locked: do not ``resize_()`` or ``share_memory_()`` one (it moves
the memory), nor change the buffer under a ``torch.frombuffer`` tensor.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

from quiesce import _native
from quiesce.errors import InvalidInput, OutOfBounds
from quiesce.outcome import Outcome, outcome

__all__ = ["Engine", "Batch", "LocalSegment", "RemoteSegment"]


@dataclass(frozen=True)
class RemoteSegment:
    """A peer's segment this engine opened (its secret proved access)."""

    peer: str
    name: str
    #: The peer's address of its first byte.
    address: int
    length: int
    _handle: int
    #: The engine that opened it: handles are numbered per engine.
    _owner: Any = field(default=None, repr=False, compare=False)


class LocalSegment:
    """A buffer of yours lent to peers as a named segment."""

    def __init__(self, engine: "Engine", name: str, buffer: Any, info) -> None:
        self._engine = engine
        self.name = name
        self.buffer = buffer
        self.id, self.address, self.length = info

    def revoke(self, timeout: float = 5.0) -> bool:
        """Revokes the whole segment and takes it back: once this returns
        True, no byte of any earlier write lands in it, whoever sent it, no
        peer reads it, and no batch of this engine that reads into it or
        writes from it (a view of it given to ``Batch.read``/``write``) is
        still running — the buffer is yours again. False: something still
        holds it after ``timeout`` s (call again; do not reuse it yet)."""
        return self._engine._native.reclaim(self.address, timeout, self.id)

    def __repr__(self) -> str:
        return f"LocalSegment({self.name!r}, address={self.address:#x}, length={self.length})"


class Batch:
    """Reads and writes that resolve together. Build with ``write``/``read``,
    then ``run()`` (blocking, the GIL released) or ``await run_async()``,
    once."""

    def __init__(self, engine: "Engine", policy: str, deadline: float) -> None:
        if policy not in ("fail_fast", "drain"):
            raise InvalidInput(f'policy {policy!r}: use "fail_fast" or "drain"')
        # What the engine takes: a nanosecond at least, and less than 2**64 s
        # (checked as the float it becomes: an int just below 2**64 rounds
        # up to it).
        try:
            seconds = float(deadline) if isinstance(deadline, numbers.Real) else float("nan")
        except OverflowError:  # an int past any float
            seconds = float("inf")
        if not 1e-9 <= seconds < 2.0**64:
            raise InvalidInput(f"deadline {deadline!r}: a positive number of seconds (1 ns at least)")
        self._engine = engine
        self._policy = policy
        self._deadline = deadline
        self._native = _native.NativeBatch()
        self._buffers: List[Any] = []
        self._adding = threading.Lock()
        self._outcome: Optional[Outcome] = None

    def write(self, source: Any, to: RemoteSegment, offset: int = 0) -> int:
        """Adds a task writing all of ``source`` into ``to`` at ``offset``;
        returns its index."""
        return self._add(True, source, to, offset)

    def read(self, destination: Any, of: RemoteSegment, offset: int = 0) -> int:
        """Adds a task filling all of ``destination`` from ``of`` at
        ``offset``; returns its index."""
        return self._add(False, destination, of, offset)

    def _add(self, write: bool, buf: Any, seg: RemoteSegment, offset: int) -> int:
        if not isinstance(seg, RemoteSegment):
            raise InvalidInput(f"expected a RemoteSegment from Engine.open, got {type(seg).__name__}")
        if seg._owner is not self._engine:
            raise InvalidInput(f"{seg!r} was opened by another engine: open it with this one")
        if offset < 0:
            raise InvalidInput("the offset must not be negative")
        if offset >= 1 << 64:
            raise OutOfBounds(f"offset {offset} is past any segment (64 bits)")
        # One at a time: the buffer's place in the list is its task's index.
        with self._adding:
            i = self._native.add(write, buf, seg._handle, seg.length, offset)
            self._buffers.append(buf)
        return i

    def __len__(self) -> int:
        return len(self._buffers)

    def run(self) -> Outcome:
        """Runs the batch and blocks until its outcome. A batch runs once:
        this uses it up, also when it raises (nothing moved then) — except
        for an interrupt (Ctrl-C) that comes as the run returns, after the
        outcome: ``outcome`` has it then."""
        r = self._engine._native.run(self._native, self._policy, self._deadline)
        return self._keep(r)

    @property
    def outcome(self) -> Optional[Outcome]:
        """The outcome ``run()`` answered, once it had one (``None``
        before, and after a run that raised before moving anything). Read
        it after a KeyboardInterrupt out of ``run()``: a
        ``CompletionUnknown`` is the only handle on buffers still pinned."""
        if self._outcome is None:
            r = self._native.ran()
            if r is not None:
                self._keep(r)
        return self._outcome

    def _keep(self, report) -> Outcome:
        # One outcome object per batch (a CompletionUnknown's waits share it).
        with self._adding:
            if self._outcome is None:
                self._outcome = outcome(report, self._buffers, self._engine._native)
            return self._outcome

    async def run_async(self) -> Outcome:
        """Runs the batch without blocking the event loop. Cancelling the
        awaiting task does not cancel the batch: it runs to its outcome (or
        its deadline), holding the buffers until then."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        n = self._engine._native
        buffers = self._buffers

        def settle(report, held_for_good: bool) -> None:
            if future.done():
                return
            if report is None:
                from quiesce.errors import EngineClosed

                if held_for_good:
                    why = (
                        "the engine closed before the batch had an outcome and could not "
                        "drain it: its buffers stay held for good (never reuse or free them)"
                    )
                else:
                    why = "the engine closed before the batch had an outcome; it drained, the buffers are yours"
                future.set_exception(EngineClosed(why, buffers_held=held_for_good))
            else:
                future.set_result(outcome(report, buffers, n))

        def delivered(report, held_for_good: bool) -> None:
            # On the delivery thread: hand over to the loop.
            try:
                loop.call_soon_threadsafe(settle, report, held_for_good)
            except RuntimeError:
                pass  # the loop closed; the engine holds what it must

        n.submit(self._native, self._policy, self._deadline, delivered)
        return await future


class Engine:
    """A quiesce engine: serves the segments you register and runs batches
    against peers' segments.

    ``secret`` (16+ bytes; str or bytes) is the cluster's shared secret,
    from which each segment's access is derived; without one,
    ``QUIESCE_SECRET`` is used, and ``open_cluster=True`` (or
    ``QUIESCE_OPEN_CLUSTER=1``) lets any peer that can connect read and write
    (trusted networks only).

    ``transport="rdma"`` moves bytes with RDMA verbs on ``device`` (default:
    the first with an active port; the control plane stays on TCP). Then
    every buffer a batch moves must lie inside memory registered with this
    engine (``register``): a task on other memory fails before anything is
    posted.

    ``directory="etcd://host:port[/prefix]"`` publishes this engine as
    ``node`` (default: the "ip:port" it is bound to; ``listen`` must be an
    address peers can reach, not a wildcard) and every segment it registers, under a lease (entries vanish within its TTL if
    the process dies; ``close()`` takes them at once), and finds peers there
    by node name: ``open("prefill-0", "kv")`` or ``open("prefill-0/kv")``.
    Secrets and tokens are never published."""

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        secret: Optional[Union[str, bytes]] = None,
        open_cluster: bool = False,
        transport: str = "tcp",
        device: Optional[str] = None,
        directory: Optional[str] = None,
        node: Optional[str] = None,
    ) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        self._native = _native.NativeEngine(
            listen, secret, open_cluster, transport, device, directory, node
        )
        self._segments: dict = {}

    @property
    def address(self) -> str:
        """Where peers connect: "ip:port"."""
        return self._native.address

    def register(self, name: str, buffer: Any) -> LocalSegment:
        """Lends ``buffer`` (writable, contiguous) to peers as segment
        ``name``: peers that prove the secret may read and write it until
        ``revoke()``. Do not write it yourself meanwhile. ``name``: 1 to 255
        bytes, without "/", whitespace or control characters (else
        ``InvalidInput``)."""
        seg = LocalSegment(self, name, buffer, self._native.lend(name, buffer))
        return seg

    def open(self, peer: str, name: Optional[str] = None) -> RemoteSegment:
        """Opens segment ``name`` at ``peer``: "host:port", or a node name
        the engine's directory holds. With ``name`` omitted, ``peer`` is a
        ``node/segment`` path ("prefill-0/kv")."""
        if name is None:
            path = peer
            peer, _, name = path.rpartition("/")
            if not peer or not name:
                raise InvalidInput(f"{path!r}: a path is node/segment")
        handle, address, length = self._native.open(peer, name)
        return RemoteSegment(peer, name, address, length, handle, self)

    def batch(self, *, policy: str = "fail_fast", deadline: float = 30.0) -> Batch:
        """A new batch. ``policy``: "fail_fast" (the first failure fences the
        rest) or "drain" (every task runs to its end). ``deadline`` (s): past
        it, the batch fences; a fence that cannot finish in time gives
        ``CompletionUnknown``."""
        return Batch(self, policy, deadline)

    def pending(self) -> List[int]:
        """Tickets of batches whose completion is still unknown (those that
        drained since are settled now: their buffers are let go)."""
        return self._native.pending()

    def wait_for_quiescence(self, timeout: float = 30.0) -> bool:
        """Waits up to ``timeout`` s for the outcome of every submitted batch
        and for every batch whose completion is unknown to drain, letting
        each one's buffers go as it does — also those whose awaiting task
        was cancelled, or whose ``CompletionUnknown`` was dropped — and for
        every blocking ``run()`` on other threads to return. True: none is
        left. A ``CompletionUnknown`` still held answers its
        ``wait()`` with the drained outcome afterwards (the engine keeps the
        last 4,096 outcomes collected so)."""
        return self._native.wait_for_quiescence(timeout)

    def close(self) -> bool:
        """Stops the engine. Blocking calls on other threads finish first
        (each within its deadline; waits within 0.1 s); batches still in
        flight (submitted ones, tickets) are cancelled and reaped before their
        memory is let go. False: it could not drain, and that memory stays
        held for good (never freed under a transfer). A second ``close``
        waits for the first and answers the same."""
        return self._native.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
