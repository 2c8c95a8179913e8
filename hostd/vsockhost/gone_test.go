//go:build linux

package vsockhost

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// TestStretchGoneDrains: an end of a stretch's flow is done (hostd's
// broker says so: Held.Gone for the VM's, Held.PeerGone for the other)
// while its last bytes are still on their way: its writer's ring, the
// stream and the other end's ring all full, because the surviving reader
// has not read yet. The room's bridge must carry every one of those bytes
// into the survivor's ring, with the leave mark after them, before it
// releases the flow, since hostd tells the survivor DOWN(peer-gone) at
// the release and a reader told that leaves its ring once it is empty.
// It must also release without waiting for the other direction, which
// nobody ends (the done end reads no more).
//
// Before the room drained a done end (it released only when both
// directions ended or the stream closed), hostd told the survivor at
// once, and TestVsockProcessGuest's process guest read a stream cut
// short by 32-320 KiB with a clean EOF, one run in three.
func TestStretchGoneDrains(t *testing.T) {
	for _, vmGone := range []bool{true, false} {
		name := "peer"
		if vmGone {
			name = "vm"
		}
		t.Run(name, func(t *testing.T) { testGoneDrains(t, vmGone) })
	}
}

func testGoneDrains(t *testing.T, vmGone bool) {
	const capacity, n, start = 64 << 10, 4 << 20, 4242
	f, st, s, served := stretchRig(t, capacity)
	defer func() {
		if !t.Failed() { // a writer may still be on the VM's rings: no unmapping under it
			s.Close()
		}
	}()
	deadline := time.Now().Add(60 * time.Second) // a way out, not a speed claim

	// The done end writes n bytes and leaves; the survivor reads
	// nothing yet.
	from, to := s.W, f.ab // the VM's end is done: its bytes go to the process guest
	if !vmGone {
		from, to = f.ba, s.R // the process guest's end is done: its bytes go to the VM
	}
	toBefore := to.Stats().Written
	var atRelease ring.Stats // the survivor's ring when hostd would tell it DOWN(peer-gone)
	f.onRelease = func() { atRelease = to.Stats() }
	// The survivor's reader attached its ring (it reads nothing yet): the
	// VM's writer moves to its ring only once it has (HelloHold).
	if rd, err := ring.NewReader(to, &wait.Policy{}); err != nil {
		t.Fatal(err)
	} else {
		rd.Attach()
	}
	wrote := make(chan error, 1)
	go func() { _, err := shmtest.WriteStream(from, nil, start, seeded(7, n), deadline); wrote <- err }()
	state := func() string {
		return fmt.Sprintf("VM bridge %v %+v; AB (VM writes) %+v; BA (VM reads) %+v; VM's W %+v; VM's R %+v; room open %d",
			s.Err(), s.Stats(), f.ab.Stats(), f.ba.Stats(), s.W.Stats(), s.R.Stats(), len(st.open))
	}
	for { // the done end's ring full: its bytes back up to there
		if ws := from.Stats(); ws.Written-ws.Read == capacity {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the writer's ring never filled\n%s", state())
		}
		time.Sleep(time.Millisecond)
	}
	if vmGone {
		close(f.gone)
	} else {
		close(f.peerGone)
	}
	got := shmtest.ReadSum(to, nil, deadline) // the survivor reads now
	select {
	case <-f.freed:
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the room did not release the flow of a done end\n%s", state())
	}
	// In the process guest's ring the room's bridge set the leave mark
	// before the release; in the VM's, the VM's bridge sets it when the
	// LEFT or the room's DOWN reaches it (the reader below waits for it).
	if atRelease.Written-toBefore != n || vmGone && !atRelease.Left {
		t.Fatalf("at the release the survivor's ring had %d of the %d bytes (left %v): DOWN(peer-gone) then cuts its stream short\n%s",
			atRelease.Written-toBefore, n, atRelease.Left, state())
	}
	if err := <-wrote; err != nil {
		t.Fatalf("the done end's writer: %v\n%s", err, state())
	}
	if !vmGone {
		// The room's bridge stopped, so the VM's ends (its DOWN came
		// after the LEFT); the VM's library then stops its stretch,
		// which marks the read ring left where it ended.
		select {
		case <-s.Done():
		case <-time.After(time.Until(deadline)):
			t.Fatalf("the VM's bridge did not end after the room's\n%s", state())
		}
		s.Stop(proto.ReasonPeerGone)
	}
	r := <-got
	if r.Err != nil || r.Start != start || r.N != n || !bytes.Equal(r.Sum, sum(seeded(7, n))) {
		t.Fatalf("survivor read: start %d (want %d), %d bytes (want %d), sum ok %v, err %v\n%s",
			r.Start, start, r.N, n, bytes.Equal(r.Sum, sum(seeded(7, n))), r.Err, state())
	}
	select {
	case <-served:
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the room's bridge did not end\n%s", state())
	}
	if len(st.open) != 0 || st.served != 1 {
		t.Fatalf("stretches: served %d open %d", st.served, len(st.open))
	}
}

// TestStretchGoneDrainCut: the VM's end is done with its last bytes on
// their way, and the process guest's reader reads nothing: once nothing
// has moved for goneDrain the room stops the drain (the flow's slot must
// not be held for ever) and resets the process guest's ring, so that its
// reader fails instead of taking the bytes it got for the whole stream
// (a clean leave there read as a stream cut short, or, after a DOWN that
// was no close, as a gap before the TCP bytes that follow).
func TestStretchGoneDrainCut(t *testing.T) {
	defer func(d time.Duration) { goneDrain = d }(goneDrain)
	goneDrain = 300 * time.Millisecond
	const capacity, n, start = 64 << 10, 4 << 20, 4242
	f, st, s, served := stretchRig(t, capacity)
	deadline := time.Now().Add(60 * time.Second) // a way out, not a speed claim
	rd, err := ring.NewReader(f.ab, &wait.Policy{})
	if err != nil {
		t.Fatal(err)
	}
	rd.Attach() // the process guest's reader, attached at READY, reads nothing
	wrote := make(chan error, 1)
	go func() { _, err := shmtest.WriteStream(s.W, nil, start, seeded(7, n), deadline); wrote <- err }()
	for ws := s.W.Stats(); ws.Written-ws.Read != capacity || f.ab.Stats().Written < capacity; ws = s.W.Stats() {
		if time.Now().After(deadline) {
			t.Fatalf("the VM's ring never filled: %+v", ws)
		}
		time.Sleep(time.Millisecond)
	}
	close(f.gone)
	select {
	case <-f.freed:
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the room never released a flow whose survivor reads nothing: AB %+v", f.ab.Stats())
	}
	var got int
	buf := make([]byte, 32<<10)
	for {
		k, err := rd.TryRead(buf)
		got += k
		if err != nil || k == 0 {
			if !errors.Is(err, ring.ErrReset) {
				t.Fatalf("the survivor read %d of %d bytes, then %v; want the ring reset (ring.ErrReset): %+v", got, n, err, f.ab.Stats())
			}
			break
		}
	}
	s.W.Abort(1, &wait.Policy{}) // the VM's writer, still blocked on its full ring, ends
	<-wrote
	s.Close()
	select {
	case <-served:
	case <-time.After(time.Until(deadline)):
		t.Fatal("the room's bridge did not end")
	}
	if len(st.open) != 0 || st.served != 1 {
		t.Fatalf("stretches: served %d open %d", st.served, len(st.open))
	}
}

// TestStretchBrokenResets: the VM's stream dies while its writer is on
// its ring (the VM's program killed: no LEFT crosses). The room's bridge
// must reset the process guest's read ring, so that its reader fails
// with ECONNRESET after the bytes that did cross, instead of marking it
// left, which read as a clean end of a stream cut short.
func TestStretchBrokenResets(t *testing.T) {
	const capacity = 64 << 10
	f := newFlowsFake(t, capacity)
	vmc, hostc := streamPair(t)
	st := &stretches{open: map[*relay.Bridge]bool{}}
	served := make(chan struct{})
	go func() { defer close(served); st.serve(hostc, 3, f, nil, hclog.NewNullLogger()) }()
	s, err := vstretch.Open(vmc, f.hello, capacity, nil)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	got := make(chan error, 1)
	var n int64
	go func() {
		var b bytes.Buffer
		_, k, err := shmtest.ReadStream(f.ab, nil, &b, deadline)
		n = k
		got <- err
	}()
	// The VM's writer writes 256 KiB, does not leave; then its stream dies.
	w, err := ring.NewWriter(s.W, &wait.Policy{})
	if err != nil {
		t.Fatal(err)
	}
	for !w.ReaderAttached() && time.Now().Before(deadline) {
		time.Sleep(100 * time.Microsecond)
	}
	w.Start(77)
	ww := w.NewWaiter(func() bool { return false })
	buf, _ := io.ReadAll(seeded(5, 256<<10))
	for len(buf) > 0 {
		k, err := w.TryWrite(buf)
		if err != nil {
			t.Fatal(err)
		}
		buf = buf[k:]
		if k == 0 {
			if err := ww.Wait(deadline); err != nil {
				t.Fatal(err)
			}
		}
	}
	for f.ab.Stats().Written < 128<<10 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	vmc.Close()
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatal("the room's bridge did not end when the stream died")
	}
	select {
	case err := <-got:
		if !errors.Is(err, ring.ErrReset) {
			t.Fatalf("the process guest's reader ended with %v after %d bytes, want a reset (ring %+v)", err, n, f.ab.Stats())
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("the process guest's reader did not end (ring %+v)", f.ab.Stats())
	}
	s.Close()
}

// TestStretchEndThenExit: the VM's writer leaves its ring and its program
// exits as soon as its Close returned (the bridge carried the last bytes,
// InDone, and its LEFT is in the kernel, Flushed): the stream dies right
// after, and the process guest must read the whole stream and a clean
// end, not a reset. Without Flushed the LEFT could still be queued in
// the VM's process when it exits, and the room takes a stream that ends
// without it for a break.
func TestStretchEndThenExit(t *testing.T) {
	const capacity, n = 64 << 10, 1 << 20
	f := newFlowsFake(t, capacity)
	vmc, hostc := streamPair(t)
	st := &stretches{open: map[*relay.Bridge]bool{}}
	served := make(chan struct{})
	go func() { defer close(served); st.serve(hostc, 3, f, nil, hclog.NewNullLogger()) }()
	s, err := vstretch.Open(vmc, f.hello, capacity, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	deadline := time.Now().Add(30 * time.Second)
	got := shmtest.ReadSum(f.ab, nil, deadline)
	if _, err := shmtest.WriteStream(s.W, nil, 99, seeded(8, n), deadline); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.InDone():
	case <-time.After(time.Until(deadline)):
		t.Fatal("the bridge did not carry the last bytes")
	}
	if !s.Flushed(deadline) {
		t.Fatal("the stretch's frames were not flushed")
	}
	vmc.Close() // the program exits
	select {
	case r := <-got:
		if r.Err != nil || r.N != n || r.Start != 99 || !bytes.Equal(r.Sum, sum(seeded(8, n))) {
			t.Fatalf("the process guest read %d bytes from %d, err %v (sum ok %v), want %d and a clean end", r.N, r.Start, r.Err, bytes.Equal(r.Sum, sum(seeded(8, n))), n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the process guest's read did not end")
	}
	<-served
}
