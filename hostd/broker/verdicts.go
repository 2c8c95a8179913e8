package broker

import (
	"time"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/internal/proto"
)

// The verdicts: TCP(reason) to one side or both, counted once per
// connection, and remembered for a late OPEN of the other side.

// refuseLocked answers h's OPEN with TCP(reason), and the other side's if
// it waits; otherwise the verdict is remembered for it. The connection's
// fallback is counted once.
func (b *Broker) refuseLocked(h, other *half, reason proto.Reason) {
	b.tellTCP(h.sess, h.req, reason, true)
	if other != nil {
		b.unwaitLocked(other)
		b.tellTCP(other.sess, other.req, reason, false)
	}
	b.rememberLocked(h.key, reason)
}

func (b *Broker) failPairLocked(a, p *half, reason proto.Reason) {
	b.tellTCP(a.sess, a.req, reason, true)
	b.tellTCP(p.sess, p.req, reason, false)
	b.rememberLocked(a.entry.Reply, reason)
}

// timeout fires when h waited its bound (a runtime timer: the pairing
// timeouts are a time-ordered queue that nothing scans).
func (b *Broker) timeout(h *half) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed || b.waiting[h.key] != h {
		return
	}
	b.dropWaitingLocked(h, h.onTimeout)
}

func (b *Broker) dropWaitingLocked(h *half, reason proto.Reason) {
	b.unwaitLocked(h)
	if h.told && reason == h.onTimeout {
		b.m.Fallbacks.WithLabelValues(reason.String()).Inc()
		b.note("fallback", reason, "guest", h.sess.Guest().Name)
	} else {
		b.tellTCP(h.sess, h.req, reason, true)
	}
	b.rememberLocked(h.key, reason)
}

// unwaitLocked takes h out of the waiting OPENs: its timer stops and it no
// longer counts as its guest's pending OPEN. It is a no-op for an h that
// no longer waits.
func (b *Broker) unwaitLocked(h *half) {
	if b.waiting[h.key] != h {
		return
	}
	h.timer.Stop()
	delete(b.waiting, h.key)
	if b.waitingP[h.entry.Orig] == h {
		delete(b.waitingP, h.entry.Orig)
	}
	if st := b.sessions[h.sess]; st != nil {
		delete(st.halves, h)
	}
	h.sess.Guest().ctl.pending.Add(-1)
}

// rememberLocked keeps reason as the verdict for the connection whose
// conntrack reply tuple is key, for RememberFor. Every verdict lives as
// long, so the queue is in expiry order and expiring pops its front.
func (b *Broker) rememberLocked(key ctrack.Tuple, reason proto.Reason) {
	now := time.Now()
	b.remembered.expire(now)
	b.remembered.put(key, reason, now.Add(b.opts.RememberFor))
}

// tellTCP tells s that its connection req stays on TCP. count says whether
// this is the connection's one count and log line (each connection's
// fallback is counted once, not once per end). It takes no lock and needs
// none (Send is safe for concurrent use), so callers with or without the
// broker's lock use it, and a refusal never waits for the broker.
func (b *Broker) tellTCP(s Session, req uint32, reason proto.Reason, count bool) {
	if reason == reasonPlugging {
		return // not an answer: READY follows (hotplug.go)
	}
	if count {
		b.m.Fallbacks.WithLabelValues(reason.String()).Inc()
		b.note("fallback", reason, "guest", s.Guest().Name)
	}
	s.Send(proto.Msg{Type: proto.TCP, ReqID: req, Reason: reason})
}
