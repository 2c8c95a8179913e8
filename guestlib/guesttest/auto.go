package guesttest

import (
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
)

// Auto serves sessions on its own until the test ends, as a version-3
// hostd: HELLO gets WELCOME, PING gets PONG, and the active and passive
// OPEN of one connection are paired. While Fast (the default), a pair
// gets a ring pair (READY to both); SetFast(false) sends DOWN for every
// flow and TCP(policy) to new pairs, and SetFast(true) sends READY again
// to every connection whose ends have both left their last rings (LEFT or
// CLOSE). A repeated OPEN (after a reconnect) replaces its end's session.
// A KICK goes to the end it names.
type Auto struct {
	h *Hostd
	// Seen carries what the libraries send, for checks (dropped when
	// nobody reads and 1024 wait).
	Seen chan proto.Msg

	mu    sync.Mutex
	fast  bool
	wait  []opener // OPENs without their other end yet
	conns []*autoConn
	stats AutoStats
}

// AutoStats counts what Auto did.
type AutoStats struct{ Readies, Downs, TCPs, Lefts, Closes int }

type opener struct {
	s *Session
	m proto.Msg
}

// autoConn is one paired connection: its two ends and its rings.
type autoConn struct {
	end    [2]opener // active, passive
	flow   *Flow     // nil while on TCP
	down   bool      // DOWN sent for flow
	left   [2]bool   // each end left flow (LEFT or CLOSE)
	closed [2]bool
}

// Auto starts serving.
func (h *Hostd) Auto(t testing.TB) *Auto {
	a := &Auto{h: h, Seen: make(chan proto.Msg, 1024), fast: true}
	go func() {
		for c := range h.conns {
			go a.serve(h.track(c))
		}
	}()
	return a
}

// Stats returns the counts so far.
func (a *Auto) Stats() AutoStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.stats
}

// SetFast moves every connection to the rings (true) or to TCP (false),
// as a policy reload would.
func (a *Auto) SetFast(fast bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.fast = fast
	for _, c := range a.conns {
		if fast {
			a.upLocked(c)
		} else {
			a.downLocked(c, proto.ReasonPolicyReload)
		}
	}
}

// Held reports how many connections hold rings now.
func (a *Auto) Held() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, c := range a.conns {
		if c.flow != nil {
			n++
		}
	}
	return n
}

func (a *Auto) serve(s *Session) {
	for {
		m, err := s.read(time.Hour)
		if err != nil {
			return
		}
		select {
		case a.Seen <- m:
		default:
		}
		a.mu.Lock()
		switch m.Type {
		case proto.Hello:
			a.h.guestID++
			s.write(a.h.welcome())
		case proto.Ping:
			s.write(proto.Msg{Type: proto.Pong, Nonce: m.Nonce})
		case proto.Open:
			a.openLocked(s, m)
		case proto.Left:
			a.stats.Lefts++
			a.leftLocked(s, m, false)
		case proto.Close:
			a.stats.Closes++
			a.leftLocked(s, m, true)
		case proto.Kick:
			a.kickLocked(m)
		}
		a.mu.Unlock()
	}
}

func (a *Auto) openLocked(s *Session, m proto.Msg) {
	i := 0
	if m.Role == proto.Passive {
		i = 1
	}
	for _, c := range a.conns { // a repeated OPEN
		if o := c.end[i]; o.m.Local == m.Local && o.m.Remote == m.Remote {
			c.end[i] = opener{s, m}
			a.upLocked(c)
			return
		}
	}
	for j, o := range a.wait {
		act, pas := o, opener{s, m}
		if m.Role == proto.Active {
			act, pas = pas, act
		}
		if act.m.Role == pas.m.Role || !SameConn(act.m, pas.m) {
			continue
		}
		a.wait = append(a.wait[:j], a.wait[j+1:]...)
		c := &autoConn{end: [2]opener{act, pas}}
		a.conns = append(a.conns, c)
		if !a.fast {
			for _, e := range c.end {
				a.stats.TCPs++
				e.s.write(proto.Msg{Type: proto.TCP, ReqID: e.m.ReqID, Reason: proto.ReasonPolicy})
			}
		}
		a.upLocked(c)
		return
	}
	a.wait = append(a.wait, opener{s, m})
}

// upLocked gives c rings if it may have them.
func (a *Auto) upLocked(c *autoConn) {
	if !a.fast || c.flow != nil || c.closed[0] || c.closed[1] {
		return
	}
	f, err := alloc(a.h.Pool, 0, a.h.Capacity, c.end[0].m, c.end[1].m)
	if err != nil {
		for _, e := range c.end {
			e.s.write(proto.Msg{Type: proto.TCP, ReqID: e.m.ReqID, Reason: proto.ReasonNoSpace})
		}
		return
	}
	c.flow, c.down, c.left = &f, false, [2]bool{}
	a.stats.Readies++
	c.end[0].s.write(f.A)
	c.end[1].s.write(f.B)
}

func (a *Auto) downLocked(c *autoConn, r proto.Reason) {
	if c.flow == nil || c.down {
		return
	}
	c.down = true
	a.stats.Downs++
	for i, e := range c.end {
		if !c.left[i] {
			e.s.write(Down([2]proto.Msg{c.flow.A, c.flow.B}[i], r))
		}
	}
}

// leftLocked is a LEFT or CLOSE from one end.
func (a *Auto) leftLocked(s *Session, m proto.Msg, closing bool) {
	for _, c := range a.conns {
		for i, e := range c.end {
			if e.s != s || e.m.ReqID != m.ReqID {
				continue
			}
			if closing {
				c.closed[i] = true
			}
			f := c.flow
			if f == nil || (m.Slot != f.A.Slot || m.Gen != f.A.Gen) && !closing {
				return
			}
			if !c.left[i] {
				c.left[i] = true
				_, _ = a.h.Pool.Release(int(f.A.Slot), f.A.Gen, uint32(i+1))
			}
			if c.left[0] && c.left[1] {
				c.flow = nil
				a.upLocked(c)
			}
			return
		}
	}
}

// write is Send for Auto's goroutines, which cannot fail a test.
func (s *Session) write(m proto.Msg) {
	_ = s.conn.SetWriteDeadline(time.Now().Add(Wait))
	_ = proto.Write(s.conn, &m)
}
