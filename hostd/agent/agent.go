// Package agent wires hostd together: what `hostd agent` runs. It creates or
// adopts each trust group's region, learns guest addresses, and starts the
// broker, the control channels, the conntrack watcher, the admin socket and
// the metrics listener; Close stops them in the order that keeps flows
// running (the broker first, so nothing is revoked because hostd stops).
package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/user"
	"strconv"
	"strings"
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
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/vhost/vserial"
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
	regions []*region.Region
	guests  []*broker.Guest
	witness *witness.Witness
	groups  map[string]*broker.Group
	virt    *virt.Watcher // nil without a libvirt block

	// libvirt guests, registered and unregistered by the watcher
	vmu      sync.Mutex
	vguests  map[string]*broker.Guest // by domain name
	vpending []server.Endpoint        // registered before the server runs

	cancel  context.CancelFunc
	wg      sync.WaitGroup
	started time.Time
}

// Start brings hostd up from cfg. On failure everything already started is
// stopped again.
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
	groups := map[string]*broker.Group{}
	a.groups = groups
	for _, g := range cfg.Groups {
		r, adopted, err := openRegion(g)
		if err != nil {
			return nil, err
		}
		a.regions = append(a.regions, r)
		if err := shareRegion(g); err != nil {
			return nil, err
		}
		gen := r.BumpGeneration()
		pool, problems := region.Adopt(r, nil)
		for _, p := range problems {
			log.Warn("region slot dropped", "group", g.Name, "problem", p)
		}
		groups[g.Name] = &broker.Group{Name: g.Name, Region: g.Region, Pool: pool}
		log.Info("region ready", "group", g.Name, "path", g.Region, "size", g.Geometry.Size, "adopted", adopted, "generation", gen)
	}
	if cfg.Witness {
		if a.witness, err = witness.Load(); err != nil {
			return nil, err
		}
	}
	var eps []server.Endpoint
	for _, gc := range cfg.Guests {
		g := &broker.Guest{Name: gc.Name, ID: gc.ID, Group: groups[gc.Group], CTMark: gc.CTMark, Source: "config"}
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
			eps = append(eps, server.Endpoint{Guest: g, Path: vserial.SocketOf(gc.Control, i)})
		}
	}
	opts := broker.Options{PairingTimeout: cfg.PairingTimeout}
	if a.witness != nil {
		opts.Witness = a.witness
	}
	a.b = broker.New(log.Named("broker"), a.ct, a.m, tab, a.guests, opts)
	a.m.NewFlowBytes(a.b.FlowStats)
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	if lv := cfg.Libvirt; lv != nil {
		// Learn the running VMs before adopting flows, so flows between
		// libvirt guests survive a hostd restart like any others.
		a.virt = virt.NewWatcher(log.Named("libvirt"), virt.Dial(lv.Socket, lv.URI), (*registry)(a), virt.Options{})
		a.m.NewLibvirt(func() bool { return a.virt.Status().Connected },
			func() int { return len(a.virt.Status().Domains) },
			func() uint64 { return a.virt.Status().Syncs })
		if err := a.virt.Start(ctx, 5*time.Second); err != nil {
			log.Warn("libvirtd not reachable at start; flows of its VMs from before this hostd cannot be adopted", "error", err)
		}
	}
	for _, g := range groups {
		if n := a.b.Adopt(g, cfg.ReattachGrace); n > 0 {
			log.Info("adopted live flows from the region", "group", g.Name, "flows", n, "grace", cfg.ReattachGrace)
		}
	}
	a.b.Resync()
	a.vmu.Lock()
	eps = append(eps, a.vpending...)
	a.vpending = nil
	a.srv, err = server.Listen(log.Named("control"), a.b, a.m, eps)
	a.vmu.Unlock()
	if err != nil {
		return nil, err
	}
	if a.adm, err = admin.Listen(cfg.AdminSocket, a.handle); err != nil {
		return nil, err
	}
	if cfg.MetricsAddress != "" {
		l, err := net.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return nil, fmt.Errorf("metrics listener: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(a.m.Registry, promhttp.HandlerOpts{}))
		a.http = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			_ = a.http.Serve(l)
		}()
	}
	a.wg.Add(1)
	go a.watchConntrack(ctx)
	log.Info("hostd running", "guests", len(a.guests), "groups", len(groups), "admin", cfg.AdminSocket, "metrics", cfg.MetricsAddress)
	return a, nil
}

// openRegion adopts a group's existing region file if it is a valid region
// of the configured geometry, or creates a fresh one.
func openRegion(g config.Group) (*region.Region, bool, error) {
	if r, err := region.Open(g.Region); err == nil {
		if r.Layout().Geometry == g.Geometry {
			return r, true, nil
		}
		r.Close()
		return nil, false, fmt.Errorf("region %s has geometry %+v, config says %+v: stop the guests using it and remove the file to resize", g.Region, r.Layout().Geometry, g.Geometry)
	} else if !errors.Is(err, os.ErrNotExist) {
		hclog.Default().Warn("region file is not a valid region; recreating it", "path", g.Region, "error", err)
	}
	r, err := region.Create(g.Region, g.Geometry, 0o600)
	return r, false, err
}

// shareRegion gives a group's region file to its region_group, mode 0660,
// so QEMUs running as that group can map it.
func shareRegion(g config.Group) error {
	if g.RegionGroup == "" {
		return nil
	}
	grp, err := user.LookupGroup(g.RegionGroup)
	if err != nil {
		return fmt.Errorf("trust group %s: region_group: %w", g.Name, err)
	}
	gid, err := strconv.Atoi(grp.Gid)
	if err != nil {
		return fmt.Errorf("trust group %s: region_group %s has gid %q", g.Name, g.RegionGroup, grp.Gid)
	}
	if err := os.Chown(g.Region, -1, gid); err != nil {
		return fmt.Errorf("trust group %s: give region to group %s: %w", g.Name, g.RegionGroup, err)
	}
	return os.Chmod(g.Region, 0o660)
}

// watchConntrack revokes flows whose conntrack entry is destroyed; when the
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

// Reload re-reads the policy from the configuration file and applies it;
// flows the new policy forbids are revoked.
func (a *Agent) Reload() (int, error) {
	c, err := config.Load(a.cfg.Path)
	if err != nil {
		return 0, fmt.Errorf("reload: %w", err)
	}
	tab, err := policy.Compile(c.Policy)
	if err != nil {
		return 0, fmt.Errorf("reload: %w", err)
	}
	n := a.b.SetPolicy(tab)
	a.log.Info("policy reloaded", "rules", len(tab.Rules()), "revoked", n)
	return n, nil
}

// Status is the `hostd status` reply.
type Status struct {
	Uptime   string       `json:"uptime"`
	Guests   int          `json:"guests"`
	Sessions int          `json:"sessions"`
	Flows    int          `json:"flows"`
	Groups   []string     `json:"groups"`
	Libvirt  *virt.Status `json:"libvirt,omitempty"`
}

func (a *Agent) handle(r admin.Request) (any, error) {
	switch r.Cmd {
	case "guests":
		return a.b.Guests(), nil
	case "flows":
		return a.b.Flows(), nil
	case "status":
		st := Status{Uptime: time.Since(a.started).Round(time.Second).String(), Guests: len(a.b.Guests()), Flows: len(a.b.Flows())}
		if a.virt != nil {
			vs := a.virt.Status()
			st.Libvirt = &vs
		}
		for _, g := range a.b.Guests() {
			st.Sessions += g.Sessions
		}
		for _, g := range a.cfg.Groups {
			st.Groups = append(st.Groups, g.Name)
		}
		return st, nil
	case "counters":
		return a.counters()
	case "reload":
		n, err := a.Reload()
		return map[string]int{"revoked": n}, err
	case "revoke":
		if !a.b.Revoke(r.Flow) {
			return nil, fmt.Errorf("no flow named %q (see hostd flows)", r.Flow)
		}
		return map[string]string{"revoked": r.Flow}, nil
	}
	return nil, fmt.Errorf("unknown command %q", r.Cmd)
}

// Close stops hostd without revoking flows: they keep running and the next
// hostd adopts them from the regions.
func (a *Agent) Close() {
	if a.virt != nil {
		a.virt.Close()
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
	a.wg.Wait()
	if a.ct != nil {
		a.ct.Close()
	}
	if a.witness != nil {
		a.witness.Close()
	}
	for _, r := range a.regions {
		r.Close()
	}
}

// counters returns Shunt's own counters and gauges as "name{label=value}"
// keys, for the CLI and the tests.
func (a *Agent) counters() (map[string]float64, error) {
	mfs, err := a.m.Registry.Gather()
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), "shunt_") {
			continue
		}
		for _, m := range mf.GetMetric() {
			key := mf.GetName()
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			if len(labels) > 0 {
				key += "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[key] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[key] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[key+"_count"] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out, nil
}
