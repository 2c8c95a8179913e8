// Package guestlib is Shunt's guest library for Go programs: Dial and Listen
// return ordinary net.Conn and net.Listener values whose bytes move through
// shared-memory rings when hostd grants a fast path, and through the kernel's
// TCP otherwise. Programs need no other change.
//
// Every connection is made with the kernel's connect()/accept(), through the
// host's firewall and conntrack. Around it, guestlib talks to hostd over the
// guest's control channel: INTENT before connect, OPEN after, and hostd
// answers both ends with the same verdict, READY (the rings) or TCP (a
// reason). Conn.Path tells which, and why. The TCP connection stays open as
// the lease; when hostd revokes the fast path (the conntrack entry went, the
// policy changed, the peer died), pending and later calls fail with
// ECONNRESET, as a TCP reset would.
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
// "no-hostd". If hostd restarts, live flows keep moving data; the library
// reconnects and re-announces its listeners and flows.
package guestlib
