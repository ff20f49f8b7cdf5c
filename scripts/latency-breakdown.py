"""Lines up the step timelines of a blocking 4 KiB call from Python (the
initiator's caller thread) and of the target's engine thread, written by
a `timeline` build (runtime/src/timeline.rs), and prints where the fastest
calls' time goes. Used by scripts/latency-breakdown.sh.

    python3 scripts/latency-breakdown.py DIR
"""

import bisect
import os
import statistics
import sys

# The values of `Step` in runtime/src/timeline.rs.
ENTERED, SEND, SENT, RECEIVED, RETURNED, POLL = 1, 2, 3, 4, 5, 8


def load(path):
    with open(path) as f:
        return [tuple(map(int, line.split())) for line in f]


def calls(steps):
    """The caller's calls: entry, send, sent, the receive's poll, got, exit."""
    out, cur, last_poll = [], None, None
    for k, t in steps:
        if k == POLL:
            last_poll = t
        if k == ENTERED:
            cur = {ENTERED: t}
        elif cur is not None:
            if k == RECEIVED and SENT in cur and RECEIVED not in cur:
                cur["poll"] = last_poll if last_poll and last_poll > cur[SENT] else None
            if k in (SEND, SENT, RECEIVED) and k not in cur:
                cur[k] = t
            if k == RETURNED:
                cur[RETURNED] = t
                if all(j in cur for j in (SEND, SENT, RECEIVED)) and cur.get("poll"):
                    out.append(cur)
                cur = None
    return out


def requests(steps):
    """The target's requests: the receive's poll, got, answer sent."""
    out, cur, last_poll, last_got = [], None, None, 0
    for k, t in steps:
        if k == POLL:
            last_poll = t
        elif k == RECEIVED:
            # A receive through the ring has no poll of its own.
            polled = last_poll if last_poll and last_poll > last_got else None
            cur, last_got = {RECEIVED: t, "poll": polled}, t
        elif cur is not None and k in (SEND, SENT) and k not in cur:
            cur[k] = t
            if k == SENT:
                if cur["poll"] and SEND in cur:
                    out.append(cur)
                cur = None
    return out


COLUMNS = [
    ("pre", "caller: Python entry to its sendmsg (user)"),
    ("i.send", "caller: sendmsg of header + 4 KiB (kernel)"),
    ("t.poll", "target: its last poll began, after the caller's send returned"),
    ("t.recv", "target: that recv (kernel)"),
    ("t.work", "target: request to its answer's sendmsg (user)"),
    ("t.send", "target: sendmsg of the answer (kernel)"),
    ("i.poll", "caller: its last poll began, after the target's send returned"),
    ("i.recv", "caller: that recv (kernel)"),
    ("post", "caller: answer to the return to Python (user)"),
]


def main():
    d = sys.argv[1]
    files = {f: load(os.path.join(d, f)) for f in os.listdir(d)}
    if not files:
        sys.exit(f"no timelines in {d}: was the package built with the timeline feature?")
    caller = max(files, key=lambda f: sum(k == ENTERED for k, _ in files[f]))
    pid = caller.split(".")[0]
    others = [f for f in files if f.split(".")[0] != pid]
    if not others:
        sys.exit("no target timeline (the target process wrote none)")
    target = max(others, key=lambda f: sum(k == RECEIVED for k, _ in files[f]))
    cs, rs = calls(files[caller]), requests(files[target])
    got = [r[RECEIVED] for r in rs]
    rows = []
    for c in cs:
        i = bisect.bisect_left(got, c[SEND])
        if i == len(rs) or got[i] > c[RECEIVED]:
            continue
        r = rs[i]
        rows.append((
            c[RETURNED] - c[ENTERED],
            c[SEND] - c[ENTERED],
            c[SENT] - c[SEND],
            r["poll"] - c[SENT],
            r[RECEIVED] - r["poll"],
            r[SEND] - r[RECEIVED],
            r[SENT] - r[SEND],
            c["poll"] - r[SENT],
            c[RECEIVED] - c["poll"],
            c[RETURNED] - c[RECEIVED],
        ))
    if not rows:
        sys.exit("no call lined up with a request")
    rows.sort()
    print(f"{len(rows)} calls lined up with the target's requests; means in µs")
    print(f"{'calls':>12} {'total':>6} " + " ".join(f"{n:>7}" for n, _ in COLUMNS)
          + f" {'user':>6} {'other':>6}")
    for frac in (0.01, 0.10, 0.50):
        sel = rows[: max(1, int(len(rows) * frac))]
        m = [statistics.mean(r[j] for r in sel) / 1000 for j in range(len(COLUMNS) + 1)]
        user = m[1] + m[5] + m[9]
        print(f"{'fastest ' + format(frac, '.0%'):>12} {m[0]:6.2f} "
              + " ".join(f"{v:7.2f}" for v in m[1:]) + f" {user:6.2f} {m[0] - user:6.2f}")
    print()
    for n, what in COLUMNS:
        print(f"  {n:>7}: {what}")
    print("     user: pre + t.work + post, quiesce's own code on the critical path;"
          " other: the rest (syscalls, the kernel's loopback delivery, polling)")
    print("  (t.poll and i.poll are negative when the receiver's successful recv began"
          " before the sender's sendmsg returned: loopback delivers inside it)")


if __name__ == "__main__":
    main()
