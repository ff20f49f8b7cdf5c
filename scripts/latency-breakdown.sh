#!/usr/bin/env bash
# Where a blocking 4 KiB `transfer_sync_write` from Python spends its time
# (docs/BENCHMARKS.md, "Where a 4 KiB call's time goes"): builds the
# package with the runtime's `timeline` feature into its own venv (not the
# README's .venv; the first run takes a few minutes), runs N calls against
# a target process with QUIESCE_TIMELINE set (timed as `python -m
# quiesce.bench` times them: its `latency()`), and lines up the caller's and
# the target's step readings with scripts/latency-breakdown.py.
# Usage: scripts/latency-breakdown.sh [N] (default 20000).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-20000}
venv=target/timeline-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# An absolute target dir: maturin runs cargo inside python/.
MATURIN_PEP517_ARGS="--features timeline" CARGO_TARGET_DIR="$PWD/target/timeline" \
    "$venv/bin/pip" install -q ./python
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
QUIESCE_TIMELINE=$dir "$venv/bin/python" - "$n" <<'PY'
import sys, time
from quiesce.bench import Side, latency
n = int(sys.argv[1])
side = Side("quiesce", 1 << 20)
latency([side], 4096, 200, 200)  # warm-up: connection, lane, segment
times = sorted(latency([side], 4096, n, n)["quiesce"])
print(f"{n} calls from Python: t_min {times[0]:.2f} µs, p50 {times[n // 2]:.2f} µs")
time.sleep(0.5)
side.close()
PY
python3 scripts/latency-breakdown.py "$dir"
