package broker_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// Proof bits as hostd/mark's default field has them.
const passOrig, passReply = 0x80000000, 0x40000000

// readyBoth expects READY for the connection of requests 1 (sa) and 2 (sb).
func readyBoth(t *testing.T, sa, sb *session) {
	t.Helper()
	sa.expect(t, proto.Ready, proto.ReasonNone, 1)
	sb.expect(t, proto.Ready, proto.ReasonNone, 2)
}

// leftBoth expects DOWN(reason) for that connection on both sessions, and
// answers each with LEFT.
func (w *world) leftBoth(t *testing.T, sa, sb *session, reason proto.Reason) {
	t.Helper()
	w.left(sa, sa.expect(t, proto.Down, reason, 1), proto.SideA)
	w.left(sb, sb.expect(t, proto.Down, reason, 2), proto.SideB)
}

func proofWorld(t *testing.T, maxAge time.Duration) *world {
	return newWorldOpts(t, policy.Spec{}, broker.Options{FirewallPoll: 5 * time.Millisecond,
		ProofOrig: passOrig, ProofReply: passReply, ProofMaxAge: maxAge})
}

// TestRulesetChange: a ruleset change moves every connection on the rings
// to TCP (firewall); it comes back only once its lease shows packets past
// the filter in both directions after the change: one direction is not
// enough, and conntrack's counters (which count dropped packets too,
// issue 20 finding 2) are no proof at all.
func TestRulesetChange(t *testing.T) {
	w := proofWorld(t, time.Minute)
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	readyBoth(t, sa, sb)
	e, _ := w.ct.Lookup(ta)
	w.b.RulesetChanged()
	w.leftBoth(t, sa, sb, proto.ReasonFirewall)
	if r := w.record(t); r.Path != "tcp" || r.Reason != "firewall" || !r.Waiting {
		t.Fatalf("record %+v, want on TCP (firewall), waiting for proof", r)
	}
	w.cleared(t)
	time.Sleep(30 * time.Millisecond)
	w.ct.Count(e.ID, 5, 4) // counted at conntrack's hooks, before the filter
	time.Sleep(30 * time.Millisecond)
	sa.none(t)
	w.ct.Pass(e.ID, passOrig) // one way only: the other may be dropped
	time.Sleep(30 * time.Millisecond)
	sa.none(t)
	w.ct.Pass(e.ID, passReply)
	readyBoth(t, sa, sb)
}

// TestFirewallLateOpen: a connection made (and proven) before a ruleset
// change whose OPENs come after it (a late OPEN, a long open delay, a
// fork-shared connection) stays on TCP until its lease shows passage
// under the new rules (issue 20 finding 3).
func TestFirewallLateOpen(t *testing.T) {
	w := proofWorld(t, time.Minute)
	sa, sb := w.sessions()
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80") // handshake proof bits set
	w.b.RulesetChanged()
	w.cleared(t)
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.expect(t, proto.TCP, proto.ReasonFirewall, 1)
	sb.expect(t, proto.TCP, proto.ReasonFirewall, 2)
	time.Sleep(30 * time.Millisecond)
	sa.none(t)
	e, _ := w.ct.Lookup(ta)
	w.ct.Pass(e.ID, passOrig|passReply)
	readyBoth(t, sa, sb)
}

// TestFirewallStale: a connection on the rings whose lease shows no
// packets past the filter both ways for ProofMaxAge moves to TCP (what
// dropped them sent no ruleset event: a dynamic set, a link down); it
// comes back once they pass again. One that keeps showing passage stays.
func TestFirewallStale(t *testing.T) {
	w := proofWorld(t, 300*time.Millisecond)
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	readyBoth(t, sa, sb)
	e, _ := w.ct.Lookup(ta)
	// Keepalives pass: the sweep renews the proof, round after round.
	for range 12 {
		w.ct.Pass(e.ID, passOrig|passReply)
		time.Sleep(75 * time.Millisecond)
	}
	sa.none(t)
	// Then only one direction passes.
	for range 10 {
		w.ct.Pass(e.ID, passOrig)
		time.Sleep(75 * time.Millisecond)
	}
	w.leftBoth(t, sa, sb, proto.ReasonFirewall)
	w.ct.Pass(e.ID, passOrig)
	time.Sleep(50 * time.Millisecond)
	sa.none(t)
	// Packets pass both ways again, as a stream's do: the bits left from
	// before (set at some time since the sweep's last clear, which may
	// be older than ProofMaxAge) are cleared once, and fresh ones count.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			w.ct.Pass(e.ID, passOrig|passReply)
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	readyBoth(t, sa, sb)
}

// TestFirewallStartDowngrades: hostd's start begins an epoch: a
// connection on the rings from before (adopted) leaves them until its
// lease shows passage since the start (issue 20 finding 4: the firewall
// may have changed while no hostd watched).
func TestFirewallStartDowngrades(t *testing.T) {
	w := proofWorld(t, time.Minute)
	sa, sb := w.sessions()
	ta := w.connect(sa, sb, "4000", 1)
	readyBoth(t, sa, sb)
	w.b.Start() // as a restarted hostd does after adopting
	w.leftBoth(t, sa, sb, proto.ReasonFirewall)
	w.cleared(t)
	time.Sleep(30 * time.Millisecond)
	sa.none(t)
	e, _ := w.ct.Lookup(ta)
	w.ct.Pass(e.ID, passOrig|passReply)
	readyBoth(t, sa, sb)
}

// TestFirewallProofProperty drives a connection through random sequences
// of ruleset changes, hostd starts, packets past the filter in either
// direction, and policy flips, and checks after each step that it is on
// the rings only if both directions passed since the last change or
// start, and (once both did and policy allows) that it gets there.
func TestFirewallProofProperty(t *testing.T) {
	ringSteps, tcpSteps := 0, 0
	defer func() {
		if !t.Failed() && (ringSteps == 0 || tcpSteps == 0) {
			t.Errorf("the sequences never reached both paths (rings %d, tcp %d steps): the property was not exercised", ringSteps, tcpSteps)
		}
	}()
	for seed := range uint64(4) {
		r := rand.New(rand.NewPCG(seed, 99))
		w := proofWorld(t, time.Minute)
		sa, sb := w.sessions()
		ta := w.connect(sa, sb, "4000", 1)
		e, _ := w.ct.Lookup(ta)
		orig, reply, allow := true, true, true // passed since the last epoch; policy
		settle := func() {
			time.Sleep(25 * time.Millisecond)
			for _, s := range []*session{sa, sb} {
			drain:
				for {
					select {
					case m := <-s.got:
						if m.Type == proto.Down {
							side := proto.SideA
							if s == sb {
								side = proto.SideB
							}
							w.left(s, m, side)
						}
					default:
						break drain
					}
				}
			}
			time.Sleep(25 * time.Millisecond)
		}
		for step := range 30 {
			op := r.IntN(6)
			switch op {
			case 0:
				w.b.RulesetChanged()
				w.cleared(t)
				orig, reply = false, false
			case 1:
				w.b.Start()
				w.cleared(t)
				orig, reply = false, false
			case 2:
				w.ct.Pass(e.ID, passOrig)
				orig = true
			case 3:
				w.ct.Pass(e.ID, passReply)
				reply = true
			case 4:
				allow = !allow
				spec := policy.Spec{}
				if !allow {
					spec = policy.Spec{Default: "tcp"}
				}
				w.b.SetPolicy(mustCompile(t, spec))
			case 5:
				w.ct.Pass(e.ID, passOrig|passReply)
				orig, reply = true, true
			}
			settle()
			rec := w.record(t)
			onRings := rec.Path == "rings"
			if onRings {
				ringSteps++
			} else {
				tcpSteps++
			}
			if onRings && !(orig && reply) {
				t.Fatalf("seed %d step %d (op %d): on the rings without passage both ways since the last epoch (orig %v reply %v): %+v", seed, step, op, orig, reply, rec)
			}
			if orig && reply && allow && rec.Path == "tcp" && rec.Reason == "firewall" && !rec.Waiting {
				t.Fatalf("seed %d step %d: proven but on TCP (firewall) and not waiting: %+v", seed, step, rec)
			}
		}
	}
}
