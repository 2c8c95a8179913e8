package peers

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Back-off between dials of a peer that is down or refuses: doubling from
// minBackoff to maxBackoff, with a fifth of jitter.
const (
	minBackoff = 100 * time.Millisecond
	maxBackoff = 5 * time.Second
	handshake  = 5 * time.Second // bounds a dial plus its TLS handshake
	// maxHandshakes bounds the inbound channels in their TLS handshake at
	// once: before it, anyone who reaches the port is a stranger.
	maxHandshakes = 64
)

// session is one up channel. Writes are serialized and bounded by a
// deadline, so a peer that stops reading is dropped, never waited for.
// The cross-host room's messages go through a queue of their own and its
// writer (sendAsync), so the room's event loop never waits on a peer's
// socket: a peer that stops reading would stall it for every peer.
type session struct {
	c    net.Conn
	link string
	wmu  sync.Mutex
	wait time.Duration
	once sync.Once

	amu   sync.Mutex
	aq    []msg // the room's messages waiting for the writer
	dead  bool  // closed: nothing is queued any more
	awake chan struct{}
}

// maxAsync bounds the room's messages queued for one channel; a peer
// that lets more pile up is not reading, and its channel is closed.
const maxAsync = 4096

var errSlowPeer = errors.New("peer channel: the peer does not read its messages")

func (s *session) send(m msg) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	_ = s.c.SetWriteDeadline(time.Now().Add(s.wait))
	_, err := s.c.Write(appendMsg(nil, m))
	if err != nil {
		s.close()
	}
	return err
}

func (s *session) close() {
	s.once.Do(func() {
		s.amu.Lock()
		s.dead, s.aq = true, nil
		s.amu.Unlock()
		s.c.Close()
	})
}

// sendAsync queues m for the channel's writer (asyncWriter); it never
// blocks. An error says the channel is closed (or now closes: too many
// messages wait); nil does not say m arrived.
func (s *session) sendAsync(m msg) error {
	s.amu.Lock()
	switch {
	case s.dead:
		s.amu.Unlock()
		return net.ErrClosed
	case len(s.aq) >= maxAsync:
		s.amu.Unlock()
		s.close()
		return errSlowPeer
	}
	s.aq = append(s.aq, m)
	s.amu.Unlock()
	select {
	case s.awake <- struct{}{}:
	default:
	}
	return nil
}

// asyncWriter writes the queued messages, in order, until the channel
// ends (done).
func (s *session) asyncWriter(done chan struct{}) {
	for {
		select {
		case <-done:
			return
		case <-s.awake:
		}
		s.amu.Lock()
		q := s.aq
		s.aq = nil
		s.amu.Unlock()
		for _, m := range q {
			if s.send(m) != nil {
				return
			}
		}
	}
}

// counted counts a link's bytes (TLS records included) into its peer's
// counters and the metrics.
type counted struct {
	net.Conn
	in, out *atomic.Uint64
	m       *metricSet
	peer    string
}

func (c *counted) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.in.Add(uint64(n))
	c.m.bytes.WithLabelValues(c.peer, "in").Add(float64(n))
	return n, err
}

func (c *counted) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.out.Add(uint64(n))
	c.m.bytes.WithLabelValues(c.peer, "out").Add(float64(n))
	return n, err
}

// dialLoop keeps a channel to p, dialing with back-off while it is down
// or refuses, until p is removed or the room closes.
func (r *Room) dialLoop(p *peer) {
	defer r.wg.Done()
	delay := minBackoff
	for {
		r.mu.Lock()
		addr, name := p.cfg.Address, p.cfg.Name
		p.state = StateConnecting
		r.mu.Unlock()
		c, err := r.dial(p, addr, name)
		if err == nil {
			delay = minBackoff
			r.run(p, c)
		} else {
			r.mu.Lock()
			p.state, p.err, p.since = StateDown, err.Error(), time.Now()
			var tlsErr *tls.CertificateVerificationError
			if errors.As(err, &tlsErr) || errors.Is(err, errHandshake) {
				p.state = StateRefused
				r.m.refused.WithLabelValues(name, "tls").Inc()
			}
			r.mu.Unlock()
			r.log.Debug("peer unreachable; retrying", "peer", name, "address", addr, "in", delay, "error", err)
		}
		wait := delay + time.Duration(rand.Int64N(int64(delay)/5+1))
		delay = min(2*delay, maxBackoff)
		select {
		case <-r.stop:
			return
		case <-p.quit:
			return
		case <-time.After(wait):
		}
	}
}

var errHandshake = errors.New("TLS handshake failed")

// dial connects to a peer and makes the TLS handshake, expecting its
// certificate to carry name.
func (r *Room) dial(p *peer, addr, name string) (net.Conn, error) {
	var raw net.Conn
	d := net.Dialer{Timeout: handshake}
	if err := r.in(func() (err error) { raw, err = d.Dial("tcp", addr); return err }); err != nil {
		return nil, err
	}
	r.mu.Lock()
	cfg := r.cr.client(name)
	r.mu.Unlock()
	c := tls.Client(&counted{Conn: raw, in: &p.in, out: &p.out, m: r.m, peer: name}, cfg)
	_ = c.SetDeadline(time.Now().Add(handshake))
	if err := c.Handshake(); err != nil {
		c.Close()
		var ve *tls.CertificateVerificationError
		if errors.As(err, &ve) {
			return nil, err
		}
		return nil, fmt.Errorf("%w: %v", errHandshake, err)
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

// acceptLoop accepts peers until the listener closes; accept errors are
// retried with a pause (EMFILE must not stop it).
func (r *Room) acceptLoop(ln net.Listener) {
	defer r.wg.Done()
	busy := make(chan struct{}, maxHandshakes)
	for {
		c, err := ln.Accept()
		if err != nil {
			select {
			case <-r.stop:
				return
			default:
			}
			r.log.Warn("peering: accept failed; retrying", "error", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		select {
		case busy <- struct{}{}:
		default:
			r.m.refused.WithLabelValues("?", "busy").Inc()
			c.Close()
			continue
		}
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			r.accepted(c, func() { <-busy })
		}()
	}
}

// accepted makes the TLS handshake of an inbound channel and runs it if
// its certificate names a configured peer without a channel; done frees
// its handshake's place.
func (r *Room) accepted(raw net.Conn, done func()) {
	handshook := false
	defer func() {
		if !handshook {
			done()
		}
	}()
	var in, out atomic.Uint64
	cc := &counted{Conn: raw, in: &in, out: &out, m: r.m, peer: "?"}
	r.mu.Lock()
	cfg := r.cr.server()
	r.mu.Unlock()
	c := tls.Server(cc, cfg)
	_ = c.SetDeadline(time.Now().Add(handshake))
	if err := c.Handshake(); err != nil {
		r.m.refused.WithLabelValues("?", "tls").Inc()
		r.log.Warn("peering: refused a channel: TLS handshake failed", "remote", raw.RemoteAddr(), "error", err)
		c.Close()
		return
	}
	_ = c.SetDeadline(time.Time{})
	handshook = true
	done()
	names := c.ConnectionState().PeerCertificates[0].DNSNames
	r.mu.Lock()
	var p *peer
	for _, n := range names {
		if p = r.peers[n]; p != nil {
			break
		}
	}
	switch {
	case p == nil:
		r.mu.Unlock()
		r.m.refused.WithLabelValues("?", "unknown-peer").Inc()
		r.log.Warn("peering: refused a channel: its certificate names no configured peer", "remote", raw.RemoteAddr(), "names", names)
		c.Close()
		return
	case p.sess != nil:
		r.mu.Unlock()
		r.log.Debug("peering: a second channel from a peer that has one; closed", "peer", p.cfg.Name)
		c.Close()
		return
	}
	p.in.Add(in.Load())
	p.out.Add(out.Load())
	cc.in, cc.out, cc.peer = &p.in, &p.out, p.cfg.Name
	r.mu.Unlock()
	r.run(p, c)
}

// run serves an up channel to p until it ends: it says hello, announces
// this host's addresses, answers pings and takes p's announcements. A
// channel silent for 3 intervals is down.
func (r *Room) run(p *peer, c net.Conn) {
	r.mu.Lock()
	if r.closed || p.sess != nil || r.peers[p.cfg.Name] != p {
		r.mu.Unlock()
		c.Close()
		return
	}
	iv := r.cfg.Interval
	s := &session{c: c, wait: 3 * iv, link: fmt.Sprintf("%s -> %s", c.LocalAddr(), c.RemoteAddr()), awake: make(chan struct{}, 1)}
	p.sess, p.state, p.err, p.since = s, StateUp, "", time.Now()
	p.reconnects++
	local := r.local
	r.mu.Unlock()
	r.m.up.WithLabelValues(p.cfg.Name).Set(1)
	r.m.reconnects.WithLabelValues(p.cfg.Name).Inc()
	r.log.Info("peer up", "peer", p.cfg.Name, "link", s.link)
	if r.opts.State != nil {
		r.opts.State(p.cfg.Name, true)
	}

	done := make(chan struct{})
	go r.pinger(p, s, iv, done)
	go s.asyncWriter(done)
	err := s.send(msg{Type: tHello, Version: version})
	if err == nil {
		err = s.send(msg{Type: tAnnounce, Addrs: local})
	}
	br := bufio.NewReaderSize(c, maxLine)
	for err == nil {
		_ = c.SetReadDeadline(time.Now().Add(3 * iv))
		var m msg
		if m, err = readMsg(br); err == nil {
			err = r.handle(p, s, m)
		}
	}
	close(done)
	s.close()
	r.mu.Lock()
	p.sess, p.state, p.err, p.since = nil, StateDown, err.Error(), time.Now()
	p.accepted, p.refused, p.theyRefuse = nil, nil, nil
	endClaimsLocked(p)
	r.mu.Unlock()
	r.m.up.WithLabelValues(p.cfg.Name).Set(0)
	r.m.announced.WithLabelValues(p.cfg.Name).Set(0)
	r.log.Info("peer down; its addresses are withdrawn", "peer", p.cfg.Name, "error", err)
	if r.opts.State != nil {
		r.opts.State(p.cfg.Name, false)
	}
}

func (r *Room) pinger(p *peer, s *session, iv time.Duration, done chan struct{}) {
	t := time.NewTicker(iv)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			if s.send(msg{Type: tPing, Nonce: uint64(time.Now().UnixNano())}) != nil {
				return
			}
		}
	}
}

// handle takes one message of p's.
func (r *Room) handle(p *peer, s *session, m msg) error {
	switch m.Type {
	case tHello:
		if m.Version != version {
			return fmt.Errorf("peer speaks channel version %d, this hostd %d", m.Version, version)
		}
	case tPing:
		return s.send(msg{Type: tPong, Nonce: m.Nonce})
	case tClaim:
		return r.verify(p, s, m)
	case tVerdict:
		r.verdict(p, m)
	case tAcross:
		if r.opts.Across != nil {
			r.opts.Across(p.cfg.Name, *m.Across)
		}
	case tPong:
		if rtt := time.Since(time.Unix(0, int64(m.Nonce))); rtt >= 0 && rtt < time.Minute {
			r.mu.Lock()
			p.rtt = rtt
			r.mu.Unlock()
			r.m.rtt.WithLabelValues(p.cfg.Name).Set(rtt.Seconds())
		}
	case tRefused:
		r.mu.Lock()
		p.theyRefuse = map[netip.Prefix]string{}
		for _, a := range m.Refused {
			p.theyRefuse[a.Prefix] = a.Reason
		}
		r.mu.Unlock()
		r.log.Warn("peer refused addresses this host announced", "peer", p.cfg.Name, "refused", m.Refused)
	case tAnnounce:
		local := r.localOf(m.Addrs) // the broker's lock: never under r.mu
		r.mu.Lock()
		ok, no := r.filterLocked(p, m.Addrs, local)
		var withdrawn int
		for a := range p.accepted {
			if _, still := ok[a]; !still {
				withdrawn++
			}
		}
		p.accepted, p.refused = ok, no
		r.mu.Unlock()
		r.m.announced.WithLabelValues(p.cfg.Name).Set(float64(len(ok)))
		r.log.Info("peer announced its guests", "peer", p.cfg.Name, "accepted", len(ok), "withdrawn", withdrawn, "refused", len(no))
		byReason := map[string][]netip.Prefix{}
		var back []Refusal
		for a, why := range no {
			byReason[why] = append(byReason[why], a)
			back = append(back, Refusal{Prefix: a, Reason: why})
		}
		for why, addrs := range byReason {
			r.m.refused.WithLabelValues(p.cfg.Name, why).Add(float64(len(addrs)))
			r.log.Warn("refused addresses a peer announced", "peer", p.cfg.Name, "reason", why, "addrs", addrs)
		}
		// Always answered, so that the announcer's view of its refusals
		// is that of its last announcement.
		slices.SortFunc(back, func(a, b Refusal) int { return a.Prefix.Addr().Compare(b.Prefix.Addr()) })
		if err := s.send(msg{Type: tRefused, Refused: back}); err != nil {
			return err
		}
	}
	return nil
}
