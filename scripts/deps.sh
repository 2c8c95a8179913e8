#!/usr/bin/env bash
# deps.sh: the one list of what Shunt's demo and tests need from the
# distribution, and the one place that installs it. `make demo`, `make
# test` and .ci/run call it.
#
#   scripts/deps.sh demo|test [--check]
#
# As root on Debian or Ubuntu it installs what is missing with apt-get.
# Elsewhere (or with --check) it prints the exact command to run; for
# `demo` a missing package is then an error, for `test` only a warning
# (the tests that need it skip and say why; under CI=true they fail).
set -euo pipefail

# What the quick start needs: gcc and make build the preload library, the
# namespace rig needs iproute2 and nftables, conntrack is the kernel's and
# is checked by hostd itself (hostd check).
demo_pkgs=(gcc libc6-dev make iproute2 nftables procps kmod)

# What the whole test suite needs on top: conntrack(8) and iptables for the
# rig tests, the unmodified programs (and the real servers and their
# clients of integration/servers_*_test.go), Open MPI, QEMU and a kernel for
# the VM tests, libvirt for the libvirt test, ruby for the Vagrantfile
# check, systemd for checking the unit; podman with its CNI plugins and
# runc for the container tests (integration/containers: crun refuses the
# hybrid cgroup hierarchies some CI hosts have); rdma-core's libibverbs
# (headers for the relay's verbs shim, built with -tags rdma), its rxe
# provider, ibv_rc_pingpong and perftest for the RDMA link's test
# (integration/rdma: SoftRoCE inside two VMs).
test_pkgs=("${demo_pkgs[@]}" iptables conntrack
	sockperf iperf3 redis-server redis-tools openmpi-bin libopenmpi-dev
	nginx openssh-server openssh-client socat apache2-utils curl
	apache2 memcached libmemcached-tools python3 haproxy postgresql postgresql-contrib nodejs
	qemu-system-x86 linux-image-amd64 busybox-static xz-utils
	libvirt-daemon-system libvirt-clients ruby systemd
	podman containernetworking-plugins runc
	libibverbs-dev ibverbs-providers ibverbs-utils perftest)

usage() { echo "usage: $0 demo|test [--check]" >&2; exit 2; }

[ $# -ge 1 ] || usage
case "$1" in
demo) pkgs=("${demo_pkgs[@]}") ;;
test) pkgs=("${test_pkgs[@]}") ;;
*) usage ;;
esac
check_only=false
[ "${2:-}" = "--check" ] && check_only=true

if ! command -v go >/dev/null; then
	echo "deps: go is not on PATH: install Go 1.26 from https://go.dev/dl/ (or add /usr/local/go/bin to PATH)" >&2
	exit 1
fi

if ! command -v dpkg-query >/dev/null; then
	echo "deps: not a Debian-family system; install the equivalents of: ${pkgs[*]}" >&2
	[ "$1" = demo ] && exit 1
	exit 0
fi

missing=()
for p in "${pkgs[@]}"; do
	if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
		missing+=("$p")
	fi
done
# conntrack for network namespaces and ctnetlink, where they are modules
# (built in on some kernels: then modprobe fails and that is fine).
if [ "$(id -u)" = 0 ]; then
	modprobe nf_conntrack 2>/dev/null || true
	modprobe nf_conntrack_netlink 2>/dev/null || true
fi
[ ${#missing[@]} -eq 0 ] && exit 0

cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if ! $check_only && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
	echo "deps: installing for '$1': ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q
	apt-get install -y -q --no-install-recommends "${missing[@]}"
	modprobe nf_conntrack 2>/dev/null || true
	exit 0
fi

echo "deps: missing for '$1': ${missing[*]}" >&2
echo "deps: run: sudo $cmd" >&2
[ "$1" = demo ] && exit 1
exit 0
