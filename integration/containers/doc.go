// Package containers tests Shunt with a real container runtime: Debian's
// podman with its CNI backend and containernetworking-plugins, the CNI
// plugin shunt chained after ptp, and the CDI device shunt.net/guest
// (docs/containers.md). Podman runs in a network namespace of the test's
// own (its veths' host ends, routes and hostd's nftables table live there),
// with a fixed storage under /var/tmp/shunt-podman-test, in which the test
// image (a small rootfs of this host's binaries: busybox, iperf3, redis)
// is imported once and kept.
package containers
