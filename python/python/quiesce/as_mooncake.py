"""Run an unmodified Mooncake caller (vLLM, SGLang) on quiesce.

vLLM's and SGLang's connectors import ``from mooncake.engine import
TransferEngine`` inside their own code. To switch them without editing it,
put the directory this module prints first on ``PYTHONPATH``::

    export PYTHONPATH=$(python -m quiesce.as_mooncake)${PYTHONPATH:+:$PYTHONPATH}
    export QUIESCE_SECRET=...          # the same on every peer
    vllm serve ...                     # its mooncake.engine is quiesce's now

The directory holds a ``mooncake`` package whose ``engine`` module is
:mod:`quiesce.mooncake`. It extends itself over any installed Mooncake
(``pkgutil.extend_path``, as Mooncake's own package does), so its other
modules (``mooncake.store``, ...) still import from Mooncake's wheel; only
``mooncake.engine`` is taken over. Nothing changes for a process that does
not put the directory on its path: the switch is opt-in, per process.
"""

import os


def path() -> str:
    """The directory to put first on ``PYTHONPATH``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_mooncake")


if __name__ == "__main__":
    print(path())
