//go:build linux

package vsock_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/vsockhost"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// stretchFlow is hostd's record of one flow between the VM (guest
// vmGuest, side A: it writes ring AB) and a process guest, in a real
// region: what the room resolves the VM's Hello against.
type stretchFlow struct {
	hello  relay.Hello
	ab, ba *ring.Ring
	mu     sync.Mutex
	held   bool
	freed  bool
}

const vmGuest = 3

func (f *stretchFlow) Stretch(guest uint32, h relay.Hello) (vsockhost.Held, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if guest != vmGuest || (relay.Hello{Region: h.Region, Slot: h.Slot, Gen: h.Gen}) != f.hello || f.held {
		return vsockhost.Held{}, fmt.Errorf("guest %d: no flow %+v to bridge", guest, h)
	}
	f.held = true
	return vsockhost.Held{Writes: f.ab, Reads: f.ba, Release: func() { f.mu.Lock(); f.freed = true; f.mu.Unlock() }}, nil
}

// TestVsockStretch boots a TCG guest with vhost-user-vsock and no
// ivshmem, its device served by hostd's room (hostd/vsockhost), and has
// the guest open one flow's vsock stretch (guestlib/vstretch: the
// library's rings in the VM's memory, a bridge on an AF_VSOCK stream to
// CID 2) while this process plays a process guest on the flow's real
// ring pair in a region: 4 MiB of seeded bytes each way at once, through
// the room's bridge. Both ends' SHA-256 of both directions must match,
// each writer's start offset must arrive exact, each writer's leave must
// end the other's read, and both bridges must end by themselves (both
// directions left) with the flow's rings released.
func TestVsockStretch(t *testing.T) {
	const n = 4 << 20
	const capacity = 256 << 10
	const vmSeed, procStart = 5, 777
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	reg, _ := shmtest.Region(t, region.Geometry{Size: 4*capacity + 1<<20, Slots: 4})
	pool := region.NewPool(reg, nil)
	slot, e, err := pool.Alloc(region.Request{OwnerA: vmGuest, OwnerB: 4, Capacity: capacity})
	if err != nil {
		t.Fatal(err)
	}
	f := &stretchFlow{hello: relay.Hello{Region: 9, Slot: uint32(slot), Gen: e.Gen}}
	if f.ab, f.ba, err = reg.Rings(slot, e.Gen); err != nil {
		t.Fatal(err)
	}
	var room *vsockhost.Room
	serve := func(r *rig, sock string) {
		var err error
		room, err = vsockhost.Start(hclog.NewNullLogger(), []vsockhost.Spec{{Guest: "vm", ID: vmGuest, Socket: sock, CID: guestCID}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(room.Close)
		r.dev = room.Device(vmGuest)
		if err := room.ServeStretches(vmGuest, f, nil); err != nil {
			t.Fatal(err)
		}
	}
	r := bootWith(t, ctx, bootOpts{serve: serve}, fmt.Sprintf("stretch:%d.%d.%d:%d:%d", f.hello.Region, f.hello.Slot, f.hello.Gen, n, vmSeed))
	booted := time.Since(start)
	ctx = r.ctx
	state := func() string {
		return fmt.Sprintf("room %+v\nring AB (the VM writes) %+v\nring BA (the VM reads) %+v\n%s", room.Stats(), f.ab.Stats(), f.ba.Stats(), r.state())
	}

	// The process guest's ends, until the test's deadline.
	deadline, _ := ctx.Deadline()
	got := shmtest.ReadSum(f.ab, nil, deadline)
	sent := sha256.New()
	var seed [32]byte
	for i := range seed {
		seed[i] = byte(0x77 >> (8 * (i % 8)))
	}
	wrote := make(chan error, 1)
	go func() {
		_, err := shmtest.WriteStream(f.ba, nil, procStart, io.TeeReader(io.LimitReader(rand.NewChaCha8(seed), n), sent), deadline)
		wrote <- err
	}()
	line, err := r.v.WaitAny(ctx, 0, "SHUNT-VSOCK stretch ", "SHUNT-VSOCK ERROR")
	if err != nil || !strings.HasPrefix(line, "SHUNT-VSOCK stretch ") {
		// The process guest's ends give up before the region goes (its
		// writer and reader would run on to the deadline, on unmapped
		// memory): the reader of BA leaves, the writer of AB leaves.
		p := &wait.Policy{}
		if rd, err := ring.NewReader(f.ba, p); err == nil {
			rd.Attach()
			rd.Leave()
		}
		if w, err := ring.NewWriter(f.ab, p); err == nil {
			w.Leave()
		}
		<-wrote
		<-got
		t.Fatalf("the guest's stretch: %q %v\n%s", line, err, state())
	}
	if err := <-wrote; err != nil {
		t.Fatalf("process guest's writer: %v\n%s", err, state())
	}
	p := <-got
	if p.Err != nil || p.Start != vmSeed*1000 || p.N != n {
		t.Fatalf("process guest read: start %d (want %d), %d bytes (want %d), %v\n%s", p.Start, vmSeed*1000, p.N, n, p.Err, state())
	}
	want := fmt.Sprintf(" start=%d sent=%x recv=%x bytes=%d end=%v ", procStart, p.Sum, sent.Sum(nil), n, relay.ErrEnded)
	if !strings.Contains(line, want) {
		t.Fatalf("guest says %q, want %q in it\n%s", line, want, state())
	}
	// The room's bridge ends once the VM closed its stream.
	for {
		s := room.Stats()[0]
		f.mu.Lock()
		freed := f.freed
		f.mu.Unlock()
		if s.Stretches == 0 && freed {
			if s.Bridged != 1 || s.BadHellos != 0 {
				t.Fatalf("room counted %+v", s)
			}
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the room's bridge did not end\n%s", state())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := r.v.Wait(ctx, "SHUNT-VM AGENT-EXIT 0"); err != nil {
		t.Fatalf("%v\n%s", err, state())
	}
	s := r.dev.Stats()
	if k := s.BadPackets.Load() + s.QueueBroken.Load() + s.Resets.Load(); k != 0 {
		t.Fatalf("the honest guest's driver was refused %d times\n%s", k, state())
	}
	t.Logf("boot %v, whole test %v: %s", booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond), line)
}
