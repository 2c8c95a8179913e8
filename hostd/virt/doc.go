// Package virt is hostd's libvirt integration: it follows the domains of a
// libvirtd and registers each running Shunt domain as a guest, so operators
// describe VMs once, in the domain XML, instead of in hostd.hcl too.
//
// A Shunt domain is one with a virtio-serial channel named org.shunt.ctl
// (QEMU connects to hostd's socket at the channel's path) and either a
// <shmem> device backed by a trust group's region, or (a group with pair
// regions for VMs) no such device and the group named in its metadata.
// Shunt metadata in the domain (see Metadata) gives its guest id, trust
// group and addresses:
//
//	<metadata>
//	  <shunt:guest xmlns:shunt="https://github.com/shuntnet/shunt/xmlns/guest/1">
//	    <shunt:id>101</shunt:id>
//	    <shunt:group>tenant-a</shunt:group>
//	    <shunt:address>10.0.1.2</shunt:address>
//	  </shunt:guest>
//	</metadata>
//
// The Watcher is level-triggered: every lifecycle event, every reconnect
// after libvirtd restarts, and a slow tick all lead to the same step, which
// lists the active domains and reconciles the registered set with them. So a
// domain that started or stopped while libvirtd (or hostd) was away is
// picked up the same way as one seen live. While libvirtd is down, the
// registered guests stay: their QEMUs keep running without it.
//
// A Plugger hot-plugs hostd's pair regions into running domains as <shmem>
// devices (/dev/shm/PairShmem(a, b)) and takes them out again, over a
// connection of its own.
package virt
