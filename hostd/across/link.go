package across

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
)

var errNoRegion = errors.New("across: the relay has no mapping of the ring pair's region")

// plink is the relay link to one peer. Of two peers, the one that dials
// the channel also dials the link: it sends a fresh token over the
// channel ("link"), the other expects connections presenting it and
// answers with its listener's port ("linkport").
type plink struct {
	peer    string
	l       relay.Carrier
	up      atomic.Bool // l is set: read by the relay sessions' Gate under the broker's lock
	gen     uint64      // bumps at every new link or close, so stale results are dropped
	dialing bool
	flows   map[uint32]*xconn
	next    uint32
	token   []byte
	made    uint64        // links made
	expect  chan struct{} // closed to cancel the pending wait for the peer's connections
	// transport is the link's: "tcp" or "rdma", with why it is TCP (the
	// negotiation's reason); noRDMA: this host offers no RDMA to this
	// peer until then (an RDMA setup failed, or an RDMA link ended).
	transport, why string
	noRDMA         time.Time
	noRDMAWhy      string // why: the RDMA setup's error or the last RDMA link's end
}

// rdmaBackoff is how long a peer's links stay TCP after an RDMA setup
// failed or an RDMA link ended.
const rdmaBackoff = time.Minute

func (r *Room) link(peer string) *plink {
	l := r.links[peer]
	if l == nil {
		l = &plink{peer: peer, flows: map[uint32]*xconn{}}
		r.links[peer] = l
	}
	return l
}

// newFlow names a link flow not in use.
func (l *plink) newFlow() uint32 {
	for {
		l.next++
		if l.next != 0 && l.flows[l.next] == nil {
			return l.next
		}
	}
}

func (l *plink) close() {
	l.gen++
	l.up.Store(false)
	if l.l != nil {
		l.l.Close()
		l.l = nil
	}
	l.dialing, l.token = false, nil
	if l.expect != nil {
		close(l.expect)
		l.expect = nil
	}
}

// dialLink starts setting up the link to a peer this host dials.
func (r *Room) dialLink(l *plink) {
	if l.l != nil || l.dialing {
		return
	}
	tok := make([]byte, relay.TokenSize)
	_, _ = rand.Read(tok)
	l.dialing, l.token = true, tok
	if !r.send(l.peer, peers.Across{Op: opLink, Token: tok}) {
		l.dialing = false
	}
}

// linkOffer: the dialing peer's token. Expect its connections, and say
// where to make them. A new offer replaces the last (its wait ends), so a
// peer's offers never pile up; a peer this host dials makes none.
func (r *Room) linkOffer(peer string, m peers.Across) {
	if r.ln == nil || len(m.Token) != relay.TokenSize || r.peers.Dials(peer) {
		r.log.Warn("a peer host offers a relay link this host cannot accept (no listener, a bad token, or this host dials it)", "peer", peer)
		return
	}
	l := r.link(peer)
	l.close()
	want, err := r.ln.Want(m.Token, r.opts.LinkConns) // before the port goes out: the peer may dial at once
	if err != nil {
		r.log.Warn("cannot expect a relay link", "peer", peer, "error", err)
		return
	}
	gen, open, cancel := l.gen, r.rdmaOpen(l), make(chan struct{})
	l.expect = cancel
	go func() {
		conns, err := want.Wait(10*time.Second, cancel)
		c := carry(conns, err, open, r.opts.RDMALink)
		r.post(func() { r.linked(l, gen, c) })
	}()
	r.send(peer, peers.Across{Op: opLinkPort, Port: r.ln.Port()})
}

// linkPort: where the peer expects this host's link connections.
func (r *Room) linkPort(peer string, m peers.Across) {
	l := r.link(peer)
	if !l.dialing || l.token == nil || m.Port == 0 {
		return // only the first answer to an offer is dialed
	}
	host, _, err := net.SplitHostPort(r.peers.Address(peer))
	if err != nil {
		r.log.Warn("a peer's address has no host", "peer", peer, "error", err)
		return
	}
	addr := net.JoinHostPort(host, strconv.Itoa(int(m.Port)))
	tok, gen, n, open := l.token, l.gen, r.opts.LinkConns, r.rdmaOpen(l)
	l.token = nil
	go func() {
		d := net.Dialer{Timeout: 5 * time.Second}
		conns, err := relay.DialLink(func() (c net.Conn, err error) {
			err = r.in(func() error { c, err = d.Dial("tcp", addr); return err })
			return c, err
		}, tok, n)
		c := carry(conns, err, open, r.opts.RDMALink)
		r.post(func() { r.linked(l, gen, c) })
	}()
}

// rdmaOpen is what this host offers a new link to l's peer: its RDMA
// opener, unless RDMA to it is backing off.
func (r *Room) rdmaOpen(l *plink) func() (relay.Verbs, error) {
	if r.opts.RDMA == nil {
		return nil
	}
	if left := time.Until(l.noRDMA); left > 0 {
		err := fmt.Errorf("RDMA to this peer is off for %s more: %s", left.Round(time.Second), l.noRDMAWhy)
		return func() (relay.Verbs, error) { return nil, err }
	}
	return r.opts.RDMA
}

// carried is a link's transport made on its connections, or why not.
type carried struct {
	lk         relay.Carrier
	transport  string
	why        string // why the link is TCP
	n          int    // connections
	err        error
	rdmaFailed bool // the RDMA setup failed after both offered: no RDMA for a while
}

// carry picks the transport on a link's fresh connections, on the setup
// goroutine: RDMA if both hosts offer it, else TCP on the same
// connections (relay.NegotiateRDMA). A failed RDMA setup spends them.
func carry(conns []net.Conn, err error, open func() (relay.Verbs, error), o relay.RDMAOptions) carried {
	if err != nil {
		return carried{err: err}
	}
	rl, err := relay.NegotiateRDMA(conns[0], open, o)
	switch {
	case err == nil:
		for _, c := range conns[1:] {
			c.Close()
		}
		return carried{lk: rl, transport: "rdma", n: 1}
	case errors.Is(err, relay.ErrUseTCP):
		return carried{lk: relay.NewLink(conns, relay.LinkOptions{}), transport: "tcp", why: err.Error(), n: len(conns)}
	}
	for _, c := range conns {
		c.Close()
	}
	return carried{err: err, rdmaFailed: true}
}

// linked: a link's connections are made and its transport picked (or
// not).
func (r *Room) linked(l *plink, gen uint64, c carried) {
	if gen != l.gen || l.l != nil {
		if c.lk != nil {
			c.lk.Close()
		}
		return
	}
	l.dialing = false
	if err := c.err; err != nil {
		if c.rdmaFailed {
			l.noRDMA, l.noRDMAWhy = time.Now().Add(rdmaBackoff), "its setup failed: "+err.Error()
			r.log.Warn("the relay link's RDMA setup failed: TCP for a while", "peer", l.peer, "error", err, "for", rdmaBackoff)
		}
		r.log.Warn("no relay link to a peer host; its connections stay on TCP", "peer", l.peer, "error", err)
		if r.peers.Dials(l.peer) {
			time.AfterFunc(time.Second, func() { r.post(func() { r.retryLink(l, gen) }) })
		}
		return
	}
	l.l, l.transport, l.why = c.lk, c.transport, c.why
	l.up.Store(true)
	l.made++
	r.m.links.WithLabelValues(l.peer).Inc()
	r.m.lastBytes[l.peer], r.m.lastStall[l.peer], r.m.lastGath[l.peer] = [2]uint64{}, 0, 0
	r.log.Info("relay link up", "peer", l.peer, "transport", c.transport, "why", c.why, "conns", c.n)
	lk := l.l
	go func() {
		lk.Wait()
		r.post(func() { r.linkDown(l, lk) })
	}()
	r.registerAll(l.peer)
	for _, s := range r.sessions {
		if s.peer == l.peer {
			r.b.RetryAcross(s)
		}
	}
	for _, x := range r.conns {
		if x.peer == l.peer {
			r.maybeGo(x)
		}
	}
}

func errString(err error) string {
	if err == nil {
		return "closed"
	}
	return err.Error()
}

func (r *Room) retryLink(l *plink, gen uint64) {
	if gen == l.gen && l.l == nil {
		r.dialLink(l)
	}
}

// linkDown: a link ended (cut, the peer's relay gone). Its bridges stop
// by themselves; this host dials a new one if it dials.
func (r *Room) linkDown(l *plink, lk relay.Carrier) {
	if l.l != lk {
		return
	}
	r.log.Warn("relay link down; its connections leave the rings", "peer", l.peer, "transport", l.transport, "error", lk.Err())
	if l.transport == "rdma" {
		l.noRDMA, l.noRDMAWhy = time.Now().Add(rdmaBackoff), "the last RDMA link ended: "+errString(lk.Err())
	}
	l.close()
	for _, x := range l.flows {
		if x.st != nil && x.st.stoppedAt == (time.Time{}) {
			r.b.DowngradeAcross(x.s, x.req, proto.ReasonPeerUnreachable)
		}
	}
	if r.peers.Dials(l.peer) {
		gen := l.gen
		time.AfterFunc(time.Second, func() { r.post(func() { r.retryLink(l, gen) }) })
	}
}
