// Package vsockhost is hostd's room for the vhost-user-vsock devices of
// VMs without ivshmem (docs/vsock.md): one vsock.Device per configured VM,
// each served on the Unix socket its QEMU connects to, started and
// stopped with hostd. A device belongs to exactly one guest: the room
// hands it out only by that guest's id, so whatever hostd later attaches
// to a VM's vsock connections (the flows' bridges) is that guest's alone.
package vsockhost
