// Package ctrack is hostd's view of the kernel's connection tracking: look up
// the entry of a TCP connection by the tuple either end sees, and learn when
// entries are destroyed. It talks ctnetlink (github.com/ti-mo/conntrack), in
// hostd's network namespace or in a configured one, with one netlink
// connection for queries and another for events, as ctnetlink requires.
package ctrack
