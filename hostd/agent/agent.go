package agent

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/hostd/witness"
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
	guests  []*broker.Guest
	witness *witness.Witness
	marks   *mark.Marker // hostd's nftables table; nil when hostd does not mark
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
