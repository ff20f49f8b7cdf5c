#!/usr/bin/env bash
# Instructions per blocking 4 KiB `transfer_sync_write` call from Python
# (docs/BENCHMARKS.md): the Mooncake drop-in over TCP (its caller lane)
# against a target process, the initiator under callgrind for N1 and N2
# calls; prints (Ir(N2) − Ir(N1)) / (N2 − N1), the interpreter's share
# included, and with ANNOTATE=1 the largest functions of that difference
# (the N2 run kept as /tmp/callgrind-python.out, for callgrind_annotate).
# QUIESCE_DRIVER=epoll and QUIESCE_SPIN_US=0: no idle spinning is counted
# (under valgrind the io_uring reactor stalls); PYTHONHASHSEED=0: the same
# interpreter work in both runs.
# Usage: scripts/callgrind-python.sh [N1 N2] (default 200 1200), with the
# package installed in .venv (README).
set -euo pipefail
cd "$(dirname "$0")/.."
n1=${1:-200} n2=${2:-1200}
py=${QUIESCE_VENV:-.venv}/bin/python
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/calls.py" <<'PY'
import sys
from quiesce.bench import Side
n = int(sys.argv[1])
side = Side("quiesce", 1 << 20)
src = side.buffer(4096, 7)
for _ in range(20):
    assert side.engine.transfer_sync_write(side.session, src, side.big, 4096) == 0
for _ in range(n):
    side.engine.transfer_sync_write(side.session, src, side.big, 4096)
side.close()
PY
ir() {
    PYTHONHASHSEED=0 QUIESCE_DRIVER=epoll QUIESCE_SPIN_US=0 valgrind --tool=callgrind \
        --callgrind-out-file="$dir/cg.$1" "$py" "$dir/calls.py" "$1" >/dev/null 2>"$dir/err.$1" \
        || { cat "$dir/err.$1" >&2; exit 1; }
    awk '/^(summary|totals):/ {print $2}' "$dir/cg.$1" | tail -1
}
a=$(ir "$n1")
b=$(ir "$n2")
echo "python initiator: $(( (b - a) / (n2 - n1) )) instructions per 4 KiB transfer_sync_write ($n1 → $n2 calls: $a → $b)"
if [ "${ANNOTATE:-0}" = 1 ]; then
    cp "$dir/cg.$n2" /tmp/callgrind-python.out
    scripts/callgrind-per-fn.sh "$n1" "$dir/cg.$n1" "$n2" "$dir/cg.$n2" "${TOP:-40}"
    echo "(the $n2-call run kept as /tmp/callgrind-python.out)"
fi
