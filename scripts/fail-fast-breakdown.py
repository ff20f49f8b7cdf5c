"""Lines up the step timelines of `bench --compare --cases fail_fast_64m`
run by a `timeline` build (runtime/src/timeline.rs): each initiator's
fail-fast batches — [a 4 KiB write the target refuses, a valid 64 MiB
write] — against the target's steps, and prints when each step of the way
from submission to the outcome came. Used by scripts/fail-fast-breakdown.sh.

    python3 scripts/fail-fast-breakdown.py DIR
"""

import bisect
import os
import statistics
import sys

# The values of `Step` in runtime/src/timeline.rs.
LAUNCHED, REFUSAL_SENT, REFUSAL_READ, FENCE_STARTED = 9, 10, 11, 12
FENCE_RECEIVED, FENCE_QUIET, FENCE_ACK_READ, QUIESCED = 13, 14, 15, 16

COLUMNS = [
    ("refused", "target: the refusal of the 4 KiB write sent"),
    ("read", "initiator: that refusal read"),
    ("fence", "initiator: the driver starts fencing"),
    ("t.fence", "target: the Fence read"),
    ("t.quiet", "target: the batch's landing receives reaped (acks next)"),
    ("ack", "initiator: the FenceAck read"),
    ("done", "initiator: every task terminal (the outcome)"),
]


def load(path):
    with open(path) as f:
        return [tuple(map(int, line.split())) for line in f]


def batches(steps):
    """The fenced batches of one initiator thread: each step's times."""
    out, cur = [], None
    for k, t in steps:
        if k == LAUNCHED:
            cur = {LAUNCHED: [t]}
        elif cur is not None:
            cur.setdefault(k, []).append(t)
            if k == QUIESCED:
                if FENCE_STARTED in cur:
                    out.append(cur)
                cur = None
    return out


def first_after(times, t, until):
    i = bisect.bisect_right(times, t)
    return times[i] if i < len(times) and times[i] <= until else None


def main():
    d = sys.argv[1]
    names = sorted(os.listdir(d))
    # The TCP initiators (the local transport's refusals take another way).
    initiators = [n for n in names if n.endswith((".bench-quiesce-io_uring", ".bench-quiesce-epoll"))]
    if not initiators:
        sys.exit(f"no initiator timelines in {d}: was the binary built with the timeline feature?")
    pid = initiators[0].split(".")[0]
    target = {}
    for n in names:
        if n.split(".")[0] != pid:
            for k, t in load(os.path.join(d, n)):
                target.setdefault(k, []).append(t)
    for ts in target.values():
        ts.sort()
    print("µs from the batch's launch; min / p50 over its fenced batches")
    print(f"{'initiator':<24} {'n':>4} " + " ".join(f"{c:>13}" for c, _ in COLUMNS))
    for n in initiators:
        rows = []
        for b in batches(load(os.path.join(d, n))):
            t0, end, fence = b[LAUNCHED][0], b[QUIESCED][0], b[FENCE_STARTED][0]
            received = first_after(target.get(FENCE_RECEIVED, []), fence, end)
            quiet = first_after(target.get(FENCE_QUIET, []), received, end) if received else None
            steps = [
                first_after(target.get(REFUSAL_SENT, []), t0, fence),
                first_after(b.get(REFUSAL_READ, []), t0, fence),
                fence,
                received,
                quiet,
                first_after(b.get(FENCE_ACK_READ, []), fence, end),
                end,
            ]
            rows.append([None if t is None else (t - t0) / 1000 for t in steps])
        cols = []
        for j in range(len(COLUMNS)):
            v = sorted(r[j] for r in rows if r[j] is not None)
            cols.append(f"{v[0]:6.0f} /{statistics.median(v):6.0f}" if v else f"{'-':>13}")
        print(f"{n.split('.', 2)[2]:<24} {len(rows):>4} " + " ".join(cols))
    print()
    for c, what in COLUMNS:
        print(f"  {c:>7}: {what}")


if __name__ == "__main__":
    main()
