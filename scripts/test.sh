#!/usr/bin/env bash
# Runs the whole test suite once per driver (io_uring, then epoll).
# Usage: scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-deps.sh   # cmake + libclang for rdma-mummy-sys (libibverbs is not needed)

for driver in io_uring epoll; do
  echo "=== cargo test --workspace (QUIESCE_DRIVER=$driver)"
  QUIESCE_DRIVER=$driver cargo test --workspace "$@"
done

# The step timeline is a build feature (scripts/latency-breakdown.sh): its
# own test builds the runtime with it.
echo "=== cargo test -p quiesce-runtime --features timeline --lib timeline"
cargo test -p quiesce-runtime --features timeline --lib timeline

# The Python extension's crate is `test = false` (a cdylib the pytest suite
# drives); its unit tests (managed buffers' accounting) need no Python and
# run when asked by name.
echo "=== cargo test -p quiesce-python --lib"
cargo test -p quiesce-python --lib
