// Package nsrig builds a test host out of network namespaces: one "host"
// namespace that routes, filters (nftables) and tracks connections
// (conntrack), and N guest namespaces, each joined to the host by a veth
// pair. It is what Shunt's integration tests, demo and benchmarks run on,
// and it never touches the real host's network: every address, route, rule
// and conntrack entry lives in namespaces the rig created.
//
//	guest i (netns shunt-<rig>-g<i>)       host (netns shunt-<rig>-host)
//	  eth0 10.77.i.2/24  <---- veth ---->    sh-<rig>-<i> 10.77.i.1/24
//	       fd00:77:i::2/64                                fd00:77:i::1/64
//	  default via 10.77.i.1                  ip_forward=1, ipv6 forwarding=1,
//	  default via fd00:77:i::1               nft table inet shunt_rig
//	                                         (a filter; hostd adds inet shunt_hostd)
//
// Every guest is dual-stack: IPv6 addresses are unique local ones
// (fd00:77::/32, RFC 4193; i in hex) put on without duplicate address
// detection (nodad, and accept_dad=0 for the link-local ones), so they are
// usable at once. The firewall's table is of family inet: its rules see
// both.
//
// Links, addresses, routes and namespaces are made with vishvananda/netlink
// and vishvananda/netns; only the nftables ruleset is loaded with nft(8).
// Create is idempotent (it first removes leftovers of a rig of the same
// name) and rolls back on failure; Destroy removes everything.
//
// Fabric (fabric.go) is two such hosts, each with its own conntrack,
// nftables and guests, joined by a veth between the host namespaces: the
// rig of the cross-host tests (docs/crosshost.md).
package nsrig
