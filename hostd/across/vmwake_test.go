package across

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

func testRing(t *testing.T) *ring.Ring {
	t.Helper()
	mem := make([]byte, ring.Size(4096))
	if err := ring.Format(mem, 4096); err != nil {
		t.Fatal(err)
	}
	r, err := ring.Attach(mem, 4096)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestVMWake: a VM guest's bridge wakes the guest by KICK (sent by the
// kicker, coalesced) and itself locally; the guest's KICK (through the
// session, keyed by the flow) wakes the bridge's sleepers at once, not
// after the fallback bound; a KICK for another flow wakes nobody.
func TestVMWake(t *testing.T) {
	in, out := testRing(t), testRing(t)
	var kicks atomic.Int32
	sent := make(chan struct{}, 16)
	v := newVMWake(in, out, func() { kicks.Add(1); sent <- struct{}{} })
	defer v.close()
	var s session
	m := proto.Msg{RegionID: 0, Slot: 3, Gen: 9}
	s.kicks.add(kickKeyOf(m), v)

	// The bridge wakes its guest: the guest's words (in's writer, out's
	// reader) mean a KICK.
	_, guestW := in.Waiters()
	guestR, _ := out.Waiters()
	for _, f := range []*atomic.Uint32{guestW, guestR} {
		if err := v.Wake(f); err != nil {
			t.Fatal(err)
		}
		select {
		case <-sent:
		case <-time.After(5 * time.Second):
			t.Fatal("no KICK for the guest within 5 s")
		}
	}

	// The guest's KICK wakes a sleeping bridge direction at once.
	for _, own := range []*atomic.Uint32{v.in, v.out} {
		own.Store(1)
		woke := make(chan time.Duration, 1)
		go func() {
			start := time.Now()
			_ = v.Wait(own, 1, time.Minute)
			woke <- time.Since(start)
		}()
		time.Sleep(2 * time.Millisecond)
		s.Send(proto.Msg{Type: proto.Kick, RegionID: 0, Slot: 3, Gen: 8}) // another flow: nobody
		s.Send(proto.Msg{Type: proto.Kick, RegionID: 0, Slot: 3, Gen: 9})
		select {
		case d := <-woke:
			if d >= vmWakeFallback {
				t.Fatalf("woke after %s: by the fallback, not the KICK", d)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a bridge sleeper not woken within 5 s")
		}
		own.Store(0)
		for _, ch := range []chan struct{}{v.inCh, v.outCh} { // the KICK pokes both directions
			select {
			case <-ch:
			default:
			}
		}
	}
	// A wake-up of its own word does not kick the guest.
	before := kicks.Load()
	_ = v.Wake(v.in)
	_ = v.Wake(v.out)
	time.Sleep(20 * time.Millisecond)
	if kicks.Load() != before {
		t.Fatal("the bridge's own wake-up kicked the guest")
	}
	s.kicks.remove(kickKeyOf(m), v)
}
