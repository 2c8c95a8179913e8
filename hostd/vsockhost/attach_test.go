//go:build linux

package vsockhost

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// TestStretchAttachedEndToEnd: the VM's bridge attaches the VM's write
// ring only once the reader of the ring its bytes go into (the process
// guest's library) attached that one: the room's ATTACHED (HelloHold).
// Until then the VM's writer stays on TCP, so it cannot fill a ring that
// a C reader asleep in recv since its READY never reads (iperf3 over
// vsock hung so). The other direction is not held on the host: the VM
// reads the process guest's whole stream first, and its write ring is
// still unattached after it; with the hold taken out, the VM's bridge
// attaches it at once and this fails.
func TestStretchAttachedEndToEnd(t *testing.T) {
	const capacity, n = 64 << 10, 1 << 20
	const vmStart, procStart = 4242, 2424
	f, _, s, served := stretchRig(t, capacity)
	defer s.Close()
	deadline := time.Now().Add(60 * time.Second) // a way out, not a speed claim
	state := func() string {
		return fmt.Sprintf("vm bridge %v %+v; AB %+v; BA %+v; local W %+v; local R %+v", s.Err(), s.Stats(), f.ab.Stats(), f.ba.Stats(), s.W.Stats(), s.R.Stats())
	}
	vmRead := shmtest.ReadSum(s.R, nil, deadline)
	if _, err := shmtest.WriteStream(f.ba, nil, procStart, seeded(2, n), deadline); err != nil {
		t.Fatalf("process guest's writer: %v\n%s", err, state())
	}
	if r := <-vmRead; r.Err != nil || r.Start != procStart || r.N != n || !bytes.Equal(r.Sum, sum(seeded(2, n))) {
		t.Fatalf("VM read: start %d, %d bytes, sum ok %v, err %v\n%s", r.Start, r.N, bytes.Equal(r.Sum, sum(seeded(2, n))), r.Err, state())
	}
	if s.W.Stats().ReaderAttached || f.ab.Stats().ReaderAttached {
		t.Fatalf("the VM's write ring is attached before the process guest's reader attached its own\n%s", state())
	}
	// The process guest's reader attaches: the VM's writer may start.
	procRead := shmtest.ReadSum(f.ab, nil, deadline)
	if _, err := shmtest.WriteStream(s.W, nil, vmStart, seeded(1, n), deadline); err != nil {
		t.Fatalf("VM's writer: %v\n%s", err, state())
	}
	if r := <-procRead; r.Err != nil || r.Start != vmStart || r.N != n || !bytes.Equal(r.Sum, sum(seeded(1, n))) {
		t.Fatalf("process guest read: start %d, %d bytes, sum ok %v, err %v\n%s", r.Start, r.N, bytes.Equal(r.Sum, sum(seeded(1, n))), r.Err, state())
	}
	bridgesEnd(t, s, served, deadline, state)
}

// TestStretchHeldLeft: a VM writer whose ring was never attached (the
// other end's reader never attached its own) and that leaves it, as a
// library closing on TCP does, ends its direction unstarted: the VM's
// bridge carries the LEFT without the room's ATTACHED, so the VM's close
// does not wait out its drain bound, and the process guest's ring is
// marked left unstarted (its reader goes on by TCP), not reset as a
// stream that died under its writer.
func TestStretchHeldLeft(t *testing.T) {
	const capacity = 64 << 10
	f, _, s, served := stretchRig(t, capacity)
	defer s.Close()
	deadline := time.Now().Add(60 * time.Second)
	state := func() string {
		return fmt.Sprintf("vm bridge %v %+v; AB %+v; BA %+v; local W %+v; local R %+v", s.Err(), s.Stats(), f.ab.Stats(), f.ba.Stats(), s.W.Stats(), s.R.Stats())
	}
	p := &wait.Policy{}
	for _, r := range []*ring.Ring{s.W, f.ba} { // both writers leave unstarted
		w, err := ring.NewWriter(r, p)
		if err != nil {
			t.Fatal(err)
		}
		w.Leave()
	}
	select {
	case <-s.InDone():
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the VM's held direction did not end at its writer's leave\n%s", state())
	}
	if !s.W.Stats().Left || s.W.Stats().ReaderAttached {
		t.Fatalf("the VM's write ring was attached\n%s", state())
	}
	bridgesEnd(t, s, served, deadline, state)
	if ab := f.ab.Stats(); !ab.Left || ab.Started || ab.Reset {
		t.Fatalf("the process guest's read ring: %+v, want left unstarted, not reset\n%s", ab, state())
	}
}

// bridgesEnd: once both directions left, the VM's bridge ends with
// ErrEnded, and then, closed, so does the room's.
func bridgesEnd(t *testing.T, s *vstretch.Stretch, served <-chan struct{}, deadline time.Time, state func() string) {
	t.Helper()
	select {
	case <-s.Done():
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the VM's bridge did not end after both directions left\n%s", state())
	}
	if !errors.Is(s.Err(), relay.ErrEnded) {
		t.Fatalf("VM bridge ended with %v\n%s", s.Err(), state())
	}
	s.Close()
	select {
	case <-served:
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the room's bridge did not end\n%s", state())
	}
}
