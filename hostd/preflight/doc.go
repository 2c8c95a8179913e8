// Package preflight checks that hostd can start with a configuration on
// this host, before it does: `hostd check -config FILE`, which the systemd
// unit also runs as ExecStartPre.
//
// Each check is a small function of the configuration and a set of host
// Probes; it returns findings, each with a Severity, what it found and the
// command or edit that fixes it:
//
//	config      the file parses and validates (hostd/config)
//	privileges  the check runs as root, as hostd does
//	conntrack   ctnetlink answers, net.netfilter.nf_conntrack_events is on, and
//	            nf_conntrack_acct and nf_conntrack_timestamp are readable (watch_ruleset: hostd sets them)
//	nftables    nft works, if a guest's ct_mark needs a firewall rule
//	witness     eBPF programs load and TCX attaches, if witness = true
//	interfaces  every guest interface exists
//	space       the region files' file systems have room for all regions
//	regions     region paths: directories, symlinks, owner, mode, geometry
//	sockets     admin and control socket paths: length, directories, no hostd answering
//	libvirt     libvirtd answers, if there is a libvirt block
//	metrics     metrics_address can be bound
//
// A Problem means hostd would not start, or would start unsafe; a Warning
// means it starts but something will not work as configured. The Probes
// are function fields, so that tests can fake each host failure without
// root; Host returns the real ones.
package preflight
