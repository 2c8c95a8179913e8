// Package vhost is the VM device side of Shunt: how a trust group's region
// and a guest's control channel reach a virtual machine.
//
//	ivshmem  the region as an ivshmem-plain PCI device: QEMU arguments and
//	         libvirt <shmem> XML from one description, and the guest-side
//	         lookup of the device's memory BAR in sysfs
//	vserial  the control channel as a virtio-serial port: QEMU arguments
//	         and libvirt <channel> XML, and the guest-side lookup of the
//	         port by name
//	qmp      a QMP client: hot-plug and unplug of an ivshmem-plain device
//	         (hostd plugs VM pair regions with it; the VM tests migrate)
//	virtq    split virtqueues in guest memory a vhost-user front-end shared,
//	         every descriptor checked as untrusted input
//	vhostuser the vhost-user back-end protocol (QEMU's vhost-user-*-pci)
//	vsock    a vhost-user-vsock device: the guest's AF_VSOCK streams to
//	         the host as net.Conns, and the hybrid vsock Unix socket face
//	         of Firecracker and Cloud Hypervisor (docs/vsock.md)
//
// A VM sees exactly what a process guest sees: the same region bytes (BAR2
// of the ivshmem device is the region file) and the same control protocol
// (over the port instead of a Unix socket), so guestlib runs unchanged
// above the mapping (docs/vm.md). doorbell is an ivshmem-doorbell server.
// hostd/virt registers libvirt domains that carry these devices.
package vhost
