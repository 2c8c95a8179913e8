package across

import (
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
)

// Options are what the room needs from hostd.
type Options struct {
	Log hclog.Logger
	// In runs fn in the network namespace of the relay link's sockets
	// (the host's: conntrack_netns), as the peers channel does; nil: here.
	In func(fn func() error) error
	// PairingTimeout bounds how long a half waits for the peer's (the
	// broker's own bound; the room forgets unpaired state after twice it).
	PairingTimeout time.Duration
	// ResumeTimeout bounds how long a stopped stretch waits for the peer
	// host to say where its ring ended; then the guest's connection is
	// reset (proto.ResumeReset). 0: 60 s.
	ResumeTimeout time.Duration
	// LinkConns is how many TCP connections a relay link has; 0: 2.
	LinkConns int
	// RDMA opens a queue pair for a new relay link (relay/ibv); nil, or
	// an error (no device, a hostd built without -tags rdma): this host
	// offers no RDMA, and the link is TCP (relay.NegotiateRDMA,
	// docs/rdma.md).
	RDMA func() (relay.Verbs, error)
	// RDMALink tunes the RDMA links (zero value: the relay's defaults).
	RDMALink relay.RDMAOptions
	// Registerer takes the relay's metrics; nil: none are registered.
	Registerer prometheus.Registerer
}

// Room is the cross-host room. It implements broker.Across.
type Room struct {
	log   hclog.Logger
	opts  Options
	m     *metricSet
	b     *broker.Broker
	peers *peers.Room
	ln    *relay.LinkListener // nil: this host accepts no link (it dials all)

	// Everything below is owned by the event loop (run): events are
	// functions queued by the broker's and the peers' callbacks, so that
	// neither ever waits for this room, and the room calls the broker
	// without holding any lock of its own.
	qmu    sync.Mutex
	q      []func()
	held   map[string]int // each peer's messages queued (fromPeer)
	unheld *sync.Cond     // on qmu: a peer's message left the queue, or the room closed
	wake   chan struct{}
	stop   chan struct{}
	wg     sync.WaitGroup
	closed bool

	nextID   uint64
	conns    map[uint64]*xconn       // by this host's id
	byWire   map[ctrack.Tuple]*xconn // by the connection as between the hosts (Src: the local guest)
	pending  map[pendKey]claim       // peers' claims that came before this host's half
	npending map[string]int          // how many of them each peer has
	sessions map[sessKey]*session
	links    map[string]*plink // by peer
	nextGID  uint32
}

// claim is a peer's claim waiting for this host's half.
type claim struct {
	peer string
	id   uint64
	c    peers.Claim
	at   time.Time
}

// New makes the room. Start it with Start once the peers channel runs
// (the channel's callbacks need the room first: Callbacks).
func New(b *broker.Broker, o Options) *Room {
	if o.Log == nil {
		o.Log = hclog.NewNullLogger()
	}
	if o.ResumeTimeout <= 0 {
		o.ResumeTimeout = 60 * time.Second
	}
	if o.LinkConns <= 0 {
		o.LinkConns = 2
	}
	if o.PairingTimeout <= 0 {
		o.PairingTimeout = 2 * time.Second
	}
	r := &Room{log: o.Log, opts: o, b: b, m: newMetrics(o.Registerer), wake: make(chan struct{}, 1), stop: make(chan struct{}),
		conns: map[uint64]*xconn{}, byWire: map[ctrack.Tuple]*xconn{}, pending: map[pendKey]claim{}, npending: map[string]int{},
		sessions: map[sessKey]*session{}, links: map[string]*plink{}, held: map[string]int{}}
	r.unheld = sync.NewCond(&r.qmu)
	return r
}

// Callbacks fills the peers channel's options that lead to this room.
func (r *Room) Callbacks(o *peers.Options) {
	o.Across = r.fromPeer
	o.State = func(peer string, up bool) { r.post(func() { r.peerState(peer, up) }) }
}

// Start runs the room over the peers channel p. listen is the address the
// relay link listener binds (host:0 picks a port); "" accepts no link.
func (r *Room) Start(p *peers.Room, listen string) error {
	r.peers = p
	if listen != "" {
		var ln net.Listener
		err := r.in(func() (err error) { ln, err = net.Listen("tcp", listen); return err })
		if err != nil {
			return err
		}
		r.ln = relay.ListenLinks(ln)
		r.log.Info("relay link listener", "address", ln.Addr())
	}
	r.wg.Add(1)
	go r.run()
	return nil
}

func (r *Room) in(fn func() error) error {
	if r.opts.In == nil {
		return fn()
	}
	return r.opts.In(fn)
}

// post queues fn for the event loop. It never blocks.
func (r *Room) post(fn func()) {
	r.qmu.Lock()
	if r.closed {
		r.qmu.Unlock()
		return
	}
	r.q = append(r.q, fn)
	r.qmu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// maxQueued bounds each peer's messages queued for the event loop.
const maxQueued = 1024

// fromPeer queues one of a peer's messages. It runs on that peer's
// channel reader, which it holds back while maxQueued of the peer's
// messages wait: a peer that sends faster than the loop takes them is
// slowed on its own channel (TCP's flow control), never queued without
// bound, and the other peers' messages are not held behind its.
func (r *Room) fromPeer(peer string, m peers.Across) {
	r.qmu.Lock()
	for r.held[peer] >= maxQueued && !r.closed {
		r.unheld.Wait()
	}
	r.held[peer]++
	r.qmu.Unlock()
	r.post(func() {
		r.qmu.Lock()
		if r.held[peer]--; r.held[peer] == 0 {
			delete(r.held, peer)
		}
		r.unheld.Broadcast()
		r.qmu.Unlock()
		r.message(peer, m)
	})
}

// run is the event loop.
func (r *Room) run() {
	defer r.wg.Done()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-tick.C:
			r.sweep()
			r.refresh()
		case <-r.wake:
		}
		for {
			r.qmu.Lock()
			q := r.q
			r.q = nil
			r.qmu.Unlock()
			if len(q) == 0 {
				break
			}
			for _, fn := range q {
				fn()
			}
		}
	}
}

// Close stops the room: its links close, so bridges stop and the peer
// hosts downgrade their ends; local guests were downgraded by the
// broker's shutdown before.
func (r *Room) Close() {
	r.qmu.Lock()
	if r.closed {
		r.qmu.Unlock()
		return
	}
	r.closed = true
	r.unheld.Broadcast()
	r.qmu.Unlock()
	close(r.stop)
	r.wg.Wait()
	if r.ln != nil {
		r.ln.Close()
	}
	for _, l := range r.links {
		l.close()
	}
}

// Route is broker.Remote's: the peers channel's answer. Called under the
// broker's lock: it only reads the channel's state.
func (r *Room) Route(addr netip.Addr) (string, bool, bool) {
	if r.peers == nil {
		return "", false, false
	}
	rt, ok := r.peers.Route(addr)
	return rt.Peer, rt.Up, ok
}

// Offer is broker.Across's: a verified local half (under the broker's lock).
func (r *Room) Offer(o broker.Offer) { r.post(func() { r.offer(o) }) }

// sweep forgets pairing state that outlived the broker's wait for it,
// and ends stopped stretches whose peer never said where its ring ended.
func (r *Room) sweep() {
	now := time.Now()
	for k, c := range r.pending {
		if now.Sub(c.at) > 2*r.opts.PairingTimeout {
			r.unpend(k)
		}
	}
	for _, x := range r.conns {
		if x.paired && !x.retryAt.IsZero() && now.After(x.retryAt) {
			x.retryAt = time.Time{}
			r.b.RetryAcrossConn(x.s, x.req)
		}
		switch {
		case x.paired && x.rdy && x.st != nil && x.st.flow == 0 && now.Sub(x.st.readyAt) > readyWait:
			// The peer's end is not ready (its own rules keep it on TCP):
			// give the stretch up, so this guest's reader holds no kernel
			// EOF for it; the peer's next READY (up) tries again, and so
			// does this host after a while, should that "up" have crossed
			// this host's own give-up (both hosts then wait on the other).
			x.rdy = false
			r.b.DowngradeAcross(x.s, x.req, proto.ReasonTimeout)
			r.retryLater(x, now)
		case !x.paired && now.Sub(x.at) > 2*r.opts.PairingTimeout:
			r.forget(x)
		case x.st != nil && x.st.orphan && x.st.theirs != nil:
			r.finish(x) // its guest had not reattached (adopt.go)
		case x.st != nil && x.st.stoppedAt != (time.Time{}) && x.st.theirs == nil && now.Sub(x.st.stoppedAt) > r.opts.ResumeTimeout:
			r.log.Warn("the peer host never said where its ring ended: the connection is reset", "conn", x, "peer", x.peer)
			x.st.theirs = &peerEnd{reset: true}
			r.finish(x)
		}
	}
}

// retryLater schedules x's next try of the rings after a timeout: 1 s,
// doubling up to 32 s while the peer's end stays unready.
func (r *Room) retryLater(x *xconn, now time.Time) {
	x.retryAt = now.Add(time.Second << min(x.retries, 5))
	x.retries++
}

// message dispatches one of a peer's messages.
func (r *Room) message(peer string, m peers.Across) {
	switch m.Op {
	case opHalf:
		r.half(peer, m)
	case opOK, opRefused:
		r.verdict(peer, m)
	case opUp:
		r.up(peer, m)
	case opGo:
		r.goStretch(peer, m)
	case opStop:
		r.stopped(peer, m)
	case opAttached:
		r.attached(peer, m)
	case opClose:
		if x := r.mine(peer, m); x != nil {
			r.peerClosed(x)
		}
	case opLink:
		r.linkOffer(peer, m)
	case opLinkPort:
		r.linkPort(peer, m)
	default:
		r.log.Warn("a peer sent an unknown cross-host message", "peer", peer, "op", m.Op)
	}
}

// mine is the connection a peer's message names (its Peer field is this
// host's id), if it is that peer's.
func (r *Room) mine(peer string, m peers.Across) *xconn {
	x := r.conns[m.Peer]
	if x == nil || x.peer != peer {
		return nil
	}
	return x
}

// send sends a message to peer; false if its channel is down.
func (r *Room) send(peer string, m peers.Across) bool {
	if err := r.peers.SendAcross(peer, m); err != nil {
		r.log.Debug("cannot reach a peer host", "peer", peer, "op", m.Op, "error", err)
		return false
	}
	return true
}

// peerState follows a peer's channel: down, its connections leave the
// rings and their unpaired halves go to TCP; up, this host (if it dials)
// sets the relay link up again, and stopped stretches resend their ends.
func (r *Room) peerState(peer string, up bool) {
	l := r.link(peer)
	if !up {
		l.close()
		for _, x := range r.conns {
			if x.peer != peer || x.st != nil && x.st.orphan {
				continue // an adopted stretch waits for the peer's stop through its channel's ups and downs
			}
			if !x.paired {
				r.b.RefuseAcross(x.key, proto.ReasonPeerUnreachable)
				r.forget(x)
				continue
			}
			r.b.DowngradeAcross(x.s, x.req, proto.ReasonPeerUnreachable)
		}
		return
	}
	for _, x := range r.conns {
		if x.peer == peer && x.st != nil && !x.st.orphan && x.st.stoppedAt != (time.Time{}) && x.st.theirs == nil {
			r.sendStop(x)
		}
	}
	if r.peers.Dials(peer) {
		r.dialLink(l)
	}
}

// reasonNamed parses a reason's name as a peer sends it.
func reasonNamed(s string) proto.Reason {
	for _, x := range proto.Reasons() {
		if x.String() == s {
			return x
		}
	}
	return proto.ReasonInternal
}
