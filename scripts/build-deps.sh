#!/usr/bin/env bash
# build-deps.sh — installs what building quiesce needs beyond Rust and gcc:
# cmake and libclang (rdma-mummy-sys compiles its libibverbs loader with
# cmake and generates bindings with bindgen), and protoc with protobuf's
# well-known types (etcd-client, in quiesce-directory, generates its gRPC
# code at build time and imports google/protobuf/descriptor.proto, which is
# in libprotobuf-dev, not in protobuf-compiler). Idempotent;
# quiet when all are there. libibverbs itself is NOT needed: it is loaded at
# run time.
set -euo pipefail
have_libclang() {
    ls /usr/lib/llvm-*/lib/libclang*.so* /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1
}
have_protos() {
    [ -e /usr/include/google/protobuf/descriptor.proto ]
}
if command -v cmake >/dev/null && command -v protoc >/dev/null && have_protos && have_libclang; then
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "build-deps.sh: cmake/libclang/protoc/protobuf headers missing; run as root to install them" >&2; exit 1; }
echo "build-deps.sh: installing cmake, libclang-dev, protobuf-compiler and libprotobuf-dev" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends cmake libclang-dev protobuf-compiler libprotobuf-dev >/dev/null
