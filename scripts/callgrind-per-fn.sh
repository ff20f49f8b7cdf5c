#!/usr/bin/env bash
# Where the instructions of one iteration go: given two callgrind outputs
# of the same program run for N1 and N2 iterations, prints each function's
# (Ir(N2) − Ir(N1)) / (N2 − N1), the largest first (self cost, not
# inclusive), so start-up and one-off work cancel out. Used by the
# ANNOTATE=1 mode of scripts/callgrind-initiator.sh and callgrind-python.sh.
# Usage: scripts/callgrind-per-fn.sh N1 OUT1 N2 OUT2 [TOP]
set -euo pipefail
n1=$1 out1=$2 n2=$3 out2=$4 top=${5:-60}
per_fn() {
    # --show-percs=no: a percentage column would make each run's row key
    # differ, so no row would pair with its twin.
    callgrind_annotate --inclusive=no --show-percs=no --auto=no --threshold=100 "$1" 2>/dev/null \
        | awk '$1 ~ /^[0-9,]+$/ && $2 !~ /^=>/ { ir=$1; gsub(",", "", ir); $1=""; print ir "\t" $0 }'
}
awk -F'\t' -v d=$((n2 - n1)) 'NR == FNR { a[$2] = $1; next } { printf "%8.1f %s\n", ($1 - a[$2]) / d, $2 }' \
    <(per_fn "$out1") <(per_fn "$out2") | sort -rn | head -"$top" || true
