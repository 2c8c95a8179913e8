// Package hostd is the root of Shunt's host daemon. The daemon keeps TCP
// connection setup on the kernel stack and hands each established, allowed
// flow to the shared-memory data path; it is off the data path itself.
//
//	config    the HCL configuration and its validation
//	broker    the flow broker: verify, pair, allocate, revoke
//	ctrack    conntrack lookups and destroy events (netlink)
//	server    the per-guest control channels
//	admin     the admin socket and the CLI's client
//	metrics   Prometheus metrics
//	agent     wires them together: what `hostd agent` runs
package hostd
