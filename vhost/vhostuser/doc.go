// Package vhostuser is the back-end side of the vhost-user protocol (QEMU
// docs/interop/vhost-user.rst): a front-end (QEMU's vhost-user-*-pci
// devices) connects on a Unix socket, negotiates features, hands over the
// guest's memory as file descriptors (SET_MEM_TABLE) and describes each
// virtqueue (SET_VRING_NUM, _ADDR, _BASE, _KICK, _CALL, _ERR, _ENABLE); the
// back-end then serves the virtqueues itself, in guest memory, and the
// guest's driver never leaves the VM.
//
// A Backend (the device: vhost/vsock) gets the queues (vhost/virtq) through
// a Session, under its own lock, which guards the rings and the memory
// too: a new memory table or ring address never changes under a device
// that is using the old one.
//
// The front-end (QEMU) is trusted, as it is in the kernel's vhost: it
// already holds all guest memory. Still, its messages are checked
// (sizes, indices, region bounds against each fd's size), so that a
// confused or hostile peer on the socket gets an error, not a crash, and
// the back-end never maps beyond the files it was handed.
package vhostuser
