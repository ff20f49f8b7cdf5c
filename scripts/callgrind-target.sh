#!/usr/bin/env bash
# Instructions per 4 KiB write on the *target* (docs/BENCHMARKS.md): runs
# `quiesce target` under callgrind (epoll: under valgrind the io_uring
# target stalls) twice, driven by a native initiator with N1 and N2 writes,
# and prints (Ir(N2) − Ir(N1)) / (N2 − N1), which leaves start-up out.
# With ANNOTATE=1 it also prints the per-function difference and keeps the
# N2 run as /tmp/callgrind-target.out.
# Usage: scripts/callgrind-target.sh [N1 N2] (default 1000 6000; release
# build of the `quiesce` binary first).
set -euo pipefail
cd "$(dirname "$0")/.."
n1=${1:-1000} n2=${2:-6000}
bin=target/release/quiesce
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

ir() {
    local n=$1 out=$dir/cg.$1 fifo=$dir/in.$1
    mkfifo "$fifo"
    QUIESCE_DRIVER=epoll valgrind --tool=callgrind --callgrind-out-file="$out" \
        "$bin" target --size 1M <"$fifo" >"$dir/target.$n" 2>/dev/null &
    local pid=$!
    exec {keep}>"$fifo"   # the target serves until its stdin closes
    until grep -q '^listening' "$dir/target.$n" 2>/dev/null; do
        kill -0 "$pid" 2>/dev/null || { echo "the target did not start (valgrind, $bin?)" >&2; exit 1; }
        sleep 0.2
    done
    local addr token
    addr=$(awk '/^listening/ {print $2}' "$dir/target.$n")
    token=$(awk '$1 == "segment" && $2 == "kv" {print $5}' "$dir/target.$n")
    "$bin" bench --connect "$addr" --token "$token" --size 4K --iters "$n" >/dev/null
    exec {keep}>&-
    wait "$pid"
    awk '/^summary:/ {print $2}' "$out"
}

a=$(ir "$n1")
b=$(ir "$n2")
echo "target: $(( (b - a) / (n2 - n1) )) instructions per 4 KiB write ($n1 → $n2 writes: $a → $b)"
if [ "${ANNOTATE:-0}" = 1 ]; then
    cp "$dir/cg.$n2" /tmp/callgrind-target.out
    scripts/callgrind-per-fn.sh "$n1" "$dir/cg.$n1" "$n2" "$dir/cg.$n2" "${TOP:-60}"
    echo "(the $n2-write run kept as /tmp/callgrind-target.out)"
fi
