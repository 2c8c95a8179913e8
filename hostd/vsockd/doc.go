// Package vsockd is shunt-vsockd, the process that owns the QEMU VMs'
// vhost-user-vsock devices so that they outlive hostd (docs/vsock.md,
// "hostd restarts"), and hostd's client of it.
//
// QEMU 7.2 cannot reconnect a vhost-user-vsock device: whoever serves the
// device must live as long as the VM. shunt-vsockd serves each device
// (hostd/vsockhost's room, one per VM) and carries the guest's
// connections to the host's control port (1021) and stretch port (1022)
// to Unix sockets hostd listens on, <device socket>_<port>, exactly as a
// hybrid vsock (Firecracker's) does (vsock.ServeHybridGuest). hostd
// treats such a VM as a hybrid one: its control sessions and its flows'
// bridges stay in hostd. A hostd restart then ends the streams in flight
// (the guest's library reconnects its control channel, and its stretches
// go on over TCP by the adoption path, then return to the rings); the
// device and the VM's vsock stay.
//
// # Protocol (version 1)
//
// hostd connects to the daemon's socket (SOCK_SEQPACKET, mode 0600, the
// daemon's own user only: checked by SO_PEERCRED). Each message is one
// JSON object in one packet of at most MaxMsg bytes; unknown fields, an
// unknown op and a bad value end the connection. One controller at a
// time, the newest: a hello replaces the controller before it, which is
// told bye and closed (a hung hostd must not keep the devices).
//
//	hostd                                     shunt-vsockd
//	hello{version:N}                     -->  N: the newest hostd speaks
//	                                     <--  hello{version:min(N, its own), pid}
//	list{}                               -->
//	                                     <--  stat{stat} ... end{}
//	forget{id}                           -->  closes a device hostd no longer has
//	                                     <--  end{}
//	device{device:{guest,id,socket,cid}} -->  makes it, or keeps the one of that
//	                                          socket and cid (renamed in place)
//	                                     <--  device{id, kept, connected}
//	                                     <--  frontend{id, connected} (any time)
//	                                     <--  bye{error} (replaced; then closed)
//
// hostd lists first and forgets the devices whose socket and id it no
// longer names, then names its own. A device whose socket or CID
// changed is made afresh only while no QEMU is connected to it; else the
// daemon answers error and the device goes on (closing it would leave
// the VM without vsock until it restarts). Answers wait for one of a
// few slots the daemon's writer frees as it writes, so a list of every
// device streams at hostd's pace; events have a queue of their own, and
// a controller that lets it fill is dropped.
//
// Requests are answered in order, one at a time; frontend events come
// between answers whenever a device's QEMU connects or goes, in the order
// the device saw them, so the last word on a device is always true.
//
// What the daemon trusts: hostd (root, the socket's only user) to name
// the devices; nothing the guest writes (the device's bounds are the
// room's and vhost/vsock's, unchanged). What hostd trusts: the daemon's
// word on whether a device is served, and its counters; a reply that
// does not parse ends the connection, and hostd dials again.
package vsockd
