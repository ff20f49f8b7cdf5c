#!/usr/bin/env bash
# rdma-bench.sh QUIESCE_BIN [ROUNDS] — runs inside the Soft-RoCE guest
# (scripts/softroce-vm.sh bench): perftest and `quiesce bench --transport rdma`
# on the same rxe0, interleaved, and prints the ratios.
#
# What is compared with what:
# * write latency: quiesce's p50 (post -> completion: one round trip, the write
#   and its ACK) against 2 x ib_write_lat's t_typical (ib_write_lat reports half
#   a ping-pong round trip);
# * read latency: quiesce's p50 against ib_read_lat's t_typical (both one
#   round trip);
# * "transport only" rows: the same operation through RdmaSegment::write/read
#   without the batch layer (--impl direct), to show what each layer costs;
# * bandwidth: quiesce against ib_write_bw's BW average, both in MiB/s
#   (perftest's "MB/sec" is 2^20 bytes a second; quiesce bench prints 10^6,
#   converted here), same message size and the same number of requests in
#   flight (64 x 64 KiB; 1 MiB slices of a 64 MiB write against -s 1M with
#   tx-depth 64).
set -u
Q=$1
ROUNDS=${2:-2}
DEV="-d rxe0 -x 1"
LOG=/tmp/rdma-bench
mkdir -p $LOG

# pair NAME TOOL ARGS...: perftest server + client on loopback; prints the
# client's data line.
perf() {
    local name=$1; shift
    timeout 120 "$@" > $LOG/$name.server 2>&1 & local sp=$!
    sleep 1
    timeout 120 "$@" 127.0.0.1 > $LOG/$name.client 2>&1
    wait $sp
    grep -E '^ +[0-9]+ +[0-9]+ ' $LOG/$name.client | tail -n1
}

# quiesce bench ARGS...: prints the data line.
qb() {
    "$Q" bench --transport rdma --busy-poll "$@" 2> $LOG/q.err | grep -E '^ +[0-9]+ +[0-9]+ ' | tail -n1
}

col() { echo "$1" | awk -v c="$2" '{print $c}'; }
# A run that failed printed nothing: its ratio is n/a, never 0.00 (which
# would read as a latency goal met).
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else print "n/a" }'; }
# quiesce bench's MB/s (10^6 B/s) in MiB/s (2^20 B/s, perftest's "MB").
mib() { awk -v x="$1" 'BEGIN { if (x > 0) printf "%.1f", x * 1e6 / 1048576 }'; }

printf '%-34s %14s %14s %8s %s\n' case quiesce perftest ratio goal
for r in $(seq "$ROUNDS"); do
    # Latency, 8 bytes and 4 KiB.
    for s in 8 4096; do
        p=$(perf wlat$s ib_write_lat $DEV -s $s -n 2000)
        q=$(qb --op write --size $s --iters 2000)
        pt=$(col "$p" 5); qt=$(col "$q" 4)
        p2=$(awk -v x="$pt" 'BEGIN { printf "%.2f", 2 * x }')
        printf '%-34s %11s us %11s us %8s %s\n' "write_lat_${s}B (p50 vs 2x t_typ)" "$qt" "$p2" "$(ratio "$qt" "$p2")" "<= 1.20"
        q=$(qb --impl direct --op write --size $s --iters 2000)
        qt=$(col "$q" 4)
        printf '%-34s %11s us %11s us %8s %s\n' "  same, transport only (no batch)" "$qt" "$p2" "$(ratio "$qt" "$p2")" ""
        p=$(perf rlat$s ib_read_lat $DEV -s $s -n 2000)
        q=$(qb --op read --size $s --iters 2000)
        pt=$(col "$p" 5); qt=$(col "$q" 4)
        printf '%-34s %11s us %11s us %8s %s\n' "read_lat_${s}B (p50 vs t_typ)" "$qt" "$pt" "$(ratio "$qt" "$pt")" "<= 1.20"
        q=$(qb --impl direct --op read --size $s --iters 2000)
        qt=$(col "$q" 4)
        printf '%-34s %11s us %11s us %8s %s\n' "  same, transport only (no batch)" "$qt" "$pt" "$(ratio "$qt" "$pt")" ""
    done
    # Bandwidth.
    p=$(perf bw64k ib_write_bw $DEV -s 65536 -n 2000 -t 64)
    q=$(qb --op write --size 64K --batch 64 --iters 40)
    pb=$(col "$p" 4); qb_=$(mib "$(col "$q" 9)")
    printf '%-34s %8s MiB/s %8s MiB/s %8s %s\n' "write_bw_64x64KiB" "$qb_" "$pb" "$(ratio "$qb_" "$pb")" ">= 1.00"
    p=$(perf bw1m ib_write_bw $DEV -s 1048576 -n 200 -t 64)
    q=$(qb --op write --size 64M --iters 4)
    pb=$(col "$p" 4); qb_=$(mib "$(col "$q" 9)")
    printf '%-34s %8s MiB/s %8s MiB/s %8s %s\n' "write_bw_64MiB (1 MiB WRs)" "$qb_" "$pb" "$(ratio "$qb_" "$pb")" ">= 1.00"
done
echo "raw outputs: $LOG (inside the guest)"
