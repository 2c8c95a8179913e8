// Package vm boots QEMU (TCG) guests for Shunt's VM tests: it caches an
// uncompressed kernel from the host's Debian kernel, builds an initramfs
// from busybox-static, the virtio modules and a static guest program, and
// starts QEMU with a tap NIC in the rig's host namespace (so the host's
// conntrack and nftables see VM-to-VM traffic), the trust group's region as
// an ivshmem device and the control port (vhost). Stop kills QEMU; every
// process and file is cleaned up, on failure too.
package vm
