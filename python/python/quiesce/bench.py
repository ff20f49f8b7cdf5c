"""Side-by-side benchmark of quiesce's drop-in and Mooncake's TransferEngine.

    python -m quiesce.bench [--rounds N] [--iters N] [--impl quiesce,quiesce-local,mooncake,nixl]

Each implementation gets a target in its own process (this module with
``--serve``), all alive at once; the latency cases alternate between the
implementations every ``--block`` iterations so each pair of figures sees
the same machine. NIXL runs after the others, alone: its progress threads
busy-poll and would take the cores from them. So that the comparison with
NIXL is like for like, ``quiesce-local`` then runs alone too, just before
NIXL (printed as ``quiesce-local alone``, and compared with NIXL); its
interleaved figures are compared with Mooncake's. Mooncake runs when ``mooncake.engine`` imports (PyPI:
``mooncake-transfer-engine-non-cuda``). Printed per case: t_min and p50
(and p99) per implementation, and quiesce's speed-up (Mooncake ÷ quiesce).
``quiesce`` is the drop-in over TCP (``QUIESCE_LOCAL=off``), as Mooncake's
``"tcp"``; ``quiesce-local`` the same drop-in with its local transport
required (the target copies by cross-memory attach; the default, ``auto``,
picks it for a peer on this host). ``nixl`` runs when ``nixl._api``
imports (PyPI: ``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1
numpy``; its ``torch`` requirement is for tensors, which this benchmark
does not use):
NIXL 1.5.1 over UCX, which on one host writes by cross-memory attach
without the target's involvement; each transfer's handle is made once and
re-posted, polled to ``DONE`` as NIXL's callers do.

The seed scenario is the one quiesce exists for: a batch of [a 4 KiB write
the target refuses (a range it registered, then withdrew), a valid 64 MiB
write]; as soon as the call returns, the source is overwritten; a round is
corrupted if any overwritten byte reaches the target.
"""

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
SECRET = "quiesce.bench: a secret only this benchmark's processes share"


# quiesce-local's figures from its phase of its own (with NIXL's).
ALONE = " alone"

# The initiator's QUIESCE_LOCAL per implementation of quiesce.
LOCAL = {"quiesce": "off", "quiesce-local": "required"}


def load(impl):
    if impl in LOCAL:
        from quiesce.mooncake import TransferEngine
    elif impl == "nixl":
        from nixl._api import nixl_agent

        return nixl_agent
    else:
        from mooncake.engine import TransferEngine
    return TransferEngine


class Nixl:
    """NIXL behind the two calls the benchmark makes. A transfer's handle
    is made once per (sources, destinations, lengths) and re-posted; each
    post is polled until ``DONE``."""

    def __init__(self, remote_metadata):
        from nixl._api import nixl_agent

        self.agent = nixl_agent(f"bench-{os.getpid()}")
        self.remote = self.agent.add_remote_agent(remote_metadata)
        self.handles = {}

    def register_memory(self, addr, n):
        self.agent.register_memory([(addr, n, 0, "")], "DRAM")
        return 0

    def batch_transfer_sync_write(self, _session, srcs, dsts, lens):
        key = (tuple(srcs), tuple(dsts), tuple(lens))
        h = self.handles.get(key)
        if h is None:
            local = self.agent.get_xfer_descs([(s, n, 0) for s, n in zip(srcs, lens)], "DRAM")
            remote = self.agent.get_xfer_descs([(d, n, 0) for d, n in zip(dsts, lens)], "DRAM")
            h = self.handles[key] = self.agent.initialize_xfer("WRITE", local, remote, self.remote)
        st = self.agent.transfer(h)
        while st == "PROC":
            st = self.agent.check_xfer_state(h)
        return 0 if st == "DONE" else -1

    def transfer_sync_write(self, session, src, dst, n):
        return self.batch_transfer_sync_write(session, [src], [dst], [n])


def serve(impl, sizes):
    """The target role: registers one buffer per size, answers commands."""
    bufs = [ctypes.create_string_buffer(s) for s in sizes]
    addrs = [ctypes.addressof(b) for b in bufs]
    if impl == "nixl":
        engine = load(impl)("bench-target")
        engine.register_memory([(a, s, 0, "") for a, s in zip(addrs, sizes)], "DRAM")
        print("ready", engine.get_agent_metadata().hex(), *addrs, flush=True)
    else:
        engine = load(impl)()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        for a, s in zip(addrs, sizes):
            assert engine.register_memory(a, s) == 0
        print("ready", engine.get_rpc_port(), *addrs, flush=True)
    for line in sys.stdin:
        w = line.split()
        if w[0] == "fill":
            ctypes.memset(int(w[1]), int(w[3]), int(w[2]))
            print("ok", flush=True)
        elif w[0] == "count":
            data = ctypes.string_at(int(w[1]), int(w[2]))
            print(data.count(bytes([int(w[3])])), flush=True)
        elif w[0] == "unregister":
            print(engine.unregister_memory(int(w[1])), flush=True)
        elif w[0] == "register":
            print(engine.register_memory(int(w[1]), int(w[2])), flush=True)


def allow_ptrace_by(pid):
    """Lets process `pid` read this one's memory under YAMA's ptrace_scope 1,
    where a child may not touch its parent: the local transport's target
    (this benchmark's child) copies from the initiator's memory. (As
    `quiesce bench` does for its target; a no-op without YAMA.)"""
    PR_SET_PTRACER = 0x59616D61
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Side:
    """One implementation: its target process and an initiator engine."""

    def __init__(self, impl, big):
        self.impl = impl
        # Targets serve both roads; each initiator picks its own below.
        env = dict(os.environ, QUIESCE_SECRET=SECRET, QUIESCE_LOCAL="auto")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quiesce.bench", "--serve", impl, "4096", str(big)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        # A library may log to stdout before the target says it is ready.
        w = []
        for line in self.proc.stdout:
            w = line.split()
            if w and w[0] == "ready":
                break
        assert w and w[0] == "ready", f"{impl} target did not start"
        self.small, self.big = int(w[2]), int(w[3])
        self.bufs = []
        if impl == "nixl":
            self.session = None
            self.engine = Nixl(bytes.fromhex(w[1]))
            return
        self.session = f"127.0.0.1:{w[1]}"
        os.environ["QUIESCE_SECRET"] = SECRET
        if impl in LOCAL:
            os.environ["QUIESCE_LOCAL"] = LOCAL[impl]
        if LOCAL.get(impl) == "required":
            allow_ptrace_by(self.proc.pid)
        self.engine = load(impl)()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0

    def buffer(self, n, byte=0):
        b = ctypes.create_string_buffer(n)
        if byte:
            ctypes.memset(b, byte, n)
        self.bufs.append(b)
        a = ctypes.addressof(b)
        assert self.engine.register_memory(a, n) == 0
        return a

    def ask(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self):
        self.proc.kill()
        self.proc.wait()


def timed(f):
    t = time.perf_counter_ns()
    ret = f()
    return (time.perf_counter_ns() - t) / 1000.0, ret


def rounds(sides, iters, block, warm):
    """Each round's order of `sides` (rotated, and mirrored every other
    round: no side always runs right after the same other one, and each
    inherits what another left in turn), after one uncounted call of each
    (`warm(side)`: a first call that connects or faults pages in is not a
    sample)."""
    for s in sides:
        warm(s)
    done, r = 0, 0
    while done < iters:
        k = r % len(sides)
        order = sides[k:] + sides[:k]
        yield order if r % 2 == 0 else order[::-1]
        done += block
        r += 1


def latency(sides, size, iters, block):
    """Alternating blocks of single writes of `size` bytes; µs per call."""
    srcs = {s.impl: s.buffer(size, 7) for s in sides}
    out = {s.impl: [] for s in sides}

    def call(s):
        return s.engine.transfer_sync_write(s.session, srcs[s.impl], s.big, size)

    for order in rounds(sides, iters, block, call):
        for s in order:
            for _ in range(block):
                us, ret = timed(lambda: call(s))
                assert ret == 0, f"{s.impl}: {ret}"
                out[s.impl].append(us)
    return out


def batch64(sides, iters, block):
    """64 × 64 KiB in one batch; µs per batch."""
    n, chunk = 64, 64 << 10
    srcs = {s.impl: [s.buffer(chunk, 3) for _ in range(n)] for s in sides}
    out = {s.impl: [] for s in sides}

    def call(s):
        dsts = [s.big + i * chunk for i in range(n)]
        return s.engine.batch_transfer_sync_write(s.session, srcs[s.impl], dsts, [chunk] * n)

    for order in rounds(sides, iters, block, call):
        for s in order:
            for _ in range(block):
                us, ret = timed(lambda: call(s))
                assert ret == 0, f"{s.impl}: {ret}"
                out[s.impl].append(us)
    return out


def seed(side, rounds, big):
    """The seed scenario; returns (corrupted rounds, codes seen, ms to return)."""
    probe = side.buffer(4096, 1)
    src = side.buffer(big)
    corrupted, codes, ms = 0, {}, []
    for _ in range(rounds):
        assert side.engine.transfer_sync_write(side.session, probe, side.small, 4096) == 0
        assert side.ask(f"unregister {side.small}") == "0"
        side.ask(f"fill {side.big} {big} 0")
        ctypes.memset(src, 0xAA, big)
        us, ret = timed(
            lambda: side.engine.batch_transfer_sync_write(
                side.session, [probe, src], [side.small, side.big], [4096, big]
            )
        )
        if ret == -2 and side.impl.startswith("quiesce"):
            # Completion unknown: the memory is the engine's until it
            # drained, and a caller keeping the contract waits for that.
            side.engine.wait_for_quiescence(30)
        ctypes.memset(src, 0xBB, big)  # the caller reuses its buffer at once
        time.sleep(0.2)
        if int(side.ask(f"count {side.big} {big} 187")) > 0:
            corrupted += 1
        codes[ret] = codes.get(ret, 0) + 1
        ms.append(us / 1000)
        side.ask(f"register {side.small} 4096")
        if side.impl in LOCAL:
            side.engine.wait_for_quiescence(30)
    return corrupted, codes, statistics.median(ms)


def fmt(v):
    v = sorted(v)
    p99 = v[min(len(v) - 1, int(len(v) * 0.99))]
    return f"t_min {v[0]:8.1f}  p50 {statistics.median(v):8.1f}  p99 {p99:8.1f} µs"


def main():
    ap = argparse.ArgumentParser(prog="python -m quiesce.bench")
    ap.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default=None, help="comma-separated: quiesce,quiesce-local,mooncake,nixl")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--big", type=int, default=64 * MiB)
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve[0], [int(s) for s in a.serve[1:]])
    known = [*LOCAL, "mooncake", "nixl"]
    impls = a.impl.split(",") if a.impl else known
    unknown = [i for i in impls if i not in known]
    if unknown:
        ap.error(f"--impl {','.join(unknown)}: not one of {','.join(known)}")
    # The batch case writes 64 × 64 KiB into the big buffer.
    if a.big < 64 * (64 << 10) or a.iters < 1 or a.block < 1 or a.rounds < 1:
        ap.error("--big is at least 4 MiB (4194304); --iters, --block and --rounds at least 1")
    available = []
    for i in impls:
        try:
            load(i)
            available.append(i)
        except ImportError:
            print(f"{i}: not installed, skipped")
    # NIXL's progress threads (its target's and its initiator's) busy-poll
    # for as long as its agents live, which on a small machine takes the
    # cores from whatever runs beside them: it runs in a phase of its own,
    # after the others' targets are gone.
    # So quiesce-local, measured against NIXL, also runs the way NIXL must:
    # alone, every case warm (interleaved, each block of an implementation
    # starts after the others' blocks, with its threads asleep and its
    # buffers out of the cache). Its interleaved figures stay for Mooncake.
    alone = "quiesce-local" in available and "nixl" in available
    phases = [
        [i for i in available if i != "nixl"],
        ["quiesce-local"] if alone else [],
        [i for i in available if i == "nixl"],
    ]
    results, seeds = {}, []
    big_write = big_write_case(a.big)
    for n, phase in enumerate(phases):
        if not phase:
            continue
        sides = [Side(i, a.big) for i in phase]
        try:
            for s in [s for s in sides if LOCAL.get(s.impl) == "required"]:
                # Required: a target that may not reach this process's memory
                # (another user, YAMA's ptrace_scope 2) fails every transfer.
                if s.engine.transfer_sync_write(s.session, s.buffer(4096, 7), s.big, 4096) != 0:
                    print(f"{s.impl}: the local transport cannot attach here (kernel.yama.ptrace_scope?), skipped")
                    s.close()
                    sides.remove(s)
            if not sides:
                continue
            measure(sides, a, results, suffix=ALONE if n == 1 else "")
            if n == 1:
                continue
            for s in sides:
                if s.impl == "nixl":
                    # NIXL reports DONE for a write into a deregistered range:
                    # the scenario's refused write cannot be made.
                    seeds.append(f"   {s.impl:13} not run: a write NIXL's target refuses cannot be made")
                    continue
                c, codes, ms = seed(s, a.rounds, a.big)
                seeds.append(
                    f"   {s.impl:13} corrupted {c}/{a.rounds}  codes {codes}  returned after {ms:.1f} ms (p50)"
                )
        finally:
            for s in sides:
                s.close()
    for name, r in results.items():
        print(f"== {name}")
        for impl, v in r.items():
            extra = ""
            if name == big_write:
                extra = f"  ({a.big / (min(v) / 1e6) / 1e9:.2f} GB/s at t_min)"
            print(f"   {impl:19} {fmt(v)}{extra}")
        for mine in LOCAL:
            for other in ("mooncake", "nixl"):
                # Against NIXL, only figures measured as NIXL's are (alone):
                # quiesce's interleaved ones ran beside other targets.
                ours = mine + ALONE if other == "nixl" else mine
                if ours in r and other in r:
                    q, m = r[ours], r[other]
                    print(
                        f"   {ours} vs {other}: t_min {min(m) / min(q):.2f}×, p50 "
                        f"{statistics.median(m) / statistics.median(q):.2f}× (>1: quiesce faster)"
                    )
    print(f"== seed scenario ({a.rounds} rounds: [refused 4 KiB, valid {a.big >> 20} MiB], source overwritten on return)")
    print("\n".join(seeds))


def big_write_case(big):
    """The big write's case name: its size, exact."""
    return f"{big >> 20} MiB write" if big % MiB == 0 else f"{big} B write"


def measure(sides, a, results, suffix=""):
    """Every case for `sides`, interleaved among them; into `results`, each
    implementation's figures under its name + `suffix`."""

    def put(name, r):
        results.setdefault(name, {}).update({impl + suffix: v for impl, v in r.items()})

    for name, size in [("4 KiB write", 4096), ("64 KiB write", 64 << 10)]:
        put(name, latency(sides, size, a.iters, a.block))
    put("64 × 64 KiB batch", batch64(sides, max(a.iters // 10, 20), max(a.block // 10, 5)))
    put(big_write_case(a.big), latency(sides, a.big, 20, 5))


if __name__ == "__main__":
    main()
