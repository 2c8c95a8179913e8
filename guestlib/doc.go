// Package guestlib is Shunt's guest library for Go programs: Dial and Listen
// return ordinary net.Conn and net.Listener values whose bytes move through
// shared-memory rings when hostd grants a fast path, and through the kernel's
// TCP otherwise. Programs need no other change.
//
// Every connection is made with the kernel's connect()/accept(), through the
// host's firewall and conntrack, and starts on TCP at once: Dial and Accept
// wait for nothing but the kernel. In the background guestlib offers the
// connection to hostd over the guest's control channel (OPEN, with a
// request id that names the connection for its whole life). hostd answers
// READY (rings) or TCP (a reason), and later DOWN (back to TCP) and READY
// again, as often as policy, the firewall or hostd's own state change.
// Each direction moves at an exact stream offset that the writer announces
// in the ring, so no byte is lost, duplicated or reordered, and the
// application sees no error from a switch (docs/DESIGN.md, "Flow
// lifecycle: path switching"). Whether the connection lives is the
// kernel's business: a peer that dies or resets is reported as the kernel
// reports it. Conn.Path tells the path now and why, Conn.Stats the bytes
// on each path and the switches.
//
// Configuration, by Options or environment:
//
//	SHUNT_CONTROL  control socket or port (default /run/shunt/guest.sock,
//	               or in a VM a port found on its own, see below), or
//	               "vsock": the host's vsock port 1021
//	SHUNT_REGION   region file to map instead of the one hostd names
//	               (default in a VM: its ivshmem BAR)
//	SHUNT_WAIT     adaptive (default), spin or block
//	SHUNT_DISABLE  1: always plain TCP
//
// Inside a VM a program needs no settings. With neither Options.Control
// nor SHUNT_CONTROL, and no /run/shunt/guest.sock, the client takes the
// first of the VM's virtio-serial control ports (org.shunt.ctl[.N]) that
// no other process holds, maps the ivshmem device's BAR as the region and
// wakes its peers through hostd (KICK), by the rules the C library follows
// too (docs/vm.md, "Discovery"; vhost/vserial, vhost/ivshmem). When other
// processes hold every port, connections stay on TCP with the reason
// "control-limit", and the client takes a port once one is free. A VM
// with no port but vsock (Firecracker has no virtio-serial) gets its
// control channel over vsock, and its flows over vsock stretches
// (docs/vsock.md).
//
// If hostd is unreachable, everything works on plain TCP and Path says
// "no-hostd". If hostd restarts, connections keep their paths and move
// their bytes; the library reconnects in the background, re-announces its
// listeners, REATTACHes the connections on rings and offers the ones on
// TCP again.
package guestlib
