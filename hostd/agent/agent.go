package agent

import (
	"context"
	"errors"
	"fmt"
	"github.com/shuntnet/shunt/hostd/across"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/hostd/ruleset"
	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/hostd/vsockd"
	"github.com/shuntnet/shunt/hostd/vsockhost"
	"github.com/shuntnet/shunt/hostd/witness"
	"github.com/shuntnet/shunt/internal/nsexec"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/shm/region"
)

// Agent is a running hostd.
type Agent struct {
	log     hclog.Logger
	cfg     *config.Config
	ct      *ctrack.Netlink
	m       *metrics.Set
	b       *broker.Broker
	srv     *server.Server
	adm     *admin.Server
	http    *http.Server
	pools   []*region.Pool // the trust groups' regions
	files   *region.Files  // region files and hostd's shadows of them
	pairs   *pairRegions   // the regions of guest pairs
	hot     *qmpHotplug    // plugs VM pair regions into bare QEMUs; nil without qmp sockets
	lvhot   *lvHotplug     // plugs VM pair regions into libvirt domains; nil without libvirt or pair groups
	guests  []*broker.Guest
	witness *witness.Witness
	marks   *mark.Marker // hostd's nftables table; nil when hostd does not mark
	groups  map[string]*broker.Group
	virt    *virt.Watcher   // nil without a libvirt block
	peers   *peers.Room     // the channel to other hosts' hostds; nil without a peering block
	across  *across.Room    // pairs connections across hosts and relays them; nil without peering
	orphans []orphanRegion  // relay pair regions of a killed hostd, until the cross-host room adopts them (Start)
	vsock   *vsockhost.Room // the VMs' vhost-user-vsock devices; nil without vsock blocks
	vsockd  *vsockd.Client  // shunt-vsockd, which serves them with vsockd_socket; nil without

	// libvirt guests, registered and unregistered by the watcher
	vmu      sync.Mutex
	vguests  map[string]*broker.Guest // by domain name
	vpending []server.Endpoint        // registered before the server runs

	mig sync.Mutex // one migrate-out or migrate-in at a time

	rt runtimeGuests // added at run time (runtime.go)

	cancel  context.CancelFunc
	wg      sync.WaitGroup
	started time.Time
}

// Close stops hostd without moving connections: ring flows keep running
// and the next hostd adopts them from the regions (Shutdown first, for a
// graceful stop).
func (a *Agent) Close() {
	if a.virt != nil {
		a.virt.Close()
	}
	if a.across != nil {
		a.across.Close()
	}
	if a.peers != nil {
		a.peers.Close()
	}
	if a.b != nil {
		a.b.Close()
	}
	if a.cancel != nil {
		a.cancel()
	}
	if a.srv != nil {
		a.srv.Close()
	}
	if a.adm != nil {
		a.adm.Close()
	}
	if a.http != nil {
		a.http.Close()
	}
	if a.vsock != nil {
		a.vsock.Close()
	}
	if a.vsockd != nil {
		a.vsockd.Close() // the daemon's devices go on
	}
	a.wg.Wait()
	if a.ct != nil {
		a.ct.Close()
	}
	if a.witness != nil {
		a.witness.Close()
	}
	if a.marks != nil {
		if err := a.marks.Close(); err != nil {
			a.log.Warn("could not remove hostd's nftables table", "error", err)
		}
	}
	for _, p := range a.pools {
		p.Close()
	}
	if a.pairs != nil {
		a.pairs.close()
	}
	if a.lvhot != nil {
		_ = a.lvhot.p.Close()
	}
}

// watchConntrack moves connections whose conntrack entry is destroyed to
// TCP; when the
// event stream fails (lost events), it resyncs and listens again.
func (a *Agent) watchConntrack(ctx context.Context) {
	defer a.wg.Done()
	for {
		err := a.ct.Destroyed(ctx, a.b.ConntrackDestroyed)
		if ctx.Err() != nil {
			return
		}
		a.log.Warn("conntrack events interrupted; resyncing", "error", err)
		a.b.Resync()
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Shutdown is a graceful stop's first step: every connection on the rings
// moves to TCP (DOWN(shutdown)), and hostd waits up to shutdown_grace for
// the guests to leave the rings. Close follows. A hostd that is killed
// instead changes nothing: the flows keep their path and the next hostd
// adopts them.
func (a *Agent) Shutdown() {
	if a.b == nil {
		return
	}
	start := time.Now()
	held := a.b.Shutdown(a.cfg.ShutdownGrace)
	a.log.Info("connections moved to TCP", "took", time.Since(start).Round(time.Millisecond), "rings_still_held", held)
}

// watchRuleset moves every connection on the rings to TCP when the
// firewall's ruleset changes (hostd's own table aside), until ctx ends;
// the watch is restarted after a failure.
func (a *Agent) watchRuleset(ctx context.Context) {
	defer a.wg.Done()
	for {
		err := ruleset.Watch(ctx, a.cfg.ConntrackNetns, mark.Table, a.b.RulesetChanged)
		if ctx.Err() != nil {
			return
		}
		a.log.Warn("firewall ruleset watch failed; retrying (connections stay where they are meanwhile)", "error", err)
		a.b.RulesetChanged() // a change may have gone unseen
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

// acctSysctl turns conntrack's accounting counters on (`hostd flows`
// shows a lease's packets); tstampSysctl gives each new entry its start
// time, so that a firewall epoch's clear spares the proof bits of entries
// made since the change (their packets all met the new rules).
const (
	acctSysctl   = "/proc/sys/net/netfilter/nf_conntrack_acct"
	tstampSysctl = "/proc/sys/net/netfilter/nf_conntrack_timestamp"
)

// enableAcct sets net.netfilter.nf_conntrack_acct=1 and
// nf_conntrack_timestamp=1 in the conntrack namespace; without the
// timestamps, a connection made while an epoch's clear runs may lose its
// handshake's proof bits and wait on TCP for its next packets.
func (a *Agent) enableAcct() {
	write := func() error {
		return errors.Join(os.WriteFile(acctSysctl, []byte("1\n"), 0o644), os.WriteFile(tstampSysctl, []byte("1\n"), 0o644))
	}
	var err error
	if a.cfg.ConntrackNetns == "" {
		err = write()
	} else {
		err = nsexec.In(a.cfg.ConntrackNetns, write)
	}
	if err != nil {
		a.log.Warn("cannot turn conntrack accounting or timestamps on: lease counters are not shown, and a connection made during a firewall change may wait on TCP for its next packets", "sysctls", "net.netfilter.nf_conntrack_acct, nf_conntrack_timestamp", "error", err)
	}
}

// Reload re-reads the policy from the configuration file and applies it:
// connections on the rings that it forbids move to TCP, and connections
// on TCP that it allows now move to the rings. It returns how many moved
// down.
func (a *Agent) Reload() (int, error) {
	c, err := config.Load(a.cfg.Path)
	if err != nil {
		return 0, fmt.Errorf("reload: %w", err)
	}
	tab, err := policy.Compile(c.Policy)
	if err != nil {
		return 0, fmt.Errorf("reload: %w", err)
	}
	down, up := a.b.SetPolicy(tab)
	a.log.Info("policy reloaded", "rules", len(tab.Rules()), "to_tcp", down, "to_rings", up)
	if err := a.reloadPeers(c); err != nil {
		return down, fmt.Errorf("reload: %w", err)
	}
	return down, nil
}
