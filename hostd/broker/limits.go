package broker

import (
	"container/list"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/hostd/metrics"
)

// Limits bound what one guest may hold of the broker, so that no guest can
// starve the others (hostd.hcl's limits block). A zero field takes its
// default (DefaultLimits).
type Limits struct {
	ListensPerSession    int // LISTENs one session holds; beyond: ignored
	ListensPerGuest      int // LISTENs all of a guest's sessions hold; beyond: ignored
	PendingOpensPerGuest int // OPENs in verification or waiting for the peer; beyond: TCP(control-limit)
	// OpensPerSecond paces a guest's OPENs, each of which costs a
	// conntrack lookup: a burst of as many, then this many a second;
	// beyond: TCP(control-limit), before any lookup.
	OpensPerSecond int
}

// DefaultLimits are hostd.hcl's defaults (hostd/config.DefaultLimits).
var DefaultLimits = Limits{ListensPerSession: 1024, ListensPerGuest: 4096, PendingOpensPerGuest: 4096, OpensPerSecond: 5000}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits
	if l.ListensPerSession <= 0 {
		l.ListensPerSession = d.ListensPerSession
	}
	if l.ListensPerGuest <= 0 {
		l.ListensPerGuest = d.ListensPerGuest
	}
	if l.PendingOpensPerGuest <= 0 {
		l.PendingOpensPerGuest = d.PendingOpensPerGuest
	}
	if l.OpensPerSecond <= 0 {
		l.OpensPerSecond = d.OpensPerSecond
	}
	return l
}

// usage is what a guest holds of the control plane, counted against its
// limits. The zero value is ready. pending is atomic, so that an OPEN over
// the limit is refused without the broker's lock; the rest is guarded by
// the broker's mutex.
type usage struct {
	pending atomic.Int32 // OPENs in verification or waiting for their peer
	opens   tokens       // paces its OPENs (OpensPerSecond)

	sessions int                    // attached sessions
	listens  map[netip.AddrPort]int // address -> how many of its sessions listen there
	nlistens int                    // LISTENs over all its sessions

	logs [len(limitKinds)]limitLog // by limitKinds index
}

var limitKinds = [...]string{metrics.LimitSessions, metrics.LimitListens, metrics.LimitOpens, metrics.LimitOpenRate}

// tokens is a token bucket. The zero value is full at its first take.
type tokens struct {
	mu   sync.Mutex
	have float64
	last time.Time
}

// take takes one token from a bucket of burst tokens refilled at rate a
// second; it reports false if there is none.
func (t *tokens) take(now time.Time, rate, burst float64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.last.IsZero() {
		t.have = burst
	} else {
		t.have = min(burst, t.have+now.Sub(t.last).Seconds()*rate)
	}
	t.last = now
	if t.have < 1 {
		return false
	}
	t.have--
	return true
}

// limitLog keeps the log of one limit of one guest short: the first hit
// is logged at once, later ones at most once a minute, with their count.
type limitLog struct {
	mu   sync.Mutex
	last time.Time
	more int
}

const limitLogEvery = time.Minute

// hit records a hit; it says whether to log it, and how many hits went
// unlogged before it.
func (l *limitLog) hit(now time.Time) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.last.IsZero() && now.Sub(l.last) < limitLogEvery {
		l.more++
		return false, 0
	}
	more := l.more
	l.last, l.more = now, 0
	return true, more
}

// Limited counts a request of guest g refused (or dropped) for the limit
// of kind (metrics.LimitSessions, ...), and logs it: once, then at most
// once a minute per guest and kind. Safe for concurrent use; the control
// server calls it for session limits.
func (b *Broker) Limited(g *Guest, kind string, limit int) {
	b.m.Limited.WithLabelValues(kind).Inc()
	for i, k := range limitKinds {
		if k != kind {
			continue
		}
		if ok, more := g.ctl.logs[i].hit(time.Now()); ok {
			b.log.Warn("guest is over a control-plane limit; its requests beyond it are refused (counted in shunt_control_limited_total)",
				"guest", g.Name, "kind", kind, "limit", limit, "unlogged_before", more)
		}
	}
}

// admitOpen counts an OPEN of g as pending, if g is under its limits.
func (b *Broker) admitOpen(g *Guest) bool {
	lim := b.opts.Limits
	if !g.ctl.opens.take(time.Now(), float64(lim.OpensPerSecond), float64(lim.OpensPerSecond)) {
		b.Limited(g, metrics.LimitOpenRate, lim.OpensPerSecond)
		return false
	}
	if int(g.ctl.pending.Add(1)) > b.opts.Limits.PendingOpensPerGuest {
		g.ctl.pending.Add(-1)
		b.Limited(g, metrics.LimitOpens, b.opts.Limits.PendingOpensPerGuest)
		return false
	}
	return true
}

// ttlQueue holds keys that all live for the same duration. Since every
// key lives as long, the order in which keys were put is the order in
// which they expire, and a list is the time-ordered queue: put, get,
// remove and each expiry are O(1), and nothing ever scans the queue. The
// zero value is ready. Not safe for concurrent use (the broker's mutex
// guards every one).
type ttlQueue[K comparable, V any] struct {
	items map[K]*list.Element
	order list.List // of *ttlItem[K, V], oldest first
}

type ttlItem[K comparable, V any] struct {
	key   K
	val   V
	until time.Time
}

// put adds k, or refreshes it (it moves to the back of the queue). until
// must not be earlier than that of the keys put before (the same lifetime
// from a later now); otherwise k only expires late, never early.
func (q *ttlQueue[K, V]) put(k K, v V, until time.Time) {
	if q.items == nil {
		q.items = map[K]*list.Element{}
	}
	if e := q.items[k]; e != nil {
		it := e.Value.(*ttlItem[K, V])
		it.val, it.until = v, until
		q.order.MoveToBack(e)
		return
	}
	q.items[k] = q.order.PushBack(&ttlItem[K, V]{key: k, val: v, until: until})
}

// get returns k's value if k is there and not expired at now.
func (q *ttlQueue[K, V]) get(k K, now time.Time) (V, bool) {
	if e := q.items[k]; e != nil {
		if it := e.Value.(*ttlItem[K, V]); now.Before(it.until) {
			return it.val, true
		}
	}
	var zero V
	return zero, false
}

// has reports whether k is there and not expired at now.
func (q *ttlQueue[K, V]) has(k K, now time.Time) bool {
	_, ok := q.get(k, now)
	return ok
}

// remove takes k out; it reports whether k was there.
func (q *ttlQueue[K, V]) remove(k K) bool {
	e := q.items[k]
	if e == nil {
		return false
	}
	q.order.Remove(e)
	delete(q.items, k)
	return true
}

// expire removes the keys expired at now, oldest first, and returns how
// many it removed.
func (q *ttlQueue[K, V]) expire(now time.Time) int {
	n := 0
	for e := q.order.Front(); e != nil; e = q.order.Front() {
		it := e.Value.(*ttlItem[K, V])
		if now.Before(it.until) {
			break
		}
		q.order.Remove(e)
		delete(q.items, it.key)
		n++
	}
	return n
}

// dropOldest removes the oldest key; it reports whether there was one.
func (q *ttlQueue[K, V]) dropOldest() bool {
	e := q.order.Front()
	if e == nil {
		return false
	}
	q.order.Remove(e)
	delete(q.items, e.Value.(*ttlItem[K, V]).key)
	return true
}

func (q *ttlQueue[K, V]) len() int { return len(q.items) }
