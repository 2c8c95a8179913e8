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
//
// A VM sees exactly what a process guest sees: the same region bytes (BAR2
// of the ivshmem device is the region file) and the same control protocol
// (over the port instead of a Unix socket), so guestlib runs unchanged
// above the mapping (docs/vm.md). doorbell is an ivshmem-doorbell server.
// hostd/virt registers libvirt domains that carry these devices.
package vhost
