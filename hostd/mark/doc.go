// Package mark is hostd's proof of where a connection came from: it keeps
// its own nftables table, which stamps every new connection that enters
// the host by a guest's interface with that guest's mark id, in a field of
// the conntrack mark that hostd owns (ct_mark_mask, by default the high 16
// bits). The broker then accepts a guest's claim to a connection only if
// the connection's conntrack mark carries the guest's id: proof of the
// ingress interface that no address the guest puts in its packets can fake,
// without any rule of the operator's.
//
//	table inet shunt_hostd                  (one per network namespace)
//	  chain forward { type filter hook forward priority 100; }
//	  chain input   { type filter hook input priority 100; }
//	    iifname "vnet0" ct state new ct mark & 0xffff0000 == 0
//	        counter ct mark set ct mark & 0x0000ffff ^ 0x00050000   # guest vm1, id 5
//	    iifname "vnet3" ...                                          # guest vm2, id 9
//
// The chains run after the usual filter chains (priority 100), so an
// operator's rule that sets the whole mark runs first, and hostd's masked
// write keeps the operator's bits. A connection is stamped once, by its
// first packet (the mark field must still be zero): a later SYN for the
// same tuple from another interface does not change it.
//
// The mark id belongs to the guest, not to the interface: a guest keeps its
// id when it moves to another interface (a VM restarted or migrated gets a
// new tap), and a guest that gets an interface name another guest had gets
// its own id. The id is the guest's id when that fits in the field and is
// free, else the id it had before under the same name, else the next free
// one counting down from the top of the field, so that ids are reused as
// late as possible.
//
// Why the mark and not conntrack labels: every conntrack tool shows the
// mark (conntrack -L: mark=...), operators already read it, and a masked
// write keeps the operator's bits exactly, while nftables can only set
// label bits, never clear them; label bits are also taken by OVS/OVN on
// many hosts. The cost is that an operator rule that overwrites the whole
// mark after hostd's (CONNMARK --save-mark without a mask, ct mark set
// meta mark) erases the id: those connections then stay on TCP
// (not-owner), never the other way round.
//
// The table is replaced whole in one netlink batch on every change, so
// packets see either the old rules or the new ones. A keeper checks it
// every few seconds and puts it back if someone removed it (a firewall
// reload that flushes the ruleset). Close removes the table.
package mark
