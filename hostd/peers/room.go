package peers

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
)

// Options are what the room needs from hostd.
type Options struct {
	Log hclog.Logger
	// Registerer takes the room's metrics; nil: none are registered.
	Registerer prometheus.Registerer
	// In, if set, runs fn inside the network namespace the channel's
	// sockets belong to (the host's: hostd's conntrack_netns).
	In func(fn func() error) error
	// Local reports whether prefix p overlaps this host's own guests'
	// addresses: a peer may never announce one of them.
	Local func(p netip.Prefix) bool
	// Verify checks a peer's claim (the broker's VerifyClaim) and returns
	// the reason's name, "none" if it holds; nil: every claim is refused
	// with not-local.
	Verify func(peer string, c Claim) string
	// Across takes the cross-host room's messages from a peer (hostd/across),
	// on that peer's channel reader, in order: it must not block for long.
	Across func(peer string, m Across)
	// State is told when a peer's channel comes up or goes down, after
	// the fact (not under the room's lock).
	State func(peer string, up bool)
}

// Room is hostd's peer channel: the links to the configured peers and
// what they announced. Safe for concurrent use.
type Room struct {
	log  hclog.Logger
	opts Options
	m    *metricSet
	stop chan struct{}
	wg   sync.WaitGroup

	mu     sync.Mutex
	cfg    Config
	cr     *creds
	peers  map[string]*peer
	local  []Announced
	ln     net.Listener
	closed bool
}

// peer is the state of one configured peer. Its fields are guarded by
// the room's mutex, except the byte counters.
type peer struct {
	cfg        Peer
	dials      bool // this side dials (its name sorts first)
	state      string
	err        string
	since      time.Time
	sess       *session                // nil while down
	accepted   map[netip.Prefix]string // what it announced and this host accepted: prefix -> group
	refused    map[netip.Prefix]string // what it announced and this host refused: prefix -> reason
	theyRefuse map[netip.Prefix]string // what this host announced and it refused
	reconnects uint64
	rtt        time.Duration
	claims     map[uint64]chan string // this host's claims waiting for their verdicts
	nextClaim  uint64
	in, out    atomic.Uint64
	quit       chan struct{} // closed when the peer is removed by a reload
}

// Peer states.
const (
	StateDown       = "down"       // no channel: dialing with back-off, or waiting to be dialed
	StateConnecting = "connecting" // dialing
	StateRefused    = "refused"    // the last attempt failed its TLS handshake or was refused
	StateUp         = "up"
)

// Refusal reasons for announced addresses.
const (
	RefusedForbidden = "forbidden-prefix" // outside the prefixes this host's config allows the peer
	RefusedLocal     = "local-address"    // one of this host's own guests' addresses
	RefusedTaken     = "announced-by-another-peer"
)

// Start checks cfg, loads its TLS material, listens (if cfg.Listen is
// set) and starts dialing the peers whose names sort after this hostd's.
func Start(cfg Config, o Options) (*Room, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	cr, err := loadCreds(&cfg)
	if err != nil {
		return nil, err
	}
	if o.Log == nil {
		o.Log = hclog.NewNullLogger()
	}
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	r := &Room{log: o.Log, opts: o, stop: make(chan struct{}), cfg: cfg, cr: cr, peers: map[string]*peer{}}
	r.m = newMetrics(o.Registerer)
	if cfg.Listen != "" {
		if err := r.in(func() (err error) { r.ln, err = net.Listen("tcp", cfg.Listen); return err }); err != nil {
			return nil, fmt.Errorf("peering: listen %s: %w", cfg.Listen, err)
		}
		r.wg.Add(1)
		go r.acceptLoop(r.ln)
	}
	r.mu.Lock()
	for _, pc := range cfg.Peers {
		r.addPeerLocked(pc)
	}
	r.mu.Unlock()
	r.log.Info("peering up", "name", cr.name, "listen", cfg.Listen, "peers", len(cfg.Peers))
	return r, nil
}

// Name is this hostd's name among its peers (its certificate's).
func (r *Room) Name() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cr.name
}

func (r *Room) in(fn func() error) error {
	if r.opts.In == nil {
		return fn()
	}
	return r.opts.In(fn)
}

func (r *Room) addPeerLocked(pc Peer) {
	p := &peer{cfg: pc, dials: r.cr.name < pc.Name, state: StateDown, since: time.Now(), quit: make(chan struct{})}
	r.peers[pc.Name] = p
	r.m.up.WithLabelValues(pc.Name).Set(0)
	if p.dials {
		r.wg.Add(1)
		go r.dialLoop(p)
	}
}

// Reload applies a new configuration (SIGHUP): new TLS material for the
// next handshakes, peers added and removed; a peer whose address or
// prefixes changed has its channel restarted, so that what it announces
// is checked again. A change of the listen address needs a restart.
func (r *Room) Reload(cfg Config) error {
	if err := cfg.Check(); err != nil {
		return err
	}
	cr, err := loadCreds(&cfg)
	if err != nil {
		return err
	}
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return errors.New("peering: closed")
	}
	if cfg.Listen != r.cfg.Listen {
		r.log.Warn("peering: a new listen address takes effect at the next start", "now", r.cfg.Listen, "configured", cfg.Listen)
		cfg.Listen = r.cfg.Listen
	}
	renamed := cr.name != r.cr.name
	r.cfg, r.cr = cfg, cr
	for name, p := range r.peers {
		pc, ok := cfg.peer(name)
		switch {
		case !ok || renamed:
			r.removePeerLocked(p)
		case pc.Address != p.cfg.Address || !slices.Equal(pc.Prefixes, p.cfg.Prefixes):
			p.cfg = pc
			if p.sess != nil {
				p.sess.close()
			}
		}
	}
	for _, pc := range cfg.Peers {
		if r.peers[pc.Name] == nil {
			r.addPeerLocked(pc)
		}
	}
	r.log.Info("peering reloaded", "name", cr.name, "peers", len(cfg.Peers))
	return nil
}

func (r *Room) removePeerLocked(p *peer) {
	close(p.quit)
	if p.sess != nil {
		p.sess.close()
	}
	delete(r.peers, p.cfg.Name)
	r.m.forget(p.cfg.Name)
}

// Announce sets this host's guest addresses, the whole set, and sends it
// to every peer that is up. An address left out is withdrawn.
func (r *Room) Announce(local []Announced) {
	local = slices.Clone(local)
	for i := range local {
		local[i].Prefix = local[i].Prefix.Masked()
	}
	sort.Slice(local, func(i, j int) bool {
		if c := local[i].Prefix.Addr().Compare(local[j].Prefix.Addr()); c != 0 {
			return c < 0
		}
		return local[i].Prefix.Bits() < local[j].Prefix.Bits()
	})
	r.mu.Lock()
	if slices.Equal(local, r.local) {
		r.mu.Unlock()
		return
	}
	r.local = local
	var to []*session
	for _, p := range r.peers {
		if p.sess != nil {
			to = append(to, p.sess)
		}
	}
	r.mu.Unlock()
	for _, s := range to {
		s.send(msg{Type: tAnnounce, Addrs: local})
	}
}

// Route is the answer to Route: the peer that may speak for an address.
type Route struct {
	Peer  string
	Up    bool   // the peer's channel is up and it announced the address
	Group string // the trust group it announced the address with (when Up)
}

// Route says which peer, if any, speaks for addr: one that is up and
// announced a prefix holding it (and this host accepted it), or one whose
// configured prefixes hold it while it is not up (Up false: its
// connections stay on TCP with reason peer-unreachable). It never blocks
// on the network. Accepted prefixes of two peers never overlap.
func (r *Room) Route(addr netip.Addr) (Route, bool) {
	addr = addr.Unmap()
	r.mu.Lock()
	defer r.mu.Unlock()
	for name, p := range r.peers {
		for q, g := range p.accepted {
			if q.Contains(addr) {
				return Route{Peer: name, Up: true, Group: g}, true
			}
		}
	}
	for name, p := range r.peers {
		if p.sess == nil && inPrefixes(p.cfg.Prefixes, addr) {
			return Route{Peer: name}, true
		}
	}
	return Route{}, false
}

func inPrefixes(ps []netip.Prefix, a netip.Addr) bool {
	return slices.ContainsFunc(ps, func(p netip.Prefix) bool { return p.Contains(a) })
}

// within reports whether q lies wholly inside one of ps.
func within(ps []netip.Prefix, q netip.Prefix) bool {
	return slices.ContainsFunc(ps, func(p netip.Prefix) bool { return p.Bits() <= q.Bits() && p.Contains(q.Addr()) })
}

// localOf is which of addrs overlap this host's own guests (Options.Local).
// It must run without r.mu: Local takes the broker's lock, and the broker
// calls Route (r.mu) under its lock.
func (r *Room) localOf(addrs []Announced) map[netip.Prefix]bool {
	local := map[netip.Prefix]bool{}
	if r.opts.Local == nil {
		return local
	}
	for _, a := range addrs {
		if _, seen := local[a.Prefix]; !seen {
			local[a.Prefix] = r.opts.Local(a.Prefix)
		}
	}
	return local
}

// filterLocked splits what peer p announced into what this host accepts
// and what it refuses, with reasons; local is localOf(addrs).
func (r *Room) filterLocked(p *peer, addrs []Announced, local map[netip.Prefix]bool) (map[netip.Prefix]string, map[netip.Prefix]string) {
	ok, no := map[netip.Prefix]string{}, map[netip.Prefix]string{}
	for _, a := range addrs {
		q := a.Prefix
		switch {
		case !within(p.cfg.Prefixes, q):
			no[q] = RefusedForbidden
		case local[q]:
			no[q] = RefusedLocal
		case r.takenLocked(p, q):
			no[q] = RefusedTaken
		default:
			ok[q] = a.Group
		}
	}
	return ok, no
}

// takenLocked reports whether q overlaps a prefix another peer announced.
func (r *Room) takenLocked(by *peer, q netip.Prefix) bool {
	for _, p := range r.peers {
		if p == by {
			continue
		}
		for o := range p.accepted {
			if o.Overlaps(q) {
				return true
			}
		}
	}
	return false
}

// Info is one peer in `hostd peers`.
type Info struct {
	Name       string            `json:"name"`
	Address    string            `json:"address"`
	Prefixes   []string          `json:"prefixes"`
	Dials      bool              `json:"dials"` // this side dials it
	State      string            `json:"state"`
	Since      string            `json:"since"`
	Error      string            `json:"error,omitempty"`
	Link       string            `json:"link,omitempty"` // local -> remote of the channel
	Announced  int               `json:"announced"`      // its addresses this host accepted
	Refused    map[string]string `json:"refused,omitempty"`
	TheyRefuse map[string]string `json:"they_refuse,omitempty"`
	Flows      int               `json:"flows"` // connections on the rings through the relay to it (hostd/across)
	Relay      *RelayInfo        `json:"relay,omitempty"`
	BytesIn    uint64            `json:"bytes_in"`
	BytesOut   uint64            `json:"bytes_out"`
	Reconnects uint64            `json:"reconnects"`
	RTT        string            `json:"rtt,omitempty"`
}

// RelayInfo is the relay's part of a peer's listing (hostd/across fills it).
type RelayInfo struct {
	Link     string `json:"link"`  // up or down
	Conns    int    `json:"conns"` // connections across hosts with a record
	BytesOut uint64 `json:"bytes_out"`
	BytesIn  uint64 `json:"bytes_in"`
	Stalled  string `json:"stalled"`       // senders' waits for credit
	Links    uint64 `json:"links"`         // links made (reconnects + 1)
	Why      string `json:"why,omitempty"` // why the link is TCP, not RDMA (docs/rdma.md)
	// Gathered: of BytesOut, the bytes the RDMA link's NIC read straight
	// from guests' rings (zero copy, docs/rdma.md).
	Gathered uint64 `json:"gathered_out"`
}

// List describes every configured peer, by name.
func (r *Room) List() []Info {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Info
	for _, p := range r.peers {
		in := Info{Name: p.cfg.Name, Address: p.cfg.Address, Dials: p.dials, State: p.state, Error: p.err,
			Since: p.since.UTC().Format(time.RFC3339), Announced: len(p.accepted),
			BytesIn: p.in.Load(), BytesOut: p.out.Load(), Reconnects: p.reconnects}
		for _, q := range p.cfg.Prefixes {
			in.Prefixes = append(in.Prefixes, q.String())
		}
		if p.sess != nil {
			in.Link = p.sess.link
		}
		if p.rtt > 0 {
			in.RTT = p.rtt.String()
		}
		in.Refused, in.TheyRefuse = strs(p.refused), strs(p.theyRefuse)
		out = append(out, in)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func strs(m map[netip.Prefix]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	out := make(map[string]string, len(m))
	for a, v := range m {
		out[a.String()] = v
	}
	return out
}

// Close stops listening and dialing, closes every channel and waits.
func (r *Room) Close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	close(r.stop)
	if r.ln != nil {
		r.ln.Close()
	}
	for _, p := range r.peers {
		if p.sess != nil {
			p.sess.close()
		}
	}
	r.mu.Unlock()
	r.wg.Wait()
}
