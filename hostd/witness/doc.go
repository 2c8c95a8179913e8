// Package witness is hostd's eBPF witness of where connections come from: a
// TC program on each guest's host-side interface (veth or tap) records, for
// every TCP SYN entering from the guest, the interface it came in by. hostd
// then accepts a guest's claim to a connection only if the connection's SYN
// entered through that guest's own interface: proof of origin that no
// address the guest puts in its packets can fake. It is opt-in
// (ownership = "witness" or "both"); hostd's nftables marks (hostd/mark)
// are the default proof.
//
// The program is built in Go with cilium/ebpf's assembler (no clang needed)
// and attached with TCX. Its map is a plain hash keyed by the tuple as it
// is on the wire: IPv4 (a plain 20-byte header) and IPv6 (TCP right after
// the fixed header; a SYN behind extension headers is not recorded), an
// IPv4 address keyed in IPv4-mapped form, so Origin finds an IPv4 tuple
// whichever form a socket named it in (an IPv6 SYN with an IPv4-mapped
// address, which would take such a key, is not recorded). It is written so that no later
// packet can change what a claim will read:
//
//   - the first SYN of a tuple wins: a later SYN for it from another
//     interface is ignored and counted (Stats.Conflicts), one from the
//     same interface (a retransmission) only refreshes the record's time;
//   - the map is not an LRU, so a burst of SYNs cannot evict a record;
//     when it is full, new records are refused and counted (Stats.Full);
//   - one interface holds at most PerInterface records (an eighth of the
//     map by default), so one guest's SYN flood cannot fill the map for
//     the others (Stats.OverQuota);
//   - a sweeper deletes records older than the TTL (60 s by default; a
//     claim comes within seconds of its SYN).
//
// The trade-off: a guest that opens more than PerInterface connections per
// TTL gets TCP (not-owner) for the rest, and records are taken at TC
// ingress, before netfilter: a SYN the firewall drops is recorded too (a
// guest that guesses another's next tuple can make that claim fail, never
// succeed). hostd's marks have neither limit: they are stamped by
// netfilter itself, once, on the connection's conntrack entry.
package witness
