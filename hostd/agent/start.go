package agent

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/hostd/witness"
	"github.com/shuntnet/shunt/policy"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// Start brings hostd up from cfg, in order: the policy and conntrack, the
// trust groups' regions, the configured guests, the broker, the libvirt
// watcher, the flows adopted from the regions, and then the servers
// (control channels, admin socket, metrics) and the conntrack watcher.
// Each step leaves what it acquired in the Agent, so that on failure Close
// stops everything already started.
func Start(log hclog.Logger, cfg *config.Config) (_ *Agent, err error) {
	a := &Agent{log: log, cfg: cfg, m: metrics.New(), started: time.Now(), vguests: map[string]*broker.Guest{}}
	defer func() {
		if err != nil {
			a.Close()
		}
	}()
	tab, err := policy.Compile(cfg.Policy)
	if err != nil {
		return nil, err
	}
	if a.ct, err = ctrack.Dial(cfg.ConntrackNetns); err != nil {
		return nil, err
	}
	if err := a.openGroups(); err != nil {
		return nil, err
	}
	eps, err := a.configGuests()
	if err != nil {
		return nil, err
	}
	a.restoreRuntime()
	if err := broker.CheckOverlaps(a.guests); err != nil {
		return nil, err
	}
	if cfg.WatchRuleset {
		a.enableAcct() // before any epoch: timestamps on the entries it clears
	}
	if err := a.startMarks(); err != nil {
		return nil, err
	}
	lim := cfg.Limits
	opts := broker.Options{PairingTimeout: cfg.PairingTimeout, Limits: broker.Limits{
		ListensPerSession: lim.ListensPerSession, ListensPerGuest: lim.ListensPerGuest,
		PendingOpensPerGuest: lim.PendingOpensPerGuest, OpensPerSecond: lim.OpensPerSecond,
	}, PairRegionLinger: cfg.PairRegionLinger, RevokeGrace: cfg.RevokeGrace}
	if a.witness != nil {
		opts.Witness = a.witness
	}
	opts.MarkMask = a.markMask()
	opts.ProofOrig, opts.ProofReply = a.proofBits()
	opts.ProofMaxAge = cfg.ProofMaxAge
	opts.VsockServed = func(id uint32) bool { return a.vsock.Served(id) } // a.vsock is set before any guest connects (startVsock)
	a.b = broker.New(log.Named("broker"), a.ct, a.m, tab, a.guests, opts)
	a.b.UsePairRegions(a.pairs)
	a.hot, a.lvhot = a.hotplug(), a.libvirtHotplug()
	if a.hot != nil || a.lvhot != nil {
		a.b.UseHotplug(&vmHotplug{qmp: a.hot, lv: a.lvhot})
	}
	a.m.NewFlowBytes(a.b.FlowStats)
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	if cfg.WatchRuleset {
		// Watching before the first epoch begins: a change from here on
		// is seen, however long adoption and the servers take.
		a.wg.Add(1)
		go a.watchRuleset(ctx)
	}
	// Learn the running VMs before adopting flows, so flows between
	// libvirt guests survive a hostd restart like any others.
	a.startLibvirt(ctx)
	a.adopt()
	a.b.Start() // the first firewall epoch: nothing from before hostd's start counts as proof
	if err := a.startPeers(ctx); err != nil {
		return nil, err
	}
	if err := a.startVsock(); err != nil {
		return nil, err
	}
	if err := a.startServers(eps); err != nil {
		return nil, err
	}
	if err := a.serveRuntime(); err != nil {
		return nil, err
	}
	a.wg.Add(1)
	go a.reapRuntime(ctx)
	a.wg.Add(1)
	go a.watchConntrack(ctx)
	log.Info("hostd running", "guests", len(a.guests), "groups", len(a.groups), "admin", cfg.AdminSocket, "metrics", cfg.MetricsAddress)
	return a, nil
}

// hotplug returns how hostd plugs VM pair regions into the configured
// VMs (their QMP sockets), or nil if no guest has one.
func (a *Agent) hotplug() *qmpHotplug {
	h := &qmpHotplug{log: a.log.Named("hotplug"), socks: map[uint32]string{}, locks: map[uint32]*sync.Mutex{}}
	for _, gc := range a.cfg.Guests {
		if gc.QMP != "" {
			h.socks[gc.ID] = gc.QMP
		}
	}
	if len(h.socks) == 0 {
		return nil
	}
	return h
}

// libvirtHotplug returns how hostd plugs VM pair regions into libvirt
// domains, or nil without a libvirt block or a trust group with
// vm_regions = "pair".
func (a *Agent) libvirtHotplug() *lvHotplug {
	lv := a.cfg.Libvirt
	if lv == nil || !slices.ContainsFunc(a.cfg.Groups, func(g config.Group) bool { return g.VMRegions == config.VMRegionsPair }) {
		return nil
	}
	return &lvHotplug{log: a.log.Named("hotplug"), p: virt.NewPlugger(lv.Socket, lv.URI)}
}

// configGuests makes the configured guests, with their addresses and, if
// the witness is on (it is loaded here), their interfaces attached to it;
// it returns their control endpoints. startMarks gives them their mark ids.
func (a *Agent) configGuests() ([]server.Endpoint, error) {
	cfg := a.cfg
	if cfg.Witness {
		var err error
		if a.witness, err = witness.Load(); err != nil {
			return nil, err
		}
	}
	var eps []server.Endpoint
	for _, gc := range cfg.Guests {
		g := &broker.Guest{Name: gc.Name, ID: gc.ID, Group: a.groups[gc.Group], CTMark: gc.CTMark, Source: "config", SharedRegion: gc.SharedRegion,
			PairVM: gc.SharedRegion && gc.QMP != "",     // config.checkQMP: qmp only in vm_regions = "pair" groups
			Vsock:  gc.Vsock != nil && !gc.SharedRegion} // its flows' stretches go over vsock (startVsock)
		// The hypervisor's device, or shunt-vsockd's: it outlives hostd.
		g.VsockKept = g.Vsock && (gc.Vsock.Hybrid != "" || cfg.VsockdSocket != "")
		addrs, err := guestAddrs(cfg.ConntrackNetns, gc)
		if err != nil {
			return nil, err
		}
		g.SetAddrs(addrs)
		if a.witness != nil && gc.Interface != "" {
			if g.Ifindex, err = attachWitness(a.witness, cfg.ConntrackNetns, gc.Interface); err != nil {
				return nil, fmt.Errorf("guest %s: %w", gc.Name, err)
			}
		}
		a.guests = append(a.guests, g)
		for i := range gc.Ports {
			if gc.Control == "" {
				break // a vsock VM's control channel is on its vsock only (serveVsockControl)
			}
			eps = append(eps, server.Endpoint{Guest: g, Path: vserial.SocketOf(gc.Control, i), Netns: gc.Netns})
		}
	}
	return eps, nil
}

// startLibvirt starts the libvirt watcher, if configured, and gives it 5 s
// to register the running domains. libvirtd being away is not an error:
// the watcher keeps trying.
func (a *Agent) startLibvirt(ctx context.Context) {
	lv := a.cfg.Libvirt
	if lv == nil {
		return
	}
	a.virt = virt.NewWatcher(a.log.Named("libvirt"), virt.Dial(lv.Socket, lv.URI), (*registry)(a), virt.Options{})
	a.m.NewLibvirt(func() bool { return a.virt.Status().Connected },
		func() int { return len(a.virt.Status().Domains) },
		func() uint64 { return a.virt.Status().Syncs })
	if err := a.virt.Start(ctx, 5*time.Second); err != nil {
		a.log.Warn("libvirtd not reachable at start; flows of its VMs from before this hostd cannot be adopted", "error", err)
	}
}

// adopt rebuilds the flows an earlier hostd left in the regions (from its
// shadows of them: pair regions first, then the groups'), and checks every
// flow against conntrack.
func (a *Agent) adopt() {
	a.adoptPairs()
	for _, g := range a.groups {
		if n := a.b.Adopt(g, a.cfg.ReattachGrace); n > 0 {
			a.log.Info("adopted live flows from the region", "group", g.Name, "flows", n, "grace", a.cfg.ReattachGrace)
		}
	}
	a.b.Resync()
}

// startServers starts the control channels (of the configured guests and
// the libvirt guests registered so far), the admin socket and the metrics
// listener.
func (a *Agent) startServers(eps []server.Endpoint) error {
	a.vmu.Lock()
	eps = append(eps, a.vpending...)
	a.vpending = nil
	var err error
	lim := a.cfg.Limits
	a.srv, err = server.Listen(a.log.Named("control"), a.b, a.m, server.Options{
		SessionsPerGuest: lim.SessionsPerGuest, SessionRate: lim.SessionsPerSecond, Keepalive: lim.Keepalive, Silence: lim.Silence,
	}, eps)
	a.vmu.Unlock()
	if err != nil {
		return err
	}
	if err := a.serveVsockControl(); err != nil {
		return err
	}
	if a.adm, err = admin.Listen(a.cfg.AdminSocket, a.handle); err != nil {
		return err
	}
	return a.serveMetrics()
}

// serveMetrics serves /metrics on the configured address, if any: TCP
// host:port, or "unix:/path", a Unix socket of mode 0600 (replacing a
// stale one), which only root can scrape.
func (a *Agent) serveMetrics() error {
	if a.cfg.MetricsAddress == "" {
		return nil
	}
	l, err := listenMetrics(a.cfg.MetricsAddress)
	if err != nil {
		return fmt.Errorf("metrics listener: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.m.Registry, promhttp.HandlerOpts{}))
	a.http = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		_ = a.http.Serve(l)
	}()
	return nil
}

func listenMetrics(addr string) (net.Listener, error) {
	path := config.MetricsUnix(addr)
	if path == "" {
		return net.Listen("tcp", addr)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if st, err := os.Lstat(path); err == nil && st.Mode()&os.ModeSocket == 0 {
		return nil, fmt.Errorf("%s exists and is not a socket: remove it or choose another metrics_address", path)
	}
	_ = os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}
