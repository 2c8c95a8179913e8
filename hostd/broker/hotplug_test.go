package broker_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

// fakeHotplug records plugs and unplugs; a plug waits for release (if
// set) and fails with fail; an unplug waits for hold (if set).
type fakeHotplug struct {
	release chan struct{}
	fail    error
	hold    chan struct{}

	mu       sync.Mutex
	plugs    []string // guest/device
	unplugs  []string
	unplugCh chan string
}

func (h *fakeHotplug) Plug(ctx context.Context, g *broker.Guest, r *broker.Region) error {
	if h.release != nil {
		select {
		case <-h.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	h.mu.Lock()
	h.plugs = append(h.plugs, g.Name+"/"+r.DeviceID())
	h.mu.Unlock()
	return h.fail
}

func (h *fakeHotplug) Unplug(ctx context.Context, g *broker.Guest, r *broker.Region) error {
	h.mu.Lock()
	h.unplugs = append(h.unplugs, g.Name+"/"+r.DeviceID())
	h.mu.Unlock()
	h.unplugCh <- g.Name
	if h.hold != nil {
		select {
		case <-h.hold:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// vmPairWorld is pairWorld with g1 and g2 as VMs of a group with pair
// regions for VMs (PairVM), plugged by a fakeHotplug; sessions are ports
// (no descriptors).
func vmPairWorld(t *testing.T, h *fakeHotplug) (*world, *fakePairs, *session, *session) {
	return vmPairWorldOpts(t, h, broker.Options{PairRegionLinger: -1})
}

// vmPairWorldOpts is vmPairWorld with the broker's options.
func vmPairWorldOpts(t *testing.T, h *fakeHotplug, opts broker.Options) (*world, *fakePairs, *session, *session) {
	w := newWorldOpts(t, policy.Spec{RingSize: "64KiB"}, opts)
	w.g1.SharedRegion, w.g2.SharedRegion = true, true
	w.g1.PairVM, w.g2.PairVM = true, true
	p := &fakePairs{t: t}
	w.b.UsePairRegions(p)
	h.unplugCh = make(chan string, 8)
	w.b.UseHotplug(h)
	sa, sb := newSession(w.g1), newSession(w.g2)
	w.b.Attach(sa)
	w.b.Attach(sb)
	w.b.Listen(sb, ap("10.0.0.2:80"), true)
	return w, p, sa, sb
}

// TestVMPairRegionPlugged: two PairVM guests' first connection stays on
// TCP, unanswered, while hostd plugs their pair region into both VMs;
// then each gets REGION without a descriptor and READY in it. They have
// no region 0. When the connection closes, both get UNREGION, the device
// goes from both VMs, and then the file.
func TestVMPairRegionPlugged(t *testing.T) {
	h := &fakeHotplug{release: make(chan struct{})}
	w, p, sa, sb := vmPairWorld(t, h)
	if path, r := w.b.RegionZero(w.g1); path != "" || r != nil {
		t.Fatalf("a PairVM guest has region 0 %q: want none", path)
	}
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.none(t) // on TCP while plugging: no answer yet
	sb.none(t)
	if r := w.record(t); r.Path != "tcp" || r.Reason != "region-plug" {
		t.Fatalf("record while plugging: %+v, want tcp(region-plug)", r)
	}
	close(h.release)
	var readies []proto.Msg
	for _, s := range []*session{sa, sb} {
		m := s.next(t)
		if m.Type != proto.RegionMsg || m.RegionID == 0 {
			t.Fatalf("%s got %+v, want REGION (no descriptor: a port)", s.g.Name, m)
		}
		rd := s.next(t)
		if rd.Type != proto.Ready || rd.RegionID != m.RegionID {
			t.Fatalf("%s got %+v, want READY in region %d", s.g.Name, rd, m.RegionID)
		}
		readies = append(readies, rd)
	}
	h.mu.Lock()
	plugs := h.plugs
	h.mu.Unlock()
	if len(plugs) != 2 {
		t.Fatalf("plugs %v, want one per VM", plugs)
	}
	w.b.CloseConn(sa, proto.Msg{Type: proto.Close, ReqID: 1, RegionID: readies[0].RegionID, Slot: readies[0].Slot, Gen: readies[0].Gen, Side: proto.SideA})
	sb.expect(t, proto.Down, proto.ReasonPeerGone, 2)
	w.b.CloseConn(sb, proto.Msg{Type: proto.Close, ReqID: 2, RegionID: readies[1].RegionID, Slot: readies[1].Slot, Gen: readies[1].Gen, Side: proto.SideB})
	for _, s := range []*session{sa, sb} {
		if m := s.next(t); m.Type != proto.Unregion || m.RegionID != readies[0].RegionID {
			t.Fatalf("%s got %+v, want UNREGION", s.g.Name, m)
		}
	}
	got := map[string]bool{}
	for range 2 {
		select {
		case g := <-h.unplugCh:
			got[g] = true
		case <-time.After(5 * time.Second):
			t.Fatal("the region was not unplugged from both VMs")
		}
	}
	if !got["g1"] || !got["g2"] {
		t.Fatalf("unplugged from %v, want g1 and g2", got)
	}
	for deadline := time.Now().Add(5 * time.Second); ; {
		if _, dropped := p.counts(); dropped == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the region's file was not dropped after the unplug")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestVMPairRegionPlugFails: a plug that fails leaves the connection on
// TCP (internal), told to both ends, and the region goes.
func TestVMPairRegionPlugFails(t *testing.T) {
	h := &fakeHotplug{fail: errors.New("no free slot")}
	w, _, sa, sb := vmPairWorld(t, h)
	ta, tb := w.conn("10.0.0.1:4000", "10.0.0.2:80")
	w.b.Open(sa, open(proto.Active, ta, 1))
	w.b.Open(sb, open(proto.Passive, tb, 2))
	sa.expect(t, proto.TCP, proto.ReasonInternal, 1)
	sb.expect(t, proto.TCP, proto.ReasonInternal, 2)
	if r := w.record(t); r.Path != "tcp" || r.Reason != "internal" {
		t.Fatalf("record: %+v, want tcp(internal)", r)
	}
}
