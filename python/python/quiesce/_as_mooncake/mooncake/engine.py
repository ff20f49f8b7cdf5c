"""``mooncake.engine`` as quiesce: :class:`quiesce.mooncake.TransferEngine`
under Mooncake's import path (see ``quiesce.as_mooncake``)."""

import logging

from quiesce.mooncake import TransferEngine, TransferOpcode

# Mooncake's enum exports its values into the module (pybind11's
# export_values): `mooncake.engine.Write` is `TransferOpcode.Write`.
Read = TransferOpcode.Read
Write = TransferOpcode.Write

__all__ = ["TransferEngine", "TransferOpcode", "Read", "Write"]

logging.getLogger("quiesce").info(
    "mooncake.engine is quiesce's drop-in (quiesce.mooncake), from %s", __file__
)


def __getattr__(name):
    # Mooncake's module has more (its RPC interfaces, SharedSegment, ...):
    # name the stand-in rather than fail with a bare missing attribute.
    raise AttributeError(
        f"mooncake.engine.{name}: quiesce stands in for Mooncake's TransferEngine "
        "only (this process put quiesce.as_mooncake's directory on PYTHONPATH; "
        "take it off to use Mooncake's own)"
    )
