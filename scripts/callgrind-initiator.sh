#!/usr/bin/env bash
# Instructions per 4 KiB write on the *initiator* (docs/BENCHMARKS.md), the
# figure `bench --compare` prints in its Ir column: a native `quiesce target`
# serves, `quiesce bench --connect` runs under callgrind twice, with N1 and N2
# writes, and the script prints (Ir(N2) − Ir(N1)) / (N2 − N1), which leaves
# start-up and the connection out. With ANNOTATE=1 it also keeps the N2 run's
# output and prints `callgrind_annotate --inclusive=no` of it (where they go).
# Usage: scripts/callgrind-initiator.sh [N1 N2] (default 1000 6000; release
# build of the `quiesce` binary first). QUIESCE_DRIVER picks the initiator's
# driver (default io_uring); OP=read measures 4 KiB reads instead; IMPL
# picks `bench --impl` (default quiesce; IMPL=direct counts the TCP transport
# without the batch layer, IMPL=raw the raw-socket baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
n1=${1:-1000} n2=${2:-6000}
bin=target/release/quiesce
impl=${IMPL:-quiesce}
driver=${QUIESCE_DRIVER:-io_uring}
op=${OP:-write}
dir=$(mktemp -d)
trap 'kill "${tpid:-}" 2>/dev/null || true; rm -rf "$dir"' EXIT

mkfifo "$dir/in"
"$bin" target --size 1M <"$dir/in" >"$dir/target" 2>/dev/null &
tpid=$!
exec {keep}>"$dir/in"   # the target serves until its stdin closes
until grep -q '^listening' "$dir/target" 2>/dev/null; do
    kill -0 "$tpid" 2>/dev/null || { echo "the target did not start (is $bin built?)" >&2; exit 1; }
    sleep 0.2
done
addr=$(awk '/^listening/ {print $2}' "$dir/target")
token=$(awk '$1 == "segment" && $2 == "kv" {print $5}' "$dir/target")

ir() {
    local n=$1 out=$dir/cg.$1
    valgrind --tool=callgrind --callgrind-out-file="$out" \
        "$bin" bench --connect "$addr" --token "$token" --impl "$impl" \
        --driver "$driver" --op "$op" --size 4K --iters "$n" >/dev/null 2>"$dir/err.$n" \
        || { cat "$dir/err.$n" >&2; exit 1; }
    awk '/^(summary|totals):/ {print $2}' "$out" | tail -1
}

a=$(ir "$n1")
b=$(ir "$n2")
echo "initiator ($driver): $(( (b - a) / (n2 - n1) )) instructions per 4 KiB $op ($n1 → $n2: $a → $b)"
if [ "${ANNOTATE:-0}" = 1 ]; then
    cp "$dir/cg.$n2" /tmp/callgrind-initiator.out
    scripts/callgrind-per-fn.sh "$n1" "$dir/cg.$n1" "$n2" "$dir/cg.$n2" "${TOP:-60}"
    echo "(the $n2-write run kept as /tmp/callgrind-initiator.out)"
fi
exec {keep}>&-
