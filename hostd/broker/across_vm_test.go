package broker_test

import (
	"testing"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// fakeAcross is fakeRemote (up) that keeps the halves offered to it.
type fakeAcross struct {
	fakeRemote
	offers chan broker.Offer
}

func (f *fakeAcross) Offer(o broker.Offer) { f.offers <- o }

// resumer is a guest session whose library handles RESUME.
type resumer struct{ *session }

func (resumer) Resumes() bool { return true }

// relaySession is the relay's session for a trust group, as the broker
// sees it (hostd/across's session).
type relaySession struct{ *fileSession }

func (relaySession) Relays() {}

// TestAcrossVMGroupRegion: a VM's connection to a peer host's guest (a
// SharedRegion guest of a group region) is offered across hosts, and
// once paired with the relay its ring pair is in the VM's group region
// (region 0 in both READYs, no REGION: the VM has it as its BAR, the
// relay through hostd's mapping); the relay may name the flow in region
// 0 (its KICK reaches the VM), no process guest may. A VM of a group
// with pair regions stays on TCP (cross-group): a region of its own with
// the relay is not built. Before, every VM got TCP(cross-group).
func TestAcrossVMGroupRegion(t *testing.T) {
	x := &fakeAcross{fakeRemote: fakeRemote{up: true}, offers: make(chan broker.Offer, 4)}
	w, _, _, _ := pairWorld(t, policy.Spec{}, broker.Options{PairRegionLinger: -1, Remote: x})
	w.g1.SharedRegion = true // a VM of the group region
	vm := resumer{newSession(w.g1)}
	w.b.Attach(vm)
	rs := relaySession{newFileSession(&broker.Guest{Name: "relay/h2/t", ID: 0xfff00001, Group: w.g1.Group})}
	if err := w.b.AddRelay(rs.g, rs); err != nil {
		t.Fatal(err)
	}
	ta, _ := w.conn("10.0.0.1:4000", "10.9.1.2:80")
	w.b.Open(vm, open(proto.Active, ta, 1))
	var o broker.Offer
	select {
	case o = <-x.offers:
	case m := <-vm.got:
		t.Fatalf("the VM's half was answered %+v, want it offered across hosts", m)
	}
	if !w.b.PairAcross(o.Key, rs, 7) {
		t.Fatal("PairAcross: the half no longer waits")
	}
	var ready [2]proto.Msg
	for i, s := range []*session{vm.session, rs.session} {
		for m := s.next(t); ; m = s.next(t) {
			if m.Type == proto.RegionMsg {
				t.Fatalf("%s got REGION %+v: a VM's connection across hosts lives in its group region", s.g.Name, m)
			}
			if m.Type == proto.Ready {
				ready[i] = m
				break
			}
		}
		if ready[i].RegionID != 0 || !ready[i].Relayed == (i == 0) {
			t.Fatalf("%s: READY %+v, want region 0 (relayed to the VM)", s.g.Name, ready[i])
		}
	}
	r := ready[1]
	// The relay's KICK reaches the VM; an outsider's does not.
	w.b.Kick(rs, proto.Msg{Type: proto.Kick, RegionID: 0, Slot: r.Slot, Gen: r.Gen, Side: r.Side})
	if m := vm.next(t); m.Type != proto.Kick || m.Slot != r.Slot {
		t.Fatalf("the VM got %+v after the relay's KICK, want KICK", m)
	}
	p := newFileSession(w.g2) // a process guest of the same group: no region 0
	w.b.Attach(p)
	w.b.Kick(p, proto.Msg{Type: proto.Kick, RegionID: 0, Slot: r.Slot, Gen: r.Gen, Side: r.Side})
	vm.none(t)
	rs.none(t)

	// A VM of a group with pair regions: TCP(cross-group), not offered.
	w.g3.Group, w.g3.SharedRegion, w.g3.PairVM = w.g1.Group, true, true
	w.b.UseHotplug(&fakeHotplug{})
	vm3 := resumer{newSession(w.g3)}
	w.b.Attach(vm3)
	t3, _ := w.conn("10.0.0.3:4000", "10.9.1.2:80")
	w.b.Open(vm3, open(proto.Active, t3, 1))
	if m := vm3.next(t); m.Type != proto.TCP || m.Reason != proto.ReasonCrossGroup {
		t.Fatalf("a pair-region VM's half: %+v, want TCP(cross-group)", m)
	}
	select {
	case o := <-x.offers:
		t.Fatalf("a pair-region VM's half was offered: %+v", o)
	default:
	}
}

// TestAcrossVsockVMStaysTCP: a VM that carries its flows over vsock
// stretches, connecting to a peer host's guest, stays on TCP (vsock-pair)
// and is not offered: the relay's RESUME would stop only the VM library's
// bridge, not the room's, and lose the bytes between.
func TestAcrossVsockVMStaysTCP(t *testing.T) {
	x := &fakeAcross{fakeRemote: fakeRemote{up: true}, offers: make(chan broker.Offer, 4)}
	w, _, _, _ := pairWorld(t, policy.Spec{}, broker.Options{PairRegionLinger: -1, Remote: x})
	w.g1.Vsock = true
	vm := resumer{newSession(w.g1)}
	w.b.Attach(vm)
	ta, _ := w.conn("10.0.0.1:4000", "10.9.1.2:80")
	w.b.Open(vm, open(proto.Active, ta, 1))
	if m := vm.next(t); m.Type != proto.TCP || m.Reason != proto.ReasonVsockPair {
		t.Fatalf("a vsock VM's half across hosts: %+v, want TCP(vsock-pair)", m)
	}
	select {
	case o := <-x.offers:
		t.Fatalf("a vsock VM's half was offered: %+v", o)
	default:
	}
}
