package guestlib

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/wait"
)

// kickSignal is the wait.Signal for VMs: a writer cannot wake a reader in
// another VM through shared memory (no futex reaches across guest kernels,
// and a PCI BAR cannot hold one), so Wake sends KICK to hostd, which relays
// it to the peer's session; there the client wakes its local sleepers.
// Sleeps are also bounded (fallback), so a lost kick costs latency, never a
// hang.
type kickSignal struct {
	c    *Client
	wait *wait.Policy // the client's policy with this Signal: what the rings use

	mu    sync.Mutex
	flags map[*atomic.Uint32]kickTarget // every flag word of this client's flows
	local map[flowKey]chan struct{}     // sleepers per flow
}

type kickTarget struct {
	key  flowKey
	side proto.Side
}

const kickFallback = 20 * time.Millisecond

// newKickSignal returns the signal for c, whose rings wait by p's mode
// and sleep with it.
func newKickSignal(c *Client, p wait.Policy) *kickSignal {
	k := &kickSignal{c: c, flags: map[*atomic.Uint32]kickTarget{}, local: map[flowKey]chan struct{}{}}
	p.Signal = k
	k.wait = &p
	return k
}

// track registers a flow's four flag words.
func (k *kickSignal) track(key flowKey, side proto.Side, flags ...*atomic.Uint32) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, f := range flags {
		k.flags[f] = kickTarget{key, side}
	}
	k.local[key] = make(chan struct{}, 2)
}

// forget drops a flow's registrations.
func (k *kickSignal) forget(key flowKey) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for f, t := range k.flags {
		if t.key == key {
			delete(k.flags, f)
		}
	}
	delete(k.local, key)
}

// Wait sleeps until a kick for the flow of flag, the timeout or the
// fallback bound.
func (k *kickSignal) Wait(flag *atomic.Uint32, val uint32, timeout time.Duration) error {
	k.mu.Lock()
	t, ok := k.flags[flag]
	ch := k.local[t.key]
	k.mu.Unlock()
	d := kickFallback
	if timeout > 0 && timeout < d {
		d = timeout
	}
	if !ok || ch == nil {
		time.Sleep(d)
		return nil
	}
	if flag.Load() != val {
		return nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ch:
	case <-timer.C:
	}
	return nil
}

// Wake asks hostd to kick the peer of the flow of flag, or wakes a local
// sleeper (an interrupt of our own end).
func (k *kickSignal) Wake(flag *atomic.Uint32) error {
	k.mu.Lock()
	t, ok := k.flags[flag]
	ch := k.local[t.key]
	k.mu.Unlock()
	if !ok {
		return nil
	}
	select { // our own sleeper, if it is ours
	case ch <- struct{}{}:
	default:
	}
	_ = k.c.send(proto.Msg{Type: proto.Kick, RegionID: t.key.region, Slot: t.key.slot, Gen: t.key.gen, Side: t.side})
	return nil
}

// kicked wakes this client's sleepers on a flow (a KICK from hostd): up to
// two, its reader and its writer; a token nobody waited for only makes the
// next wait re-check at once.
func (k *kickSignal) kicked(key flowKey) {
	k.mu.Lock()
	ch := k.local[key]
	k.mu.Unlock()
	for i := 0; ch != nil && i < 2; i++ {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}
