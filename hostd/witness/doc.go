// Package witness is hostd's eBPF witness of where connections come from: a
// TC program on each guest's host-side interface (veth or tap) records, for
// every TCP SYN entering from the guest, the interface it came in by. hostd
// then accepts a guest's claim to a connection only if the connection's SYN
// entered through that guest's own interface: proof of origin that no
// address the guest puts in its packets can fake.
//
// The program is built in Go with cilium/ebpf's assembler (no clang needed)
// and attached with TCX; the map is an LRU hash keyed by the IPv4 tuple as
// it is on the wire.
package witness
