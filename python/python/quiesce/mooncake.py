"""A drop-in for Mooncake's Python ``TransferEngine``.

Switching a caller is an import change::

    # from mooncake.engine import TransferEngine
    from quiesce.mooncake import TransferEngine

or, for a caller whose import you cannot edit (vLLM's and SGLang's
connectors), ``quiesce.as_mooncake``'s directory first on ``PYTHONPATH``.

Same method names, argument order and return conventions as Mooncake's
binding, for the calls vLLM's and SGLang's connectors make. What differs is
what the codes promise: ``-1`` means nothing touches your memory any more
(Mooncake returns -1 while other transfers of the batch still read your
sources and write the target), and ``-2`` means completion is unknown and the
memory stays pinned until ``wait_for_quiescence()`` returns 0. The target's
side of a failed write is confirmed too, unless the target stopped answering
before it confirmed the fence: then bytes already sent may still land in its
range until it revokes the range (``unregister_memory`` there does).
"""

from quiesce._native import TransferEngine, TransferOpcode

__all__ = ["TransferEngine", "TransferOpcode"]
