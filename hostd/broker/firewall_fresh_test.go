package broker_test

import (
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// TestFirewallLateOpenOldBits: proof bits are set once per clearing, so
// bits a lookup finds may be as old as the entry (or the epoch's clear).
// A connection whose handshake set them, then whose packets stop passing
// with no ruleset event (a dynamic set, ipset, tc), and whose OPENs come
// later than ProofMaxAge, has no fresh proof: it waits on TCP until its
// own bits, cleared, show packets again. (Before: READY at once, so two
// colluding guests holding N connections made before such a drop got
// about N x proof_max_age of rings past it, one late OPEN at a time.)
func TestFirewallLateOpenOldBits(t *testing.T) {
	w := proofWorld(t, 300*time.Millisecond)
	sa, sb := w.sessions()
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80") // the handshake's bits
	time.Sleep(time.Second)                          // nothing passes since
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.expect(t, proto.TCP, proto.ReasonFirewall, 1)
	sb.expect(t, proto.TCP, proto.ReasonFirewall, 2)
	time.Sleep(100 * time.Millisecond) // the poller clears the stale bits
	sa.none(t)
	e, _ := w.ct.Lookup(ta)
	w.ct.Pass(e.ID, passOrig|passReply) // packets pass again
	readyBoth(t, sa, sb)
}

// TestFirewallChangeSparesIdleRecords: a ruleset change makes only the
// connections that want the rings wait for proof. One kept on TCP by
// policy costs no conntrack lookup per poll (before, every record was
// polled until it showed passage, forever if idle: a pair of guests with
// many idle connections on TCP made the poller look up each every 5 s);
// once policy lets it go to the rings, it waits for proof then.
func TestFirewallChangeSparesIdleRecords(t *testing.T) {
	w := newWorldOpts(t, policy.Spec{Default: "tcp"}, broker.Options{FirewallPoll: 5 * time.Millisecond,
		ProofOrig: passOrig, ProofReply: passReply, ProofMaxAge: time.Minute})
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	sa.expect(t, proto.TCP, proto.ReasonPolicy, 1)
	sb.expect(t, proto.TCP, proto.ReasonPolicy, 2)
	w.b.RulesetChanged()
	w.cleared(t)
	before := w.ct.Lookups()
	time.Sleep(300 * time.Millisecond)
	if n := w.ct.Lookups() - before; n != 0 {
		t.Fatalf("%d conntrack lookups in 300 ms for a connection policy keeps on TCP", n)
	}
	w.b.SetPolicy(mustCompile(t, policy.Spec{}))
	time.Sleep(50 * time.Millisecond)
	sa.none(t) // its handshake's bits were cleared by the change
	e, _ := w.ct.Lookup(ta)
	w.ct.Pass(e.ID, passOrig|passReply)
	readyBoth(t, sa, sb)
}

// TestFirewallFlipsRenewProof: a connection whose packets keep passing
// both ways keeps its proof however often policy moves it between the
// rings and TCP. Each new stretch of rings had its bits cleared at once
// by the sweep, and the next look came a quarter of ProofMaxAge later:
// a connection flipped faster than that never had its proof renewed, so
// ProofMaxAge after it was made every upgrade was refused (firewall)
// until the poller saw passage again.
func TestFirewallFlipsRenewProof(t *testing.T) {
	w := proofWorld(t, 300*time.Millisecond)
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	readyBoth(t, sa, sb)
	e, _ := w.ct.Lookup(ta)
	stop := make(chan struct{})
	defer close(stop)
	go func() { // a stream's packets, both ways
		for {
			w.ct.Pass(e.ID, passOrig|passReply)
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); {
		w.b.SetPolicy(mustCompile(t, policy.Spec{Default: "tcp"}))
		w.leftBoth(t, sa, sb, proto.ReasonPolicyReload)
		time.Sleep(20 * time.Millisecond)
		w.b.SetPolicy(mustCompile(t, policy.Spec{}))
		if r := w.record(t); r.Path != "rings" {
			t.Fatalf("a connection whose packets pass both ways was refused the rings at a flip: %+v", r)
		}
		readyBoth(t, sa, sb)
		time.Sleep(20 * time.Millisecond)
	}
}

// TestFirewallRejoinKeepsBound: after a drop that sends no event, a guest
// whose session ends and rejoins its connection (a new session's OPEN)
// just before its proof expires gets a new stretch of rings, whose own
// staleness clock gave it proof_max_age more (review: 1.7 x proof_max_age
// past the drop); the sweep now also counts from the proof itself.
func TestFirewallRejoinKeepsBound(t *testing.T) {
	const maxAge = 2 * time.Second // the sweep every 500 ms
	w := proofWorld(t, maxAge)
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	rb := sb.expect(t, proto.Ready, proto.ReasonNone, 2)
	e, _ := w.ct.Lookup(ta)
	for range 12 { // keepalives pass: the proof is renewed
		w.ct.Pass(e.ID, passOrig|passReply)
		time.Sleep(100 * time.Millisecond)
	}
	drop := time.Now() // nothing passes from here on
	time.Sleep(maxAge - 300*time.Millisecond)
	w.b.Detach(sa)
	sb.expect(t, proto.Down, proto.ReasonNone, 2)
	w.left(sb, rb, proto.SideB)
	moved := newSession(w.g1)
	w.b.Attach(moved)
	w.b.Open(moved, open(proto.Active, ta, 100))
	if m := moved.next(t); m.Type != proto.Ready {
		t.Skipf("no READY after the rejoin (%s): nothing to bound", m.Type)
	}
	sb.next(t)
	for {
		x := moved.next(t)
		if x.Type != proto.Down {
			continue
		}
		// The bound: the proof's age limit plus the sweep's period and
		// one more for the sweep's own timing (the old code: about 2 x
		// proof_max_age).
		if el := time.Since(drop); x.Reason != proto.ReasonFirewall || el > maxAge+3*maxAge/4 {
			t.Fatalf("DOWN(%s) %v after the drop: want DOWN(firewall) within %v", x.Reason, el, maxAge+3*maxAge/4)
		}
		return
	}
}
