// Package virtq is the device side of a virtio split virtqueue over guest
// memory that a vhost-user front-end (QEMU) shared with us.
//
// Everything here reads memory the guest's driver writes, so all of it is
// untrusted input: every descriptor address and length is checked against
// the memory regions the front-end handed over (Memory), chains are bounded
// (no loops, no nested indirect tables, at most the queue size or the
// indirect table's entries), and the ring indices are checked against the
// queue size. A queue that breaks a rule is broken for good (Queue.Err): the
// driver harmed only its own device, as the virtio spec's DEVICE_NEEDS_RESET
// intends.
//
// References: virtio 1.2 (OASIS), §2.7 "Split Virtqueues" (descriptor
// table, available and used rings, their alignment and the driver's and
// device's requirements), §2.7.5.3 "Indirect Descriptors".
package virtq
