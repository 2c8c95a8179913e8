package peers

import (
	"errors"
	"fmt"
	"time"
)

// ErrNoChannel is Claim's error when the peer's channel is not up.
var ErrNoChannel = errors.New("peering: no channel to the peer")

// Claim sends a claim to peer and waits up to wait for its verdict: the
// reason's name, "none" if the peer's hostd verified its half. Pairing
// across hosts is not built yet; this is its first step.
func (r *Room) Claim(peer string, c Claim, wait time.Duration) (string, error) {
	r.mu.Lock()
	p := r.peers[peer]
	if p == nil || p.sess == nil {
		r.mu.Unlock()
		return "", fmt.Errorf("%w %q", ErrNoChannel, peer)
	}
	if p.claims == nil {
		p.claims = map[uint64]chan string{}
	}
	p.nextClaim++
	id, ch, s := p.nextClaim, make(chan string, 1), p.sess
	p.claims[id] = ch
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(p.claims, id)
		r.mu.Unlock()
	}()
	if err := s.send(msg{Type: tClaim, ID: id, Claim: &c}); err != nil {
		return "", err
	}
	select {
	case v, ok := <-ch:
		if !ok {
			return "", fmt.Errorf("%w %q: it went down", ErrNoChannel, peer)
		}
		return v, nil
	case <-time.After(wait):
		return "", fmt.Errorf("peering: no verdict from %q within %s", peer, wait)
	}
}

// verify answers a peer's claim. Claims are answered in order, one at a
// time, on the channel's reader: a peer cannot have more in flight here
// than its channel carries, and each costs one conntrack lookup.
func (r *Room) verify(p *peer, s *session, m msg) error {
	v := "not-local"
	if r.opts.Verify != nil {
		v = r.opts.Verify(p.cfg.Name, *m.Claim)
	}
	if v != "none" {
		r.m.refused.WithLabelValues(p.cfg.Name, "claim-"+v).Inc()
		r.log.Warn("refused a peer's claim", "peer", p.cfg.Name, "claim", *m.Claim, "reason", v)
	}
	return s.send(msg{Type: tVerdict, ID: m.ID, Reason: v})
}

// verdict delivers the verdict on one of this host's claims.
func (r *Room) verdict(p *peer, m msg) {
	r.mu.Lock()
	ch := p.claims[m.ID]
	delete(p.claims, m.ID)
	r.mu.Unlock()
	if ch != nil {
		ch <- m.Reason
	}
}

// endClaimsLocked fails the claims waiting on a channel that went down.
func endClaimsLocked(p *peer) {
	for id, ch := range p.claims {
		close(ch)
		delete(p.claims, id)
	}
}

// SendAcross queues a message of the cross-host room for peer's channel
// and never waits (its writer writes it); it fails if the peer's channel
// is not up (the room resends what must arrive when the channel is back:
// State). A message queued when the channel then ends is lost with it.
func (r *Room) SendAcross(peer string, m Across) error {
	r.mu.Lock()
	p := r.peers[peer]
	var s *session
	if p != nil {
		s = p.sess
	}
	r.mu.Unlock()
	if s == nil {
		return fmt.Errorf("%w %q", ErrNoChannel, peer)
	}
	return s.sendAsync(msg{Type: tAcross, Across: &m}) // never waits: the room's event loop calls it
}

// Dials reports whether this host dials peer (its name sorts first): of
// the two, the dialer also dials the relay link and names the flows.
func (r *Room) Dials(peer string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.peers[peer]
	return p != nil && p.dials
}

// Address is peer's configured channel address (host:port).
func (r *Room) Address(peer string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.peers[peer]; p != nil {
		return p.cfg.Address
	}
	return ""
}
