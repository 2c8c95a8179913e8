package broker

import (
	"os"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
)

// Relayed connections after a SIGKILLed hostd (docs/crosshost.md,
// "A SIGKILLed hostd"). The relay ran in the dead hostd: its session
// guests (relay/PEER/GROUP) were numbered by that run, and the pair
// regions they shared with local guests hold the relayed connections'
// ring pairs, which those guests still use. The cross-host room of the
// new hostd adopts such a region with its own relay session for the same
// peer and trust group in the dead one's place, so the guest's REATTACH
// finds the flow, and the room can resume it on TCP once the peer host
// says where its ring ended.

// RelayIDBase is where relay session guests' ids start: above every
// configured (at most 2^31) and runtime guest's. hostd/across numbers its
// sessions from it; an id at or above it in a pair region's shadow is an
// earlier run's relay.
const RelayIDBase = 0xfff00000

// IsRelayID reports whether id is a relay session guest's.
func IsRelayID(id uint32) bool { return id >= RelayIDBase }

// AdoptedRelay is one flow of a relay pair region adopted by
// AdoptRelayPair: its slot (hostd's own record, from the shadow), the
// request id its relay end has, and the relay's side.
type AdoptedRelay struct {
	Slot region.Slot
	Req  uint32
	Side proto.Side
}

// AdoptRelayPair rebuilds the flows of a pair region an earlier hostd
// left whose one guest was a relay session of that run (any relay id):
// relay, this run's session for the same peer and trust group, takes its
// place, and each flow's relay end is attached to relay at once with a
// request id from req (relay gets the region's descriptor, as at a
// REGION). The local guest must still be a process guest of relay's
// group. It reports the adopted flows, or false if it keeps nothing (the
// caller drops the region then). The local guests have grace to
// REATTACH; a side that did not is gone then, as in Adopt.
func (b *Broker) AdoptRelayPair(m region.Meta, pool *region.Pool, f *os.File, relay Relay, req func() uint32, grace time.Duration) ([]AdoptedRelay, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	rg := b.guestLocked(relay)
	byID := func(id uint32) *Guest {
		if IsRelayID(id) {
			return rg
		}
		if g := b.guestByID(id); g != nil && !g.Relay && !g.SharedRegion {
			return g
		}
		return nil
	}
	if rg == nil || b.sessions[relay] == nil || IsRelayID(m.GuestA) == IsRelayID(m.GuestB) {
		return nil, false
	}
	r := b.adoptPairLocked(m, pool, f, byID)
	if r == nil {
		return nil, false
	}
	var out []AdoptedRelay
	for _, s := range pool.Live() {
		fl := b.flows[flowID{r.Group.Name, r.ID, s.Index}]
		if fl == nil || fl.Region != r || fl.conn == nil {
			continue
		}
		side, pside := uint32(region.SideA), proto.SideA
		sess := &fl.sessA
		if fl.GuestB == rg {
			side, pside, sess = region.SideB, proto.SideB, &fl.sessB
		}
		if fl.released&side != 0 {
			continue // the dead relay had left it: the guest's LEFT frees it
		}
		c := fl.conn
		e := c.end(side)
		e.sess, e.req, e.done = relay, req(), false
		*sess = relay
		b.sessions[relay].conns[e.req] = c
		b.holdLocked(relay, r, true)
		out = append(out, AdoptedRelay{Slot: s, Req: e.req, Side: pside})
	}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-t.C:
			b.mu.Lock()
			defer b.mu.Unlock()
			if !b.closed {
				b.adoptGraceOverLocked(func(f *Flow) bool { return f.Region == r })
			}
		case <-b.stop:
		}
	}()
	return out, true
}

// guestLocked is s's guest if s is a registered session.
func (b *Broker) guestLocked(s Session) *Guest {
	if b.sessions[s] == nil {
		return nil
	}
	return s.Guest()
}

// AcrossAttached reports whether the guest end of the connection whose
// relay end is (relay, req) has a session on its ring pair: RESUME can
// reach it (an adopted flow's guest has not reattached yet otherwise).
func (b *Broker) AcrossAttached(relay Session, req uint32) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	c, side := b.relayConnLocked(relay, req)
	if side == 0 || c.flow == nil {
		return false
	}
	other := otherSide(side)
	return c.end(other).sess != nil && c.flow.released&other == 0
}

// GuestByID is the registered guest with id, or nil.
func (b *Broker) GuestByID(id uint32) *Guest {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.guestByID(id)
}
