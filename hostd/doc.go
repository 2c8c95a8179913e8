// Package hostd is the root of Shunt's host daemon. The daemon keeps TCP
// connection setup on the kernel stack and hands each established, allowed
// flow to the shared-memory data path; it is off the data path itself.
//
//	config    the HCL configuration and its validation
//	broker    the flow broker: verify, pair, allocate, revoke
//	ctrack    conntrack lookups and destroy events (netlink); cttest is a
//	          fake table for tests
//	witness   the eBPF witness of the interface a connection's SYN came in by
//	virt      libvirt: running Shunt domains become guests
//	server    the per-guest control channels (internal/proto sessions)
//	admin     the admin socket, its commands and the CLI's client
//	metrics   Prometheus metrics
//	agent     wires them together: what `hostd agent` runs
//	dist      what operators install: the systemd unit, an example config
//
// The command itself, agent and CLI, is cmd/hostd.
package hostd
