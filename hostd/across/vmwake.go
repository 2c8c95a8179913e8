package across

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// A VM's connection across hosts (docs/crosshost.md, "VMs across hosts"):
// its ring pair is in the group region, the VM's BAR, and a futex in
// hostd cannot wake a reader in the guest's kernel, nor can the guest
// wake the bridge by one. So the bridge of a VM's stretch wakes its guest
// as another VM would, by KICK through the broker, and the guest's KICKs
// (relayed by the broker to the relay's session) wake the bridge.

// vmWake is the wait.Signal of a VM guest's bridge. Its waits are bounded
// (vmWakeFallback), so a lost kick costs latency, never a hang.
type vmWake struct {
	in, out   *atomic.Uint32 // the bridge's own waiting words: the reader's of in, the writer's of out
	inCh      chan struct{}  // wakes the in-direction
	outCh     chan struct{}  // wakes the out-direction
	kicks     chan struct{}  // one pending KICK for the guest (the kicker sends it)
	stop      chan struct{}  // ends the kicker
	stop1     sync.Once
	kickGuest func() // asks the broker to KICK the guest (on the kicker's goroutine)
}

// vmWakeFallback bounds a bridge's sleep without a kick.
const vmWakeFallback = 10 * time.Millisecond

// newVMWake returns the Signal for a bridge on (in, out), the ring the
// guest writes and the one it reads; kick sends the guest a KICK. Its
// kicker goroutine runs until close.
func newVMWake(in, out *ring.Ring, kick func()) *vmWake {
	v := &vmWake{inCh: make(chan struct{}, 1), outCh: make(chan struct{}, 1), kicks: make(chan struct{}, 1),
		stop: make(chan struct{}), kickGuest: kick}
	v.in, _ = in.Waiters()
	_, v.out = out.Waiters()
	go v.kicker()
	return v
}

// kicker sends the KICKs outside the bridge's goroutines: a wake-up can
// come under the link Flow's lock, and the broker's Kick takes the
// broker's. Kicks that pile up while one is sent are one.
func (v *vmWake) kicker() {
	for {
		select {
		case <-v.stop:
			return
		case <-v.kicks:
			v.kickGuest()
		}
	}
}

// close ends the kicker (once the bridge stopped).
func (v *vmWake) close() { v.stop1.Do(func() { close(v.stop) }) }

// Wait sleeps on the bridge's own word until a wake-up (its own, or the
// guest's KICK), the timeout or the fallback bound.
func (v *vmWake) Wait(flag *atomic.Uint32, val uint32, timeout time.Duration) error {
	ch := v.outCh
	if flag == v.in {
		ch = v.inCh
	}
	d := vmWakeFallback
	if timeout > 0 && timeout < d {
		d = timeout
	}
	if flag.Load() != val {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ch:
	case <-t.C:
	}
	return nil
}

// Wake wakes the bridge itself (its own words: the link's events) or the
// guest: a KICK, and a futex wake as well, for a guest that maps the
// group region by path and sleeps in a futex (a process guest with
// shared_region; to a VM's BAR it is a no-op).
func (v *vmWake) Wake(flag *atomic.Uint32) error {
	switch flag {
	case v.in:
		poke(v.inCh)
	case v.out:
		poke(v.outCh)
	default:
		_ = wait.Futex{}.Wake(flag)
		select {
		case <-v.stop: // the bridge stopped: its last wake-ups (its Leave)
			go v.kickGuest()
		default:
			poke(v.kicks)
		}
	}
	return nil
}

// kicked: the guest kicked the flow (its KICK through the broker).
func (v *vmWake) kicked() {
	poke(v.inCh)
	poke(v.outCh)
}

func poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// kickKey names a flow as KICK does.
type kickKey struct {
	region, slot uint32
	gen          uint64
}

func kickKeyOf(m proto.Msg) kickKey { return kickKey{m.RegionID, m.Slot, m.Gen} }

// vmKicks are a session's bridges of VM guests, by flow: the broker's
// KICKs for them are delivered at once (under the broker's lock: only
// non-blocking sends), not through the event loop.
type vmKicks struct {
	mu sync.Mutex
	m  map[kickKey]*vmWake
}

func (k *vmKicks) add(key kickKey, v *vmWake) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil {
		k.m = map[kickKey]*vmWake{}
	}
	k.m[key] = v
}

func (k *vmKicks) remove(key kickKey, v *vmWake) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m[key] == v {
		delete(k.m, key)
	}
}

func (k *vmKicks) kicked(m proto.Msg) {
	k.mu.Lock()
	v := k.m[kickKeyOf(m)]
	k.mu.Unlock()
	if v != nil {
		v.kicked()
	}
}
