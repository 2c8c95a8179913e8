package across

import (
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/relay/relaytest"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// deregVerbs is a queue pair that carries nothing: enough for a link to
// register memory on, recording when registrations go.
type deregVerbs struct {
	send, recv []byte
	credit     [2]uint64
	note       func(string)
}

func (v *deregVerbs) Local() relay.Endpoint {
	return relay.Endpoint{QPN: 1, MTU: 5, Size: relay.MinRing, Depth: relay.MinDepth}
}
func (v *deregVerbs) Connect(relay.Endpoint) error         { return nil }
func (v *deregVerbs) Send() []byte                         { return v.send }
func (v *deregVerbs) Recv() []byte                         { return v.recv }
func (v *deregVerbs) Credit() *[2]uint64                   { return &v.credit }
func (v *deregVerbs) Write(int, int) error                 { return nil }
func (v *deregVerbs) WriteCredit(uint64, uint64) error     { return nil }
func (v *deregVerbs) PostRecv(int) error                   { return nil }
func (v *deregVerbs) Poll([]relay.Completion) (int, error) { return 0, nil }
func (v *deregVerbs) Sleep(d time.Duration) error          { time.Sleep(min(d, time.Millisecond)); return nil }
func (v *deregVerbs) Close() error                         { return nil }
func (v *deregVerbs) MaxSGE() int                          { return 16 }
func (v *deregVerbs) Register([]byte) (uint32, error)      { return 1, nil }
func (v *deregVerbs) Deregister(uint32) error              { v.note("deregister"); return nil }
func (v *deregVerbs) WriteSG(int, int, []relay.SGE) error  { return nil }

// TestUnmapDeregistersFirst: a region the relay takes away (UNREGION, or
// a new region of its id) loses its registration on the RDMA link before
// its mapping goes, and the session forgets both.
func TestUnmapDeregistersFirst(t *testing.T) {
	var mu sync.Mutex
	var events []string
	note := func(s string) { mu.Lock(); events = append(events, s); mu.Unlock() }
	unmapped := make(chan struct{})
	old := munmap
	munmap = func([]byte) error { note("munmap"); close(unmapped); return nil }
	defer func() { munmap = old }()

	v := &deregVerbs{send: make([]byte, relay.MinRing), recv: make([]byte, relay.MinRing), note: note}
	lk := relay.NewRDMALink(v, relay.RDMAOptions{})
	defer func() { lk.Close(); lk.Wait() }()
	mem := make([]byte, 1<<20)
	reg, err := lk.Register(mem)
	if err != nil {
		t.Fatal(err)
	}
	s := &session{regions: map[uint32][]byte{7: mem}, regs: map[uint32]*relay.Region{7: reg}}
	if s.region(7, lk) != reg || s.region(7, nil) != nil {
		t.Fatal("the session's registration is not the link's")
	}
	delete(s.regions, 7)
	s.unmap(7, mem)
	select {
	case <-unmapped:
	case <-time.After(10 * time.Second):
		t.Fatal("the region was not unmapped within 10s")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(events) != 2 || events[0] != "deregister" || events[1] != "munmap" {
		t.Fatalf("events %v; want [deregister munmap]", events)
	}
	if s.regs[7] != nil {
		t.Fatal("the session still has the registration")
	}
}

// TestZeroCopyStopOffLoop: a relayed connection whose bridge sent from
// its guest's ring by reference is moved to TCP while the NIC still holds
// that write (fake verbs, h1's writes held). h1's event loop must not
// wait for the NIC: it tells h0 where the ring ended at once, and pairs
// and starts another connection of the same peer meanwhile. The stopped
// connection's ring pair must not be let go while the write may read it:
// no RESUME for its guest, and its slot and ring memory not given to
// another connection (its guest left already), until the write
// completed; then the relay leaves the pair and its slot is freed.
func TestZeroCopyStopOffLoop(t *testing.T) {
	v1, v0 := relaytest.Pair(relay.MinRing, relay.MinDepth)
	w := newWorldWith(t, func(o *Options) {
		o.RDMA = func() (relay.Verbs, error) { return v1, nil }
		// Longer than the test: the link must not end by this bound.
		o.RDMALink = relay.RDMAOptions{ZeroCopyWait: 2 * time.Minute}
	})
	w.h0RDMA = func() (relay.Verbs, error) { return v0, nil }
	w.pairs.size = 16 << 20     // A, B and C at once
	t.Cleanup(v1.ReleaseWrites) // runs before the room closes: nothing waits for ever
	h := w.dial()
	var lk relay.Carrier
	w.loop(func() { lk = w.r.link("h0").l })
	if _, ok := lk.(*relay.RDMALink); !ok {
		t.Fatalf("h1's relay link is %T, want RDMA", lk)
	}

	// Connection A on the rings; g1 writes 64 KiB, which h1's bridge
	// sends by reference: the NIC holds the write that reads g1's ring.
	idA, readyA := w.paired(h, 4200, 101)
	h.across(peers.Across{Op: opGo, ID: 101, Peer: idA, Flow: 5})
	if _, err := h.link.Open(5); err != nil {
		t.Fatal(err)
	}
	w.bridging(idA)
	v1.HoldWrites()
	h.across(peers.Across{Op: opAttached, ID: 101, Peer: idA, Flow: 5})
	gw, err := ring.NewWriter(w.ring(readyA, readyA.Side == proto.SideA), &wait.Policy{})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "h1's bridge to attach g1's write ring", gw.ReaderAttached)
	gw.Start(0)
	if n, err := gw.TryWrite(make([]byte, min(64<<10, int(readyA.Capacity)/2))); err != nil || n == 0 {
		t.Fatalf("g1's write: %d bytes, %v", n, err)
	}
	waitFor(t, "a write gathering from g1's ring held in the NIC", func() bool { _, r := v1.Held(); return r > 0 })

	// A moves to TCP: h1 says where its ring ended at once.
	w.downgrade(idA)
	stopA := make(chan peers.Across, 1)
	go func() {
		for m := range h.got {
			if m.Op == opStop && m.Peer == 101 {
				stopA <- m
				return
			}
		}
	}()
	select {
	case m := <-stopA:
		if m.Flow != 5 {
			t.Fatalf("h1's stop %+v, want flow 5", m)
		}
	case <-time.After(20 * time.Second):
		held, reading := v1.Held()
		t.Fatalf("h1 did not stop A within 20 s while the NIC held %d writes (%d reading g1's ring): its event loop waits for the NIC", held, reading)
	}
	if _, reading := v1.Held(); reading == 0 {
		t.Fatal("the write reading g1's ring completed before it was let go")
	}

	// Meanwhile another connection of the same peer pairs and starts.
	idB, _ := w.paired(h, 4201, 102)
	h.across(peers.Across{Op: opGo, ID: 102, Peer: idB, Flow: 6})
	if _, err := h.link.Open(6); err != nil {
		t.Fatal(err)
	}
	w.bridging(idB)

	// h0's end of A: h1 knows both ends, but the NIC still reads A's
	// ring: no RESUME, and the relay keeps its side of the pair.
	h.across(peers.Across{Op: opStop, ID: 101, Peer: idA, Flow: 5, Never: true})
	h.sync()
	for drained := false; !drained; {
		select {
		case m := <-w.s1.got:
			if m.Type == proto.Resume && m.ReqID == readyA.ReqID {
				t.Fatalf("g1 got RESUME(%#x) for A while the NIC still reads its ring", m.Offset)
			}
		default:
			drained = true
		}
	}
	// g1 leaves A's pair at once (as a guest may): the slot is still the
	// relay's, so a new connection gets other memory.
	w.left(readyA)
	_, readyC := w.paired(h, 4202, 103)
	if readyC.RegionID == readyA.RegionID && (readyC.Slot == readyA.Slot || overlap(readyA, readyC)) {
		t.Fatalf("C got A's slot %d or ring memory (READY %+v; A's %+v) while the NIC still reads A's ring", readyA.Slot, readyC, readyA)
	}
	if held, reading := v1.Held(); reading == 0 {
		t.Fatalf("the held write completed (%d held) before it was let go", held)
	}

	// The NIC carries the write out: the relay leaves A's pair, which
	// frees its slot; the link stayed up throughout.
	v1.ReleaseWrites()
	waitFor(t, "h1 to let A's ring pair go", func() bool {
		var gone bool
		w.loop(func() { x := w.r.conns[idA]; gone = x == nil || x.st == nil })
		return gone
	})
	_, readyD := w.paired(h, 4203, 104)
	if readyD.RegionID != readyA.RegionID || readyD.Slot != readyA.Slot {
		t.Fatalf("D's READY %+v: want A's freed slot %d of region %d (the lowest free)", readyD, readyA.Slot, readyA.RegionID)
	}
	if err := lk.Err(); err != nil {
		t.Fatalf("the RDMA link ended: %v", err)
	}
	if v := v1.Violations(); len(v) > 0 {
		t.Fatalf("the NIC read a registration that was gone: %v", v)
	}
}

// overlap reports whether the ring pairs of two READYs share memory.
func overlap(a, b proto.Msg) bool {
	end := func(m proto.Msg) uint64 { return m.RingBA + uint64(ring.Size(int(m.Capacity))) }
	return a.RingAB < end(b) && b.RingAB < end(a)
}

// waitFor waits for cond, a state that stays once reached, for at most
// 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no %s within 10 s", what)
		}
	}
}
