package relay

import (
	"bytes"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
)

// TestBridgeStopOut: StopOut stops the out-direction alone, mid-stream:
// the guest's read ring is marked left exactly where the bytes written
// end (End.X: its reader reads [start, X), then the leave), the peer's
// ring is not freed past X (its writer can resend [X, W) on TCP), and
// the in-direction goes on: the guest's whole stream reaches the peer,
// every byte acknowledged (InLeft). hostd's vsock room stops so between
// two VMs' stretches (docs/vsock.md, "VM to VM").
func TestBridgeStopOut(t *testing.T) {
	const n = 4 << 20
	x := newBridged(t, 64<<10, 1<<20, 7)
	da, db := seeded(1, n), seeded(2, n)
	var stop atomic.Bool
	type res struct {
		start   uint64
		started bool
		got     []byte
		err     error
	}
	aRead, bRead := make(chan res, 1), make(chan res, 1)
	go func() { s, ok, got, err := guestRead(x.h1.ba, &stop, nil); aRead <- res{s, ok, got, err} }()
	go func() { s, ok, got, err := guestRead(x.h2.ab, &stop, nil); bRead <- res{s, ok, got, err} }()
	aWrote, bWrote := make(chan error, 1), make(chan error, 1)
	go func() { _, err := guestWrite(x.h1.ab, 100, da, true, &stop); aWrote <- err }()
	go func() { _, err := guestWrite(x.h2.ba, 200, db, false, &stop); bWrote <- err }() // b never leaves
	waitFor(t, x, 10*time.Second, "b's bytes reaching a", func() bool { return x.b1.Stats().BytesOut > 256<<10 })
	var e End
	within(t, x, 5*time.Second, "StopOut", func() { e = x.b1.StopOut() })
	if !e.Started || e.Start != 200 || e.X <= 200 || e.X > 200+n {
		t.Fatalf("StopOut's end %+v\n%s", e, x.state())
	}
	var ar res
	within(t, x, 10*time.Second, "a's reader", func() { ar = <-aRead })
	if ar.err != nil || !ar.started || ar.start != 200 || uint64(len(ar.got)) != e.X-200 || !bytes.Equal(ar.got, db[:len(ar.got)]) {
		t.Fatalf("a read start %d, %d bytes (want %d, b's first), err %v\n%s", ar.start, len(ar.got), e.X-200, ar.err, x.state())
	}
	var br res
	within(t, x, 20*time.Second, "b's reader", func() { br = <-bRead })
	if err := <-aWrote; err != nil {
		t.Fatal(err)
	}
	if br.err != nil || br.start != 100 || !bytes.Equal(br.got, da) {
		t.Fatalf("b read start %d, %d bytes (want %d), equal %v, err %v\n%s", br.start, len(br.got), n, bytes.Equal(br.got, da), br.err, x.state())
	}
	within(t, x, 10*time.Second, "the in-direction's end", func() { <-x.b1.InDone() })
	if !x.b1.InLeft() {
		t.Fatalf("InLeft false after a's whole stream was acknowledged\n%s", x.state())
	}
	if freed := x.b2.Stats().Freed; freed > e.X-200 {
		t.Fatalf("b's ring freed %d bytes, past the %d a's ring holds\n%s", freed, e.X-200, x.state())
	}
	if again := x.b1.StopOut(); again != e {
		t.Fatalf("a second StopOut: %+v, want %+v", again, e)
	}
	stop.Store(true)
	x.wakeGuests()
	within(t, x, 5*time.Second, "Stop", func() {
		if end := x.b1.Stop(proto.ReasonPolicy); end != e {
			t.Errorf("Stop's end %+v, want StopOut's %+v", end, e)
		}
	})
	within(t, x, 5*time.Second, "b's writer", func() { <-bWrote })
}
