"""The seed scenario from Python: ``python -m quiesce.demo [--rounds N]``.

A target in another process registers a 4 KiB range and a 64 MiB range; each
round the initiator sends one batch of [a 4 KiB write to the small range,
which the target withdrew just before, a valid 64 MiB write], and overwrites
its source the moment the call returns. A round is corrupted if any of the
overwritten bytes reaches the target. quiesce runs always; Mooncake's
TransferEngine too when ``mooncake.engine`` imports. Exits 1 if quiesce
corrupted any round.
"""

import argparse
import sys

from quiesce.bench import MiB, Side, load, seed


def main():
    ap = argparse.ArgumentParser(prog="python -m quiesce.demo")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--big", type=int, default=64 * MiB)
    a = ap.parse_args()
    impls = ["quiesce"]
    try:
        load("mooncake")
        impls.append("mooncake")
    except ImportError:
        print("mooncake: not installed (pip install mooncake-transfer-engine-non-cuda to compare)")
    print(f"seed scenario, {a.rounds} rounds: [refused 4 KiB write, valid {a.big >> 20} MiB write], "
          "source overwritten on return")
    bad = 0
    for impl in impls:
        side = Side(impl, a.big)
        try:
            corrupted, codes, ms = seed(side, a.rounds, a.big)
        finally:
            side.close()
        print(f"  {impl:9} corrupted: {corrupted}/{a.rounds}   codes {codes}   returned after {ms:.1f} ms (p50)")
        if impl == "quiesce":
            bad = corrupted
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
