package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/shuntnet/shunt/hostd/across"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/nsexec"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/relay/ibv"
)

// openRDMA opens a queue pair on the first active RDMA port for a relay
// link. In a hostd built without -tags rdma (the default, and always
// without cgo) it fails with ibv.ErrNoRDMA, and the links are TCP
// (docs/rdma.md).
func openRDMA() (relay.Verbs, error) {
	return ibv.Open(ibv.Config{GIDIndex: -1, Size: 4 << 20, Depth: 128})
}

// startPeers starts the channel to the peer hosts' hostds if hostd.hcl has
// a peering block (docs/crosshost.md). Its sockets live in conntrack_netns
// (the host's network namespace, where the fabric is); it announces the
// local guests' prefixes, refreshed each second from the broker so that
// guests of every source are covered; the broker asks it about addresses
// no local guest owns, and checks the peers' claims (VerifyClaim).
func (a *Agent) startPeers(ctx context.Context) error {
	pc := a.cfg.Peering
	defer a.dropOrphans()
	if pc == nil {
		return nil
	}
	o := peers.Options{Log: a.log.Named("peers"), Registerer: a.m.Registry, Local: a.b.LocalOverlaps,
		Verify: func(peer string, c peers.Claim) string {
			return a.b.VerifyClaim(peer, c.Group, ctrack.Tuple{Src: c.Src, Dst: c.Dst}, c.Active).String()
		}}
	if ns := a.cfg.ConntrackNetns; ns != "" {
		o.In = func(fn func() error) error { return nsexec.In(ns, fn) }
	}
	x := across.New(a.b, across.Options{Log: a.log.Named("across"), In: o.In, PairingTimeout: a.cfg.PairingTimeout, Registerer: a.m.Registry,
		RDMA: openRDMA})
	x.Callbacks(&o)
	a.adoptOrphans(x, pc) // before the channel: a peer's first stop may be for one of them
	r, err := peers.Start(*pc, o)
	if err != nil {
		return err
	}
	a.peers = r
	if err := x.Start(r, pc.RelayListen()); err != nil {
		r.Close()
		a.peers = nil
		return fmt.Errorf("relay link: %w", err)
	}
	a.across = x
	a.b.UseRemote(x)
	a.announce()
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				a.announce()
			}
		}
	}()
	return nil
}

// announce sends the local guests' prefixes to the peers (a no-op when
// they have not changed).
func (a *Agent) announce() {
	var out []peers.Announced
	for _, lp := range a.b.LocalPrefixes() {
		out = append(out, peers.Announced{Prefix: lp.Prefix, Group: lp.Group})
	}
	a.peers.Announce(out)
}

// reloadPeers applies a reloaded configuration's peer blocks.
func (a *Agent) reloadPeers(c *config.Config) error {
	switch {
	case a.peers == nil && c.Peering == nil:
		return nil
	case a.peers == nil || c.Peering == nil:
		a.log.Warn("a peering block added or removed takes effect at the next start")
		return nil
	}
	return a.peers.Reload(*c.Peering)
}
