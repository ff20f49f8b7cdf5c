#!/usr/bin/env bash
# Where a fail-fast batch's time goes (docs/BENCHMARKS.md, "fail-fast, step
# by step"): builds the `quiesce` binary with the runtime's `timeline`
# feature into target/timeline (its own target dir), runs `bench --compare
# --cases fail_fast_64m` with QUIESCE_TIMELINE set — [a 4 KiB write the
# target refuses, a valid 64 MiB write], fail-fast, both TCP drivers, the
# target in its own process — and lines up each batch's steps on both sides
# with scripts/fail-fast-breakdown.py.
# Usage: scripts/fail-fast-breakdown.sh [ROUNDS] (default 3: 24 batches a driver).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
CARGO_TARGET_DIR="$PWD/target/timeline" \
    cargo build -q --release --bin quiesce --features quiesce-runtime/timeline
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
QUIESCE_TIMELINE=$dir QUIESCE_TIMELINE_EVENTS=1000000 target/timeline/release/quiesce \
    bench --compare --cases fail_fast_64m --rounds "$rounds" --no-instructions --spin-us 50 \
    | grep -E '^(case|fail_fast_64m +quiesce-(io_uring|epoll))'
echo
python3 scripts/fail-fast-breakdown.py "$dir"
