#!/usr/bin/env bash
# softroce-vm.sh — quiesce's RDMA test harness: run a command inside a throw-away
# QEMU guest that has a working Soft-RoCE (rdma_rxe) device "rxe0", and return
# the command's exit code. Adapted from shared/softroce-vm/run-in-vm.sh.
#
# Why: the host kernel (Firecracker VM) has no CONFIG_INFINIBAND, so verbs can
# only run inside a guest that boots a stock Debian kernel (which ships
# ib_core / ib_uverbs / rdma_rxe as modules).
#
# Usage:
#   softroce-vm.sh test                     # build quiesce's RDMA tests on the host, run them in the guest
#   softroce-vm.sh bench                    # quiesce bench --transport rdma next to perftest, in one guest
#   run-in-vm.sh setup                      # only build/refresh the cache
#   run-in-vm.sh build-siw                  # optional: build soft-iWARP siw.ko (Debian lacks it)
#   run-in-vm.sh selftest                   # boot + ibv_devices/ibv_rc_pingpong/perftest/rping
#   run-in-vm.sh [opts] [--] CMD [ARGS...]  # boot, run CMD in the guest, return its exit code
#   run-in-vm.sh shell-cmd 'CMD STRING'     # same, but CMD STRING is run by bash -c
#
# Options (before CMD):
#   --share DIR     share host DIR (read-write, virtio-9p) at the SAME absolute path in
#                   the guest; repeatable. Default: $SOFTROCE_VM_SHARE (colon-separated
#                   list) if set, else the current directory.
#   --no-share      do not share anything (not even the current directory)
#   --cwd DIR       working directory for CMD in the guest (default: current directory)
#   --env NAME=VAL  export an environment variable to CMD; repeatable
#   --no-rxe        do not load rdma_rxe / create rxe0
#   --siw           also create a soft-iWARP device "siw0" on 10.77.1.1 (needs build-siw first)
#
# Environment knobs (all optional):
#   SOFTROCE_VM_CACHE    cache folder (default /var/tmp/softroce-vm)
#   SOFTROCE_VM_KERNEL   "bookworm" (Debian 6.1, default) or "bookworm-backports" (6.12)
#   SOFTROCE_VM_MIRROR   Debian mirror URL (default: the first Debian URI in apt's sources)
#   SOFTROCE_VM_MEM      guest RAM in MiB (default 2048)
#   SOFTROCE_VM_CPUS     guest vCPUs (default: number of host CPUs, max 4)
#   SOFTROCE_VM_ACCEL    "tcg" (default) or "kvm" (does NOT work on PVM hosts, see README)
#   SOFTROCE_VM_TIMEOUT  seconds before the guest is killed (default 3600); exit code 124
#   SOFTROCE_VM_EXTRA_PKGS  extra Debian packages to debootstrap into the guest root
#   SOFTROCE_VM_VERBOSE=1   show kernel boot messages
#   SOFTROCE_VM_SHARE    default share list (see --share), handy as a cargo runner
#   SOFTROCE_VM_MTU      MTU of the dummy netdevs (default 1500 -> RoCE MTU 1024)
#
# Exit code: the guest command's exit code; 124 on timeout; 125 if the guest died
# without reporting one (crash, boot failure); 126 on host-side setup errors.
set -euo pipefail

SCRIPT_VERSION=4   # bump to force the guest root / initramfs to be rebuilt

CACHE=${SOFTROCE_VM_CACHE:-/var/tmp/softroce-vm}
KFLAVOUR=${SOFTROCE_VM_KERNEL:-bookworm}
MEM=${SOFTROCE_VM_MEM:-2048}
NCPU=$(nproc); [ "$NCPU" -gt 4 ] && NCPU=4
CPUS=${SOFTROCE_VM_CPUS:-$NCPU}
ACCEL=${SOFTROCE_VM_ACCEL:-tcg}
TIMEOUT=${SOFTROCE_VM_TIMEOUT:-3600}
VERBOSE=${SOFTROCE_VM_VERBOSE:-0}
EXTRA_PKGS=${SOFTROCE_VM_EXTRA_PKGS:-}

# Userspace that goes into the guest root. rdma-core itself (udev rules, systemd
# units) is not needed: libibverbs + the rxe provider + iproute2's `rdma` suffice.
# python3: the Python package's RDMA tests run in the guest from the host's
# venv (same Debian, same Python 3.11), shared with the repository.
GUEST_PKGS="libibverbs1,ibverbs-providers,ibverbs-utils,librdmacm1,rdmacm-utils,perftest,iproute2,kmod,busybox-static,liburing2,procps,python3"

log() { printf '[softroce-vm %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 126; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot, 9p passthrough)"
case "$KFLAVOUR" in bookworm|bookworm-backports) ;; *) die "SOFTROCE_VM_KERNEL must be bookworm or bookworm-backports";; esac

# ---------------------------------------------------------------------------
# Host packages
# ---------------------------------------------------------------------------
apt_updated=0
apt_update_once() { [ $apt_updated = 1 ] || { apt-get update -qq; apt_updated=1; }; }

# Mirror: reuse the one apt already uses (first "debian" URI), so the script works
# wherever apt works.
detect_mirror() {
    if [ -n "${SOFTROCE_VM_MIRROR:-}" ]; then echo "$SOFTROCE_VM_MIRROR"; return; fi
    local m
    m=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -oE 'https?://[^ ]*/debian/?' | grep -v security | head -n1 || true)
    [ -n "$m" ] || die "no Debian mirror found in apt sources; set SOFTROCE_VM_MIRROR"
    echo "$m"
}
MIRROR=$(detect_mirror)

# A private apt configuration for bookworm-backports (we never edit /etc/apt).
BPO_DIR=$CACHE/apt-bpo
bpo_apt_opts() {
    echo "-o Dir::Etc::sourcelist=$BPO_DIR/sources.list -o Dir::Etc::sourceparts=- \
-o Dir::State::lists=$BPO_DIR/lists -o Dir::Cache::archives=$BPO_DIR/archives -o APT::Sandbox::User=root"
}
bpo_setup() {
    mkdir -p "$BPO_DIR/lists/partial" "$BPO_DIR/archives/partial"
    # bookworm itself is listed too: the backport's dependencies (libfdt1, libslirp0, ...)
    # come from there, and this private list replaces the system's.
    local suite
    for suite in bookworm bookworm-updates bookworm-backports; do
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${MIRROR%/} $suite main"
    done > "$BPO_DIR/sources.list"
    # shellcheck disable=SC2046
    apt-get $(bpo_apt_opts) update -qq
}

install_host_packages() {
    local need=()
    command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
    command -v debootstrap        >/dev/null || need+=(debootstrap)
    command -v cpio               >/dev/null || need+=(cpio)
    command -v xz                 >/dev/null || need+=(xz-utils)
    command -v zstd               >/dev/null || need+=(zstd)
    [ ${#need[@]} = 0 ] && return 0
    log "installing host packages: ${need[*]}"
    apt_update_once
    local plain=() q=()
    for p in "${need[@]}"; do [ "$p" = qemu-system-x86 ] && q+=("$p") || plain+=("$p"); done
    [ ${#plain[@]} = 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${plain[@]}" >/dev/null
    if [ ${#q[@]} -gt 0 ]; then
        # PITFALL: this machine image ships qemu-utils 10.x from bookworm-backports.
        # bookworm's qemu-system-x86 (7.2) "Breaks" it, so a plain install silently
        # REMOVES qemu-utils. If a backported qemu-utils is present, take
        # qemu-system-x86 from bookworm-backports too (same version, nothing removed).
        local qu
        qu=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
        if [[ "$qu" == *bpo* ]]; then
            log "qemu-utils $qu is a backport -> installing qemu-system-x86 from bookworm-backports"
            bpo_setup
            # shellcheck disable=SC2046
            DEBIAN_FRONTEND=noninteractive apt-get $(bpo_apt_opts) install -y -qq --no-install-recommends \
                -t bookworm-backports qemu-system-x86 >/dev/null
        else
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 >/dev/null
        fi
    fi
}

# ---------------------------------------------------------------------------
# Guest kernel: Debian's own package, unpacked with dpkg -x (never installed on the
# host). We boot the *uncompressed* vmlinux through QEMU's PVH entry point: under
# TCG this skips SeaBIOS' bzImage path and the in-guest xz decompression (~10 s).
# ---------------------------------------------------------------------------
prepare_kernel() {
    local kdir=$CACHE/kernel-$KFLAVOUR
    [ -f "$kdir/.done" ] && return 0
    log "fetching Debian kernel ($KFLAVOUR)"
    rm -rf "$kdir"; mkdir -p "$kdir/deb"
    local pkg
    if [ "$KFLAVOUR" = bookworm-backports ]; then
        bpo_setup
        # shellcheck disable=SC2046
        pkg=$(apt-cache $(bpo_apt_opts) depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
        # shellcheck disable=SC2046
        (cd "$kdir/deb" && apt-get $(bpo_apt_opts) download "$pkg" 2>/dev/null)
    else
        apt_update_once
        pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
        (cd "$kdir/deb" && apt-get download "$pkg" 2>/dev/null)
    fi
    [ -n "$pkg" ] || die "could not resolve linux-image-amd64"
    dpkg -x "$kdir"/deb/*.deb "$kdir/root"
    local kver; kver=$(ls "$kdir/root/lib/modules")
    echo "$kver" > "$kdir/kver"
    ls "$kdir/root/lib/modules/$kver/kernel/drivers/infiniband/sw/rxe/" | grep -q rdma_rxe || die "kernel has no rdma_rxe module"
    # Extract vmlinux (ELF with a PVH note) from the bzImage.
    local vmlinuz="$kdir/root/boot/vmlinuz-$kver" off
    if off=$(LC_ALL=C grep -obUaP -m1 '\xfd7zXZ\x00' "$vmlinuz" | head -n1 | cut -d: -f1) && [ -n "$off" ]; then
        tail -c +$((off + 1)) "$vmlinuz" | xz -dc --single-stream > "$kdir/vmlinux" 2>/dev/null || true
    elif off=$(LC_ALL=C grep -obUaP -m1 '\x28\xb5\x2f\xfd' "$vmlinuz" | head -n1 | cut -d: -f1) && [ -n "$off" ]; then
        tail -c +$((off + 1)) "$vmlinuz" | zstd -dc 2>/dev/null > "$kdir/vmlinux" || true
    fi
    if [ "$(head -c4 "$kdir/vmlinux" 2>/dev/null | od -An -c | tr -d ' ')" != '177ELF' ]; then
        log "could not extract vmlinux; will boot the bzImage (slower)"
        rm -f "$kdir/vmlinux"
    fi
    rm -rf "$kdir/deb"
    touch "$kdir/.done"
}

# ---------------------------------------------------------------------------
# Guest root: debootstrap --variant=minbase bookworm (same glibc/libibverbs as the
# host, so host-built binaries run unchanged). It is exported read-only over 9p
# and the guest puts a tmpfs overlay on top.
# ---------------------------------------------------------------------------
prepare_rootfs() {
    local root=$CACHE/rootfs
    local want="v$SCRIPT_VERSION $GUEST_PKGS $EXTRA_PKGS"
    if [ ! -f "$root/.done" ] || [ "$(cat "$root/.done")" != "$want" ]; then
        log "debootstrap bookworm into $root (mirror $MIRROR)"
        rm -rf "$root" "$root.tmp"
        local inc=$GUEST_PKGS; [ -n "$EXTRA_PKGS" ] && inc="$inc,${EXTRA_PKGS// /,}"
        debootstrap --variant=minbase --include="$inc" bookworm "$root.tmp" "$MIRROR" > "$CACHE/debootstrap.log" 2>&1 \
            || { tail -n 30 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
        rm -rf "$root.tmp"/var/cache/apt/archives/*.deb "$root.tmp"/var/lib/apt/lists/*
        write_guest_init "$root.tmp"
        mv "$root.tmp" "$root"
        echo "$want" > "$root/.done"
    fi
    # Install the selected kernel's modules (several kernels can coexist).
    local kver; kver=$(cat "$CACHE/kernel-$KFLAVOUR/kver")
    if [ ! -f "$root/lib/modules/$kver/.installed" ]; then
        log "installing modules $kver into guest root"
        rm -rf "$root/lib/modules/$kver"; mkdir -p "$root/lib/modules"
        cp -a "$CACHE/kernel-$KFLAVOUR/root/lib/modules/$kver" "$root/lib/modules/"
        # optional self-built modules (e.g. siw.ko, see README) go to updates/
        if [ -d "$CACHE/extra-modules/$kver" ]; then
            cp -a "$CACHE/extra-modules/$kver" "$root/lib/modules/$kver/updates"
        fi
        chroot "$root" depmod -a "$kver"   # the host has no kmod; the guest root does
        touch "$root/lib/modules/$kver/.installed"
    fi
    write_guest_init "$root"   # cheap; keeps the guest init in sync with this script
}

# The second-stage init, run from the real (overlay) root. Reads its job from the
# "vmctl" 9p share that the host fills per run.
write_guest_init() {
    cat > "$1/sbin/vm-guest-init" <<'GUEST'
#!/bin/bash
# vm-guest-init: second-stage init inside the guest (PID 1). Written by run-in-vm.sh.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=dumb LANG=C.UTF-8
CTL=/run/vmctl
finish() {   # report exit code to the host, then power off immediately
    echo "$1" > $CTL/exit_code; sync
    busybox poweroff -f
}
mkdir -p /run /tmp /dev/pts /dev/shm
mount -t tmpfs -o mode=755 tmpfs /run; mkdir -p $CTL
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=none vmctl $CTL || { echo "vm: cannot mount vmctl"; busybox poweroff -f; }
# User shares: "tag path" per line, mounted at the same absolute path as on the host.
while read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "$path"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=mmap "$tag" "$path" \
        || echo "vm: cannot mount share $tag at $path"
done < $CTL/shares
ip link set lo up
ulimit -l unlimited   # verbs pins memory (root has CAP_IPC_LOCK anyway)
. $CTL/env.sh
# Dummy netdevs are enough: rxe short-circuits packets addressed to its own GID and
# siw's TCP goes over the guest's local routing, so nothing leaves the guest.
# rxe0 sits on rdma0 (10.77.0.1), siw0 on rdma1 (10.77.1.1), so that rdma_cm
# picks the device by IP address.
mkdummy() {
    modprobe dummy numdummies=0 && ip link add "$1" type dummy && ip link set "$1" mtu "${VM_MTU:-1500}" &&
    ip addr add "$2" dev "$1" && ip link set "$1" up
}
if [ "${VM_RXE:-1}" = 1 ]; then
    mkdummy rdma0 10.77.0.1/24 && modprobe rdma_rxe && rdma link add rxe0 type rxe netdev rdma0 \
        || { echo "vm: rxe setup failed"; finish 125; }
fi
if [ "${VM_SIW:-0}" = 1 ]; then
    mkdummy rdma1 10.77.1.1/24 && modprobe siw && rdma link add siw0 type siw netdev rdma1 \
        || { echo "vm: siw setup failed (no siw.ko? see README / run-in-vm.sh build-siw)"; finish 125; }
fi
for d in /sys/class/infiniband/*; do   # wait until each port is ACTIVE
    [ -e "$d" ] || continue
    for i in $(seq 100); do grep -q ACTIVE "$d"/ports/1/state && break; sleep 0.1; done
done
echo "vm: ready after $(cut -d' ' -f1 /proc/uptime)s guest uptime; devices: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"
cd "${VM_CWD:-/}" 2>/dev/null || cd /
bash $CTL/cmd.sh < /dev/null > /dev/console 2>&1
finish $?
GUEST
    chmod 755 "$1/sbin/vm-guest-init"
}

# ---------------------------------------------------------------------------
# Initramfs: busybox + just the modules needed to mount the 9p root with an
# overlay; then switch_root to /sbin/vm-guest-init.
# ---------------------------------------------------------------------------
prepare_initrd() {
    local kver; kver=$(cat "$CACHE/kernel-$KFLAVOUR/kver")
    local out=$CACHE/initrd-$kver-v$SCRIPT_VERSION.cpio
    INITRD=$out
    [ -f "$out" ] && return 0
    log "building initramfs for $kver"
    local d; d=$(mktemp -d "$CACHE/initrd.XXXXXX")
    mkdir -p "$d"/{bin,proc,sys,dev,ro,rw,newroot,modules}
    cp "$CACHE/rootfs/bin/busybox" "$d/bin/busybox"   # busybox-static from the guest root
    local m
    for mod in virtio_pci 9pnet_virtio 9p overlay; do
        chroot "$CACHE/rootfs" modprobe -S "$kver" --show-depends "$mod" | awk '$1=="insmod"{print $2}'
    done | awk '!seen[$0]++' | while read -r m; do
        cp "$CACHE/rootfs$m" "$d/modules/"
        basename "$m" >> "$d/modules/order"
    done
    cat > "$d/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules/order); do
    case $m in *.ko.xz) xz -dc /modules/$m > /tmp.ko; insmod /tmp.ko; rm -f /tmp.ko;;
               *) insmod /modules/$m;; esac || echo "initrd: insmod $m failed"
done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=loose,ro rootfs /ro || { echo "initrd: 9p root failed"; poweroff -f; }
mount -t tmpfs -o size=50% tmpfs /rw && mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/ro,upperdir=/rw/upper,workdir=/rw/work /newroot || { echo "initrd: overlay failed"; poweroff -f; }
mount --move /proc /newroot/proc; mount --move /sys /newroot/sys; mount --move /dev /newroot/dev
exec switch_root /newroot /sbin/vm-guest-init
INIT
    chmod 755 "$d/init"
    (cd "$d" && find . | cpio -o -H newc --quiet > "$out.tmp") && mv "$out.tmp" "$out"
    rm -rf "$d"
}

# ---------------------------------------------------------------------------
# Optional: soft-iWARP. Debian does not enable CONFIG_RDMA_SIW in any of its
# kernels (6.1 or the 6.12 backport), so build siw.ko out of tree from the
# matching linux-source package against the matching linux-headers package.
# This installs linux-headers-<kver>, make and gcc on the host (under /usr/src and
# /usr/lib/linux-kbuild-*; nothing in /boot, the running kernel is not touched).
# ---------------------------------------------------------------------------
build_siw() {
    local kver; kver=$(cat "$CACHE/kernel-$KFLAVOUR/kver")
    [ -f "$CACHE/extra-modules/$kver/siw.ko" ] && { log "siw.ko for $kver already built"; return 0; }
    local series; series=$(echo "$kver" | cut -d. -f1-2)        # 6.1 / 6.12
    local b=$CACHE/siw-build; rm -rf "$b"; mkdir -p "$b"
    log "building siw.ko for $kver (linux-source-$series + linux-headers-$kver)"
    if [ "$KFLAVOUR" = bookworm-backports ]; then
        bpo_setup
        # shellcheck disable=SC2046
        DEBIAN_FRONTEND=noninteractive apt-get $(bpo_apt_opts) install -y -qq --no-install-recommends \
            -t bookworm-backports "linux-headers-$kver" make gcc >/dev/null
        # shellcheck disable=SC2046
        (cd "$b" && apt-get $(bpo_apt_opts) download "linux-source-$series" 2>/dev/null)
    else
        apt_update_once
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "linux-headers-$kver" make gcc >/dev/null
        (cd "$b" && apt-get download "linux-source-$series" 2>/dev/null)
    fi
    dpkg -x "$b"/linux-source-*.deb "$b/pkg"
    tar -xaf "$b"/pkg/usr/src/linux-source-*.tar.* -C "$b" --wildcards '*/drivers/infiniband/sw/siw/*'
    local dir; dir=$(echo "$b"/linux-source-*/drivers/infiniband/sw/siw)
    make -s -C "/usr/src/linux-headers-$kver" M="$dir" CONFIG_RDMA_SIW=m modules 2>&1 | grep -v 'Skipping BTF' || true
    [ -f "$dir/siw.ko" ] || die "siw build failed"
    mkdir -p "$CACHE/extra-modules/$kver"; cp "$dir/siw.ko" "$CACHE/extra-modules/$kver/"
    rm -f "$CACHE/rootfs/lib/modules/$kver/.installed"; rm -rf "$b"
    prepare_rootfs
    log "siw.ko installed into the guest root (use --siw)"
}

setup_all() {
    mkdir -p "$CACHE"
    exec 9> "$CACHE/.lock"; flock 9      # concurrent runs: only one builds the cache
    install_host_packages
    prepare_kernel
    prepare_rootfs
    prepare_initrd
    flock -u 9
}

# ---------------------------------------------------------------------------
# Boot and run
# ---------------------------------------------------------------------------
run_vm() {   # $@ = command (argv)
    local kdir=$CACHE/kernel-$KFLAVOUR kver
    kver=$(cat "$kdir/kver")
    local run; run=$(mktemp -d "$CACHE/run.XXXXXX")
    RUN_DIR=$run; trap 'rm -rf "$RUN_DIR"' EXIT
    # the command, as a bash script with exact argv quoting
    { printf 'set -o pipefail\n'; printf 'exec'; printf ' %q' "$@"; printf '\n'; } > "$run/cmd.sh"
    {
        printf 'export VM_RXE=%q VM_SIW=%q VM_CWD=%q VM_MTU=%q\n' "$OPT_RXE" "$OPT_SIW" "$OPT_CWD" "${SOFTROCE_VM_MTU:-1500}"
        for kv in "${OPT_ENV[@]}"; do printf 'export %q\n' "$kv"; done
    } > "$run/env.sh"
    : > "$run/shares"
    local qargs=() i=0 s
    for s in "${OPT_SHARES[@]}"; do
        s=$(realpath "$s"); [ -d "$s" ] || die "share $s is not a directory"
        echo "host$i $s" >> "$run/shares"
        qargs+=(-virtfs "local,path=$s,mount_tag=host$i,security_model=none,multidevs=remap")
        i=$((i + 1))
    done
    local kernel=$kdir/vmlinux; [ -f "$kernel" ] || kernel=$kdir/root/boot/vmlinuz-$kver
    local accel=(-accel tcg,thread=multi -cpu max)
    [ "$ACCEL" = kvm ] && accel=(-accel kvm -cpu host)
    local quiet="quiet loglevel=1"; [ "$VERBOSE" = 1 ] && quiet=""
    log "booting guest ($ACCEL, $CPUS vCPU, ${MEM} MiB, kernel $kver)"
    local rc=0
    timeout -k 10 "$TIMEOUT" qemu-system-x86_64 "${accel[@]}" -smp "$CPUS" -m "$MEM" \
        -nodefaults -display none -no-reboot -serial stdio \
        -kernel "$kernel" -initrd "$INITRD" \
        -append "console=ttyS0 $quiet panic=-1 rdinit=/init nokaslr mitigations=off" \
        -virtfs "local,path=$CACHE/rootfs,mount_tag=rootfs,security_model=none,readonly=on,multidevs=remap" \
        -virtfs "local,path=$run,mount_tag=vmctl,security_model=none" \
        "${qargs[@]}" < /dev/null || rc=$?
    if [ $rc = 124 ] || [ $rc = 137 ]; then log "TIMEOUT after ${TIMEOUT}s"; return 124; fi
    [ $rc = 0 ] || log "qemu exited with $rc"
    if [ -s "$run/exit_code" ]; then
        rc=$(cat "$run/exit_code"); log "guest command exit code: $rc"; return "$rc"
    fi
    log "guest did not report an exit code (crash or boot failure; try SOFTROCE_VM_VERBOSE=1)"
    return 125
}

SELFTEST=$(cat <<'EOF'
# Built-in smoke test: every server/client pair is two processes on rxe0.
ibv_devices
ibv_devinfo -d rxe0 | grep -E 'hca_id|transport|state|active_mtu|link_layer'
rdma link show
rc=0
pair() {  # pair ADDR TOOL ARGS... : start server, then client against ADDR; print the result line
    local addr=$1; shift
    timeout 120 "$@" > /tmp/server.log 2>&1 & local sp=$!; sleep 1
    timeout 120 "$@" "$addr" > /tmp/client.log 2>&1; local crc=$?
    wait $sp; local src=$?
    printf '%-62s client=%s server=%s  ' "$*" $crc $src
    grep -E '^ +[0-9]+ +[0-9]+ |Mbit/sec|usec/iter' /tmp/client.log | tr -s ' \t' ' ' | tail -n2 | tr '\n' ' '; echo
    if [ $crc != 0 ] || [ $src != 0 ]; then rc=1; tail -n5 /tmp/client.log /tmp/server.log; fi
}
# GID index 1 = the IPv4-mapped GID of 10.77.0.1 (index 0 is the IPv6 link-local one)
pair 127.0.0.1 ibv_rc_pingpong -d rxe0 -g 1 -n 1000 -s 4096
pair 127.0.0.1 ibv_ud_pingpong -d rxe0 -g 1 -n 1000 -s 512
pair 127.0.0.1 ib_write_bw  -d rxe0 -x 1 -s 65536 -n 2000 --report_gbits
pair 127.0.0.1 ib_read_bw   -d rxe0 -x 1 -s 65536 -n 2000 --report_gbits
pair 127.0.0.1 ib_send_bw   -d rxe0 -x 1 -s 65536 -n 2000 --report_gbits
pair 127.0.0.1 ib_atomic_bw -d rxe0 -x 1 -n 2000
pair 127.0.0.1 ib_write_lat -d rxe0 -x 1 -s 8 -n 2000
pair 127.0.0.1 ib_send_lat  -d rxe0 -x 1 -s 8 -n 2000
# rdma_cm: must use the rxe netdev's IP (127.0.0.1 is on lo, which has no RDMA device)
pair 10.77.0.1 ib_write_bw  -d rxe0 -x 1 -s 65536 -n 1000 --report_gbits -R
timeout 60 rping -s -a 10.77.0.1 -C 100 -S 1024 & sleep 1   # -S must match on both sides
timeout 60 rping -c -a 10.77.0.1 -C 100 -S 1024 || rc=1; wait $! || rc=1
echo "rping (rdma_cm, SEND + RDMA READ/WRITE): rc=$rc"
exit $rc
EOF
)

# ---------------------------------------------------------------------------
# quiesce's own steps: build on the host, run in the guest.
# ---------------------------------------------------------------------------
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Prints the executables of `cargo test --no-run ARGS`, one per line.
test_executables() {
    (cd "$REPO" && cargo test --no-run --message-format=json "$@" 2>/dev/null) \
        | grep '"kind":\["test"\]' | grep '"test":true' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4
}

run_tests() {
    "$REPO/scripts/build-deps.sh"
    log "building the RDMA test binaries and the quiesce binary"
    (cd "$REPO" && cargo build --quiet -p quiesce --bin quiesce -p quiesce-transports --bin quiesce-test-target) || die "cargo build failed"
    local bins
    bins=$(test_executables -p quiesce-transports --test rdma -p quiesce --test seed_rdma -p quiesce-batch --test sync_rdma) || die "cargo test --no-run failed"
    [ -n "$bins" ] || die "no test binaries were built"
    local script="set -u; rc=0"
    for b in $bins; do
        script+=$'\n'"echo \"=== \$(basename $b)\"; $b --include-ignored --test-threads=1 --show-output || rc=1"
        # The transport's own tests also run on the epoll driver (the CQ's
        # channel fd is then watched by epoll instead of an io_uring poll).
        case $(basename "$b") in rdma-*)
            script+=$'\n'"echo \"=== \$(basename $b) (epoll)\"; QUIESCE_DRIVER=epoll $b --include-ignored --test-threads=1 || rc=1";;
        esac
    done
    # The Python package over RDMA: the guest's Python 3.11 with the
    # packages of the venv scripts/test-python.sh made (the venv's own
    # interpreter may live outside the share).
    local site="$REPO/.venv/lib/python3.11/site-packages"
    if [ -d "$site/quiesce" ]; then
        script+=$'\n'"echo '=== python/tests/test_rdma.py'; PYTHONPATH=$site python3 -m pytest -q -p no:cacheprovider $REPO/python/tests/test_rdma.py || rc=1"
    elif [ -n "${CI:-}" ]; then
        # CI makes the venv first: a skip there would pass unseen.
        die "CI=true but no Python 3.11 venv with quiesce in .venv: the Python RDMA tests cannot run"
    else
        log "no Python 3.11 venv with quiesce in .venv (scripts/test-python.sh makes it): skipping the Python RDMA tests"
    fi
    script+=$'\n''exit $rc'
    setup_all
    OPT_SHARES=("$REPO"); OPT_CWD=$REPO
    OPT_ENV+=("RUST_BACKTRACE=1" "QUIESCE_BIN=$REPO/target/debug/quiesce")
    run_vm bash -c "$script"
}

run_bench() {
    "$REPO/scripts/build-deps.sh"
    log "building quiesce (release)"
    (cd "$REPO" && cargo build --quiet --release --bin quiesce) || die "cargo build failed"
    setup_all
    OPT_SHARES=("$REPO"); OPT_CWD=$REPO
    run_vm bash -c "$(cat "$REPO/scripts/rdma-bench.sh")" rdma-bench "$REPO/target/release/quiesce" "${BENCH_ARGS[@]}"
}

# ---------------------------------------------------------------------------
OPT_SHARES=(); OPT_ENV=(); OPT_RXE=1; OPT_SIW=0; OPT_CWD=$PWD; share_default=1
[ $# -gt 0 ] || { sed -n '2,35p' "$0"; exit 126; }
case "$1" in
    setup) setup_all; log "cache ready in $CACHE"; exit 0;;
    test) shift; run_tests; exit $?;;
    bench) shift; BENCH_ARGS=("$@"); run_bench; exit $?;;
    build-siw) setup_all; build_siw; exit 0;;
    selftest) shift; setup_all; OPT_SHARES=(); OPT_CWD=/; run_vm bash -c "$SELFTEST"; exit $?;;
    shell-cmd) shift; [ $# = 1 ] || die "shell-cmd takes one string"; set -- bash -c "$1";;
esac
while [ $# -gt 0 ]; do
    case "$1" in
        --share) OPT_SHARES+=("$2"); share_default=0; shift 2;;
        --no-share) share_default=0; shift;;
        --cwd) OPT_CWD=$2; shift 2;;
        --env) OPT_ENV+=("$2"); shift 2;;
        --no-rxe) OPT_RXE=0; shift;;
        --siw) OPT_SIW=1; shift;;
        --) shift; break;;
        *) break;;
    esac
done
[ $# -gt 0 ] || die "no command given"
if [ $share_default = 1 ]; then
    if [ -n "${SOFTROCE_VM_SHARE:-}" ]; then IFS=: read -r -a OPT_SHARES <<< "$SOFTROCE_VM_SHARE"
    else OPT_SHARES=("$PWD"); fi
fi
for v in RUST_BACKTRACE RUST_LOG RUST_TEST_THREADS; do [ -n "${!v:-}" ] && OPT_ENV+=("$v=${!v}"); done
setup_all
run_vm "$@"
