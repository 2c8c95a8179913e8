package broker

import (
	"sync"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
)

// noteLines is how many lines a second each kind and reason of note may
// log; the rest are counted and summed up in one line when the next
// second's first is logged.
const noteLines = 10

// rateLog limits the Info lines of fallbacks and switches per kind and
// reason: every one is counted in the metrics, and logged unless a burst
// of the same kind and reason already filled its second. The zero value
// is ready; safe for concurrent use.
type rateLog struct {
	mu  sync.Mutex
	win map[noteKey]*noteWin
}

type noteKey struct {
	what   string
	reason proto.Reason
}

type noteWin struct {
	start      time.Time
	n          int
	suppressed int
}

// allow reports whether a note of key may be logged at now, and how many
// were suppressed since the last one logged.
func (r *rateLog) allow(k noteKey, now time.Time) (bool, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.win == nil {
		r.win = map[noteKey]*noteWin{}
	}
	w := r.win[k]
	if w == nil {
		w = &noteWin{start: now}
		r.win[k] = w
	}
	if now.Sub(w.start) >= time.Second {
		w.start, w.n = now, 0
	}
	if w.n >= noteLines {
		w.suppressed++
		return false, 0
	}
	w.n++
	s := w.suppressed
	w.suppressed = 0
	return true, s
}

// note logs a fallback or a switch (what) with its reason at Info,
// rate-limited per what and reason (rateLog).
func (b *Broker) note(what string, reason proto.Reason, kv ...any) {
	ok, suppressed := b.notes.allow(noteKey{what, reason}, time.Now())
	if !ok {
		return
	}
	if suppressed > 0 {
		b.log.Info("similar lines suppressed", "what", what, "reason", reason, "suppressed", suppressed)
	}
	b.log.Info(what, append([]any{"reason", reason}, kv...)...)
}

// switchedLocked counts and logs a switch of c to the rings or TCP.
func (b *Broker) switchedLocked(c *Conn, to string, reason proto.Reason) {
	c.switches++
	b.m.Switches.WithLabelValues(to, reason.String()).Inc()
	b.note("switch to "+to, reason, "conn", c.Name(), "a", c.a.g.Name, "b", c.b.g.Name, "tuple", c.orig, "switches", c.switches)
}
