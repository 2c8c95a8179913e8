package preflight

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"

	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/vhost/qmp"
)

func checkPrivileges(_ context.Context, e *env) {
	if uid := e.p.Euid(); uid != 0 {
		e.warn(fmt.Sprintf("running as uid %d, but hostd runs as root: files are checked against uid %d, and the kernel checks may fail for want of privileges", uid, uid),
			"run it as root: sudo hostd check -config "+e.cfg.Path)
		return
	}
	e.ok("running as root, as hostd does")
}

// inNetns is " in netns PATH", or "" for hostd's own namespace.
func (e *env) inNetns() string {
	if ns := e.cfg.ConntrackNetns; ns != "" {
		return " in netns " + ns
	}
	return ""
}

const (
	eventsSysctl = "net.netfilter.nf_conntrack_events"
	acctSysctl   = "net.netfilter.nf_conntrack_acct"
	tstampSysctl = "net.netfilter.nf_conntrack_timestamp"
)

// checkConntrack: hostd looks flows up over ctnetlink and learns of
// deleted entries from its destroy events.
func checkConntrack(_ context.Context, e *env) {
	ns, where := e.cfg.ConntrackNetns, e.inNetns()
	if ns != "" {
		if _, err := os.Stat(ns); err != nil {
			e.nsMissing = true
			e.problem(fmt.Sprintf("conntrack_netns %s: %v", ns, err), "create the namespace (ip netns add NAME) or fix conntrack_netns")
			return
		}
	}
	if err := e.p.Conntrack(ns); err != nil {
		fix := "modprobe nf_conntrack nf_conntrack_netlink"
		if errors.Is(err, os.ErrPermission) {
			fix = "run as root: ctnetlink needs CAP_NET_ADMIN"
		}
		e.problem("conntrack netlink does not answer"+where+": "+err.Error(), fix)
	} else {
		e.ok("ctnetlink answers%s", where)
	}
	v, err := e.p.Sysctl(ns, eventsSysctl)
	set := "sysctl -w " + eventsSysctl + "=1"
	if ns != "" {
		set = "nsenter --net=" + ns + " " + set
	} else {
		set += "; to keep it: echo " + eventsSysctl + "=1 > /etc/sysctl.d/90-shunt.conf"
	}
	switch {
	case errors.Is(err, os.ErrNotExist):
		e.problem(eventsSysctl+" does not exist"+where+": conntrack is not loaded, or the kernel lacks CONFIG_NF_CONNTRACK_EVENTS",
			"modprobe nf_conntrack nf_conntrack_netlink")
	case err != nil:
		e.problem("read "+eventsSysctl+where+": "+err.Error(), "run as root")
	case v == "1" || v == "2":
		e.ok("%s = %s%s: destroy events reach hostd", eventsSysctl, v, where)
	default:
		e.problem(fmt.Sprintf("%s = %s%s: hostd gets no destroy events, so deleting a connection's conntrack entry would not move it to TCP", eventsSysctl, v, where), set)
	}
	if e.cfg.WatchRuleset {
		checkAcct(e, ns, where)
	}
}

// checkAcct: the proof of passage (docs/SECURITY.md) needs no counters,
// but hostd turns accounting (lease counters in `hostd flows`) and
// timestamps on at start: with timestamps, a firewall epoch's clear
// spares the proof of connections made since the change.
func checkAcct(e *env, ns, where string) {
	v, err := e.p.Sysctl(ns, acctSysctl)
	switch {
	case err != nil:
		e.warn("read "+acctSysctl+where+": "+err.Error()+": `hostd flows` shows no lease counters", "modprobe nf_conntrack, and run hostd as root (it sets "+acctSysctl+"=1 at start)")
	case v == "1":
		e.ok("%s = 1%s: `hostd flows` shows each lease's packets", acctSysctl, where)
	default:
		e.ok("%s = %s%s: hostd sets it to 1 at start (watch_ruleset); connections made before keep no counters", acctSysctl, v, where)
	}
	v, err = e.p.Sysctl(ns, tstampSysctl)
	switch {
	case err != nil:
		e.warn("read "+tstampSysctl+where+": "+err.Error()+": a connection made during a firewall change may wait on TCP for its next packets", "modprobe nf_conntrack, and run hostd as root (it sets "+tstampSysctl+"=1 at start)")
	case v == "1":
		e.ok("%s = 1%s: a firewall change keeps the proof of passage of connections made since", tstampSysctl, where)
	default:
		e.ok("%s = %s%s: hostd sets it to 1 at start (watch_ruleset)", tstampSysctl, v, where)
	}
	e.ok("proof of passage: hostd's proof chains (table inet %s, priority %d on postrouting and input) show each connection's packets past the firewall; a connection without them both ways for proof_max_age (%s) moves to TCP", mark.Table, mark.ProofPriority, e.cfg.ProofMaxAge)
}

// checkNftables: hostd marks each guest's new connections with its own
// nftables table (hostd/mark), over netlink, so that a guest's claim to a
// connection holds only if the connection came in by its interface. A
// guest's ct_mark, if it has one, is still set by the operator's rule.
func checkNftables(ctx context.Context, e *env) {
	if e.nsMissing {
		return // checkConntrack reported it
	}
	var marked, bare []string
	for _, g := range e.cfg.Guests {
		if g.Interface != "" {
			marked = append(marked, g.Name+" ("+g.Interface+")")
		} else {
			bare = append(bare, g.Name)
		}
	}
	alone := ""
	if len(bare) > 0 {
		alone = "; " + strings.Join(bare, ", ") + " " + map[bool]string{true: "has", false: "have"}[len(bare) == 1] +
			" no interface, so its claims rest on its addresses alone"
	}
	switch {
	case e.cfg.Ownership == config.OwnershipAddresses:
		e.warn("ownership = \"addresses\": hostd does not prove where a connection came from, and a guest's claim rests on its source address alone",
			"remove the ownership line (the default, \"mark\", needs only nftables, which hostd drives itself)")
	case !e.cfg.Marks():
		e.ok("ownership = %q: hostd does not mark connections; the eBPF witness proves their origin", e.cfg.Ownership)
	default:
		n, err := e.p.Nftables(e.cfg.ConntrackNetns)
		if err != nil {
			fix := "modprobe nf_tables nft_ct"
			if errors.Is(err, os.ErrPermission) {
				fix = "run as root: nftables needs CAP_NET_ADMIN"
			}
			e.problem(fmt.Sprintf("hostd cannot install its nftables table inet %s%s: %v: it would not start", mark.Table, e.inNetns(), err),
				fix+`; or set ownership = "witness" (eBPF) or "addresses" (no proof of origin)`)
			break
		}
		running := ""
		if n >= 0 {
			running = fmt.Sprintf(" (it is installed, with %d guest rules: a hostd runs here)", n)
		}
		what := "no guest has an interface to mark"
		if len(marked) > 0 {
			what = "it marks the new connections of " + strings.Join(marked, ", ")
		}
		e.ok("hostd can install its nftables table inet %s%s%s: %s, in ct mark bits %#08x%s", mark.Table, e.inNetns(), running, what, e.cfg.CTMarkMask, alone)
	}
	checkCTMarks(ctx, e)
}

// checkCTMarks: a guest's ct_mark is set by the operator's firewall rule,
// usually an nftables one; hostd checks it next to its own marks.
func checkCTMarks(ctx context.Context, e *env) {
	var marked []string
	example := ""
	for _, g := range e.cfg.Guests {
		if g.CTMark == 0 {
			continue
		}
		marked = append(marked, fmt.Sprintf("%s (ct_mark %d)", g.Name, g.CTMark))
		if example == "" {
			iif := or(g.Interface, "TAP")
			example = fmt.Sprintf(`nft 'add table inet shunt; add chain inet shunt pre { type filter hook prerouting priority 0; }; add rule inet shunt pre ct state new iifname "%s" ct mark set %d'`, iif, g.CTMark)
		}
	}
	if len(marked) == 0 {
		return
	}
	needs := "guests " + strings.Join(marked, ", ") + " need a firewall rule that sets their ct_mark; without it their connections stay on TCP"
	if len(marked) == 1 {
		needs = "guest " + marked[0] + " needs a firewall rule that sets its ct_mark; without it its connections stay on TCP"
	}
	path, err := e.p.LookPath("nft")
	if err != nil {
		e.warn(needs+", and nft is not installed", "apt-get install nftables, then add the rule, e.g. "+example)
		return
	}
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	out, err := e.p.Command(ctx, path, "list", "ruleset")
	if err != nil {
		fix := "make `nft list ruleset` work"
		if strings.Contains(string(out), "not permitted") {
			fix = "run as root: nft needs CAP_NET_ADMIN"
		}
		e.warn(fmt.Sprintf("%s, and `nft list ruleset` fails: %v: %s", needs, err, oneLine(string(out))), fix)
		return
	}
	if !strings.Contains(string(out), "ct mark set") && !strings.Contains(string(out), "CONNMARK") {
		e.warn(needs+", and no nftables rule sets a ct mark", "add the rule, e.g. "+example+" (ignore this if legacy iptables sets the marks); or drop ct_mark: hostd marks each guest's connections itself")
		return
	}
	e.ok("a rule sets a ct mark (for %s)", strings.Join(marked, ", "))
}

func checkWitness(_ context.Context, e *env) {
	if !e.cfg.Witness {
		e.ok("ownership = %q: the eBPF witness is off, eBPF not needed", e.cfg.Ownership)
		return
	}
	if err := e.p.Witness(); err != nil {
		e.problem("the eBPF witness cannot load: "+err.Error(),
			`run as root (CAP_BPF, CAP_NET_ADMIN) on Linux 6.6 or later for TCX; or set ownership = "mark" (the default: nftables only)`)
		return
	}
	e.ok("the eBPF witness loads, and TCX attaches programs")
}

// checkInterfaces: hostd reads the routes of each guest's interface at
// start, and fails if one is missing.
func checkInterfaces(_ context.Context, e *env) {
	if e.nsMissing {
		return // checkConntrack reported it
	}
	var found []string
	bad := false
	for _, g := range e.cfg.Guests {
		if g.Interface == "" {
			continue
		}
		if err := e.p.Interface(e.cfg.ConntrackNetns, g.Interface); err != nil {
			bad = true
			e.problem(fmt.Sprintf("guest %s: interface %s%s: %v: hostd learns the guest's addresses from it at start, and would fail", g.Name, g.Interface, e.inNetns(), err),
				"create it before hostd starts (start the VM or container first), or give the guest addresses instead of an interface")
			continue
		}
		found = append(found, g.Interface)
	}
	switch {
	case len(found) == 1:
		e.ok("interface %s exists%s", found[0], e.inNetns())
	case len(found) > 1:
		e.ok("interfaces %s exist%s", strings.Join(found, ", "), e.inNetns())
	case !bad:
		e.ok("no guest names an interface")
	}
}

func checkLibvirt(ctx context.Context, e *env) {
	lv := e.cfg.Libvirt
	if lv == nil {
		e.ok("no libvirt block: libvirtd not needed")
		return
	}
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	if err := e.p.Libvirt(ctx, lv.Socket, lv.URI); err != nil {
		fix := "start it: systemctl start libvirtd (virtqemud.socket where libvirt is modular), or fix libvirt { socket, uri }"
		if errors.Is(err, os.ErrPermission) {
			fix = "run as root: libvirtd's read-write socket is root's"
		}
		e.warn(fmt.Sprintf("%v (hostd starts anyway and keeps trying, but registers no VMs until libvirtd answers)", err), fix)
		return
	}
	e.ok("libvirtd answers at %s and opens %s", lv.Socket, lv.URI)
	checkLibvirtPairs(e)
}

// checkLibvirtPairs says how the libvirt domains of pair-region groups
// get their regions, and warns where their QEMUs, if unprivileged, could
// not open them: hostd creates each pair's file in /dev/shm, root's, for
// the group's region_group only.
func checkLibvirtPairs(e *env) {
	for _, g := range e.cfg.Groups {
		if g.VMRegions != config.VMRegionsPair {
			continue
		}
		if g.RegionGroup == "" {
			e.warn(fmt.Sprintf("trust group %s has pair regions for VMs, but no region_group: hostd creates its libvirt domains' pair regions (/dev/shm/shunt-pair-A-B-pID) root's, mode 0600, which a QEMU that libvirt runs unprivileged (Debian: libvirt-qemu:kvm) cannot open: their plugs fail and their connections stay on TCP", g.Name),
				"region_group = \"kvm\" in the trust group, unless libvirt runs QEMU as root")
			continue
		}
		e.ok("trust group %s: libvirt domains with no <shmem> that name it in their metadata get a region per pair, hot-plugged as /dev/shm/shunt-pair-A-B-pID (root:%s 0660; the domain needs <features><acpi/> and the pc machine)", g.Name, g.RegionGroup)
	}
}

// checkQMP looks at the QMP socket of every VM guest of a pair-region
// group: hostd plugs the pair regions through it when a pair's first flow
// needs one. A QEMU that is not running yet is only a warning (its flows
// stay on TCP until it is); one that does not answer QMP is too.
func checkQMP(ctx context.Context, e *env) {
	n := 0
	for _, g := range e.cfg.Guests {
		if g.QMP == "" {
			continue
		}
		n++
		st, err := os.Stat(g.QMP)
		switch {
		case err != nil:
			e.warn(fmt.Sprintf("guest %s: qmp %s: %v (its VM is not running yet? its pair regions are plugged once it is)", g.Name, g.QMP, err),
				"start the VM with -qmp unix:"+g.QMP+",server=on,wait=off, or fix qmp")
			continue
		case st.Mode()&os.ModeSocket == 0:
			e.problem(fmt.Sprintf("guest %s: qmp %s is not a socket", g.Name, g.QMP), "point qmp at the QMP socket of the guest's QEMU")
			continue
		}
		dctx, cancel := context.WithTimeout(ctx, probeTimeout)
		q, err := qmp.Dial(dctx, g.QMP)
		cancel()
		if err != nil {
			e.warn(fmt.Sprintf("guest %s: qmp %s does not answer: %v (another QMP client holding it delays plugs)", g.Name, g.QMP, err),
				"check that the QEMU runs and that nothing else keeps its QMP socket open")
			continue
		}
		q.Close()
		e.ok("guest %s: QEMU answers QMP at %s", g.Name, g.QMP)
	}
	if n == 0 {
		e.ok("no guest with qmp: no pair regions to plug into VMs")
	}
}

func checkMetrics(_ context.Context, e *env) {
	addr := e.cfg.MetricsAddress
	if addr == "" {
		e.ok(`metrics_address = "": no metrics listener`)
		return
	}
	if path := config.MetricsUnix(addr); path != "" {
		// hostd replaces a stale socket there; the directories are
		// checked as for the other sockets.
		if st, err := os.Lstat(path); err == nil && st.Mode()&os.ModeSocket == 0 {
			e.problem(fmt.Sprintf("metrics_address %s: %s exists and is not a socket", addr, path), "remove it, or choose another path")
			return
		}
		e.ok("metrics_address %s: a Unix socket of mode 0600, for root only", addr)
		return
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		e.problem(fmt.Sprintf("metrics_address %q: %v", addr, err), `write host:port, e.g. "127.0.0.1:9469", or "" to disable metrics`)
		return
	}
	if err := e.p.Listen(addr); err != nil {
		fix := `set metrics_address to a free host:port, or "" to disable metrics`
		switch {
		case errors.Is(err, syscall.EADDRINUSE):
			fix = "see who listens: ss -ltnp 'sport = :" + port + "'; stop it, or change metrics_address"
			if e.running != "" {
				fix = "probably the hostd that answers on " + e.running + "; " + fix
			}
		case errors.Is(err, syscall.EADDRNOTAVAIL):
			fix = "no interface has address " + host + "; use one that exists, such as 127.0.0.1"
		}
		e.problem(fmt.Sprintf("metrics_address %s cannot be bound: %v", addr, err), fix)
		return
	}
	if a, err := netip.ParseAddr(host); host == "" || (err == nil && !a.IsLoopback()) {
		e.warn(fmt.Sprintf("metrics_address %s is reachable from beyond this host: whoever reaches it sees guest names, flows and byte counts", addr),
			"bind it to 127.0.0.1, or firewall the port")
	}
	e.ok("metrics_address %s can be bound", addr)
}
