// Package nsrig builds a test host out of network namespaces: one "host"
// namespace that routes, filters (nftables) and tracks connections
// (conntrack), and N guest namespaces, each joined to the host by a veth
// pair. It is what Shunt's integration tests, demo and benchmarks run on,
// and it never touches the real host's network: every address, route, rule
// and conntrack entry lives in namespaces the rig created.
//
//	guest i (netns shunt-<rig>-g<i>)       host (netns shunt-<rig>-host)
//	  eth0 10.77.i.2/24  <---- veth ---->    sh-<rig>-<i> 10.77.i.1/24
//	  default via 10.77.i.1                  ip_forward=1, nft table inet shunt_rig
//	                                         (a filter; hostd adds inet shunt_hostd)
//
// Links, addresses, routes and namespaces are made with vishvananda/netlink
// and vishvananda/netns; only the nftables ruleset is loaded with nft(8).
// Create is idempotent (it first removes leftovers of a rig of the same
// name) and rolls back on failure; Destroy removes everything.
package nsrig
