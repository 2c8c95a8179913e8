package guestlib

import (
	"sync/atomic"
	"time"
)

// The open delay adapts to what the Client's connections do, as the C
// library's does (guestlib/preload/csrc/open.c, open_lived): under a load
// of short connections whose tail outlives the delay (ab -c 16, a
// connection per request), each one offered costs both ends and hostd an
// OPEN, a pairing, READY and CLOSE for bytes that were nearly all sent. A
// connection closed less than openPays (or four delays) after its OPEN did
// not pay for it: the delay doubles, up to maxOpenDelay. One that lived
// longer halves it, down to Options.OpenDelay. Connections closed within
// the delay say nothing (hostd never heard of them). Counted by time after
// OPEN, not by bytes: a latency-bound connection pays back as a bulk one
// does.
const (
	maxOpenDelay = 200 * time.Millisecond
	openPays     = 200 * time.Millisecond
)

// openDelay is a Client's open delay now. Safe for concurrent use.
type openDelay struct {
	base time.Duration // Options.OpenDelay: the least; 0 or less: none, at once
	cur  atomic.Int64  // the delay now, in ns
}

func newOpenDelay(base time.Duration) *openDelay {
	d := &openDelay{base: base}
	d.cur.Store(int64(base))
	return d
}

func (d *openDelay) now() time.Duration { return time.Duration(d.cur.Load()) }

// lived adapts the delay to a connection that was offered to hostd and
// ended life after its OPEN. It returns the new delay and whether it
// changed.
func (d *openDelay) lived(life time.Duration) (time.Duration, bool) {
	old := d.now()
	if d.base <= 0 {
		return old, false
	}
	nd := max(old/2, d.base)
	if life < max(openPays, 4*old) {
		nd = min(2*old, maxOpenDelay)
	}
	if nd == old || !d.cur.CompareAndSwap(int64(old), int64(nd)) {
		return old, false
	}
	return nd, true
}
