package broker

import (
	"fmt"
	"net/netip"
	"sync/atomic"

	"github.com/shuntnet/shunt/shm/region"
)

// Guest is a guest the broker knows: from the configuration or from
// libvirt. Its fields are set before it is registered (New, AddGuest) and
// not changed after; only its addresses may change (SetAddrs).
type Guest struct {
	Name    string
	ID      uint32
	Group   *Group
	CTMark  uint32 // 0: not checked
	Ifindex int    // host-side interface, for the eBPF witness; 0: none
	Source  string // where it was declared: "config" or "libvirt"

	addrs atomic.Pointer[Addrs] // what it owns; swapped whole
}

// Addrs is what a guest owns: the prefixes routed to it (single addresses
// are full-length prefixes), except the host's own addresses on its link.
type Addrs struct {
	Prefixes []netip.Prefix
	Except   []netip.Addr
}

// SetAddrs replaces the addresses the guest owns. Safe for concurrent use.
func (g *Guest) SetAddrs(a Addrs) { g.addrs.Store(&a) }

// Prefixes returns the prefixes the guest owns.
func (g *Guest) Prefixes() []netip.Prefix {
	if a := g.addrs.Load(); a != nil {
		return a.Prefixes
	}
	return nil
}

// Owns reports whether a is one of the guest's addresses.
func (g *Guest) Owns(a netip.Addr) bool {
	as := g.addrs.Load()
	if as == nil {
		return false
	}
	a = a.Unmap()
	for _, x := range as.Except {
		if x == a {
			return false
		}
	}
	for _, p := range as.Prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Group is a trust group and its region. It is not changed after New.
type Group struct {
	Name   string
	Region string // path, for WELCOME
	Pool   *region.Pool
}

// AddGuest registers a guest that appeared while hostd runs (a libvirt
// domain that started). Its name and ID must be new.
func (b *Broker) AddGuest(g *Guest) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, o := range b.guests {
		if o.Name == g.Name || o.ID == g.ID {
			return fmt.Errorf("guest %s (id %d) clashes with guest %s (id %d)", g.Name, g.ID, o.Name, o.ID)
		}
	}
	b.guests = append(b.guests, g)
	return nil
}

// RemoveGuest forgets a guest that went away (its domain stopped): its
// flows are revoked and released on its side, so the peers see ECONNRESET
// and the rings go back to the pool once the peers close. Its sessions are
// the control server's to close.
func (b *Broker) RemoveGuest(g *Guest) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, o := range b.guests {
		if o == g {
			b.guests = append(b.guests[:i:i], b.guests[i+1:]...)
			break
		}
	}
	for _, f := range b.flows {
		if f.GuestA == g && f.released&region.SideA == 0 {
			b.goneLocked(f, region.SideA)
		}
		if f.GuestB == g && f.released&region.SideB == 0 {
			b.goneLocked(f, region.SideB)
		}
	}
}

func (b *Broker) guestByAddr(a netip.Addr) *Guest {
	for _, g := range b.guests {
		if g.Owns(a) {
			return g
		}
	}
	return nil
}

func (b *Broker) guestByID(id uint32) *Guest {
	for _, g := range b.guests {
		if g.ID == id {
			return g
		}
	}
	return nil
}

// sessionState is what the broker keeps per session.
type sessionState struct {
	listens map[netip.AddrPort]bool
}

// Attach registers a new session of a guest.
func (b *Broker) Attach(s Session) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.sessions[s] = &sessionState{listens: map[netip.AddrPort]bool{}}
}

// Detach removes a session whose guest went away: its listeners and waiting
// opens go, and its flows are revoked (the peer sees ECONNRESET) and
// released on its side. A no-op once the broker is closed (hostd stopping
// is not the guest going away).
func (b *Broker) Detach(s Session) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return
	}
	delete(b.sessions, s)
	for k, h := range b.waiting {
		if h.sess == s {
			h.timer.Stop()
			delete(b.waiting, k)
		}
	}
	for _, f := range b.flows {
		if f.sessA == s {
			b.goneLocked(f, region.SideA)
		}
		if f.sessB == s {
			b.goneLocked(f, region.SideB)
		}
	}
}

// Listen records that s accepts connections on addr (the unspecified
// address means all of the guest's addresses).
func (b *Broker) Listen(s Session, addr netip.AddrPort, on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if st := b.sessions[s]; st != nil {
		if on {
			st.listens[addr] = true
		} else {
			delete(st.listens, addr)
		}
	}
}

// listeningLocked reports whether any session of g listens on addr.
func (b *Broker) listeningLocked(g *Guest, addr netip.AddrPort) bool {
	any4 := netip.AddrPortFrom(netip.IPv4Unspecified(), addr.Port())
	any6 := netip.AddrPortFrom(netip.IPv6Unspecified(), addr.Port())
	for s, st := range b.sessions {
		if s.Guest() == g && (st.listens[addr] || st.listens[any4] || st.listens[any6]) {
			return true
		}
	}
	return false
}

func (b *Broker) hasSessionLocked(g *Guest) bool {
	for s := range b.sessions {
		if s.Guest() == g {
			return true
		}
	}
	return false
}
