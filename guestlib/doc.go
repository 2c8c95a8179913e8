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
//	SHUNT_CONTROL  control socket (default /run/shunt/guest.sock)
//	SHUNT_REGION   region file to map instead of the one hostd names
//	               (a VM's ivshmem BAR: /sys/bus/pci/devices/.../resource2)
//	SHUNT_WAIT     adaptive (default), spin or block
//	SHUNT_DISABLE  1: always plain TCP
//
// If hostd is unreachable, everything works on plain TCP and Path says
// "no-hostd". If hostd restarts, connections keep their paths and move
// their bytes; the library reconnects in the background, re-announces its
// listeners, REATTACHes the connections on rings and offers the ones on
// TCP again.
package guestlib
