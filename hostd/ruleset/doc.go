// Package ruleset watches the firewall's ruleset for changes, so that hostd
// can move connections off the rings when a rule that may drop their
// packets appears: the rings would carry a connection's bytes past a rule
// that drops its TCP packets.
//
// nftables (and iptables-nft, Debian's iptables since 11) report every
// committed transaction on the netlink group NFNLGRP_NFTABLES: one message
// per table, chain, rule, set, element or object added or deleted, then
// NEWGEN, the transaction's new generation. Watch reads that group and calls
// back once per transaction that touched a table other than the one it is
// told to ignore (hostd's own, hostd/mark), and once after lost events
// (ENOBUFS), since a change may be among them.
//
// iptables-legacy (x_tables) sends no events and is not watched: on such a
// host, a rule added later does not move connections off the rings
// (docs/SECURITY.md).
package ruleset
