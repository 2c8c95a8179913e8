// Package agent wires hostd together: what `hostd agent` runs. It creates or
// adopts each trust group's region, learns guest addresses, and starts the
// broker, the libvirt watcher, the control channels, the conntrack watcher,
// the admin socket, the metrics listener and the firewall's ruleset watch;
// Shutdown (a graceful stop) moves every connection to TCP first, and Close
// stops them in the order that keeps flows running (the broker first, so
// a killed or closing hostd moves nothing).
//
// Files: agent.go (the Agent, Close, Reload, the conntrack watcher),
// start.go (Start and its steps: regions, guests, libvirt, adoption,
// servers), handle.go (the admin commands), libvirt.go (libvirt domains as
// guests), addrs_*.go (guest addresses and the witness from the kernel),
// marks.go (hostd's nftables marks of each guest's connections, and the
// ownership metrics).
package agent
