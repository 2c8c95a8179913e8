package guestlib

import (
	"sync"
	"time"
)

// opener sends a Client's delayed OPENs (Options.OpenDelay) from one
// timer, as the C library's leaver does: a timer per connection cost each
// short connection a wake-up of the runtime's timer thread (a futex and a
// thread switch, about 25 us on two cores), although most close before
// their OPEN is due. The queue is in due order (the delay adapts, so a new
// connection may be due before older ones: it is put in its place); a
// connection closed before its turn stays in it until then, and offerNow
// skips it.
type opener struct {
	mu    sync.Mutex
	q     []openDue
	timer *time.Timer // nil until the first connection
	armed bool        // timer is set for q[0]
	ended bool        // the Client closed: no more OPENs
}

type openDue struct {
	c  *Conn
	at time.Time
}

// add queues c's OPEN for delay from now; the timer is set only when it
// is idle (a queue that is not empty has it set for its head already).
func (o *opener) add(c *Conn, delay time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ended {
		return
	}
	at := time.Now().Add(delay)
	i := len(o.q)
	for i > 0 && o.q[i-1].at.After(at) {
		i--
	}
	o.q = append(o.q, openDue{})
	copy(o.q[i+1:], o.q[i:])
	o.q[i] = openDue{c, at}
	if o.armed && i > 0 {
		return
	}
	o.armed = true
	if o.timer == nil {
		o.timer = time.AfterFunc(delay, o.fire)
	} else {
		o.timer.Reset(delay)
	}
}

// fire sends the OPENs that are due and sets the timer for the next one.
func (o *opener) fire() {
	now := time.Now()
	o.mu.Lock()
	n := 0
	for n < len(o.q) && !o.q[n].at.After(now) {
		n++
	}
	due := make([]*Conn, n)
	for i := range n {
		due[i] = o.q[i].c
	}
	o.q = append(o.q[:0], o.q[n:]...)
	if o.armed = len(o.q) > 0 && !o.ended; o.armed {
		o.timer.Reset(o.q[0].at.Sub(now))
	}
	o.mu.Unlock()
	for _, c := range due {
		c.offerNow()
	}
}

// end stops the timer for good (Client.Close).
func (o *opener) end() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.ended = true
	o.q = nil
	if o.timer != nil {
		o.timer.Stop()
	}
}
