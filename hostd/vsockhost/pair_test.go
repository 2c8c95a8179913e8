//go:build linux

package vsockhost

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
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

// pairRig is two VMs' stretches of one flow, each served by a room of
// its own (a device's stretches) onto the flow's real ring pair: fa is A's
// side (it writes AB), fb B's.
type pairRig struct {
	fa, fb           *flowsFake
	sa, sb           *vstretch.Stretch
	servedA, servedB <-chan struct{}
}

func newPairRig(t *testing.T, capacity int, pair bool) *pairRig {
	fa := newFlowsFake(t, capacity)
	fb := &flowsFake{vm: 4, hello: fa.hello, ab: fa.ba, ba: fa.ab, // B writes BA, reads AB
		gone: make(chan struct{}), peerGone: make(chan struct{}), freed: make(chan struct{}),
		stop: make(chan proto.Reason, 1), stopped: make(chan relay.End, 1)}
	fa.pair, fb.pair = pair, pair
	open := func(f *flowsFake, guest uint32) (*vstretch.Stretch, <-chan struct{}) {
		vmc, hostc := streamPair(t)
		st := &stretches{open: map[*relay.Bridge]bool{}}
		served := make(chan struct{})
		go func() { defer close(served); st.serve(hostc, guest, f, nil, hclog.NewNullLogger()) }()
		s, err := vstretch.Open(vmc, f.hello, capacity, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		return s, served
	}
	p := &pairRig{fa: fa, fb: fb}
	p.sa, p.servedA = open(fa, 3)
	p.sb, p.servedB = open(fb, 4)
	return p
}

func (p *pairRig) state() string {
	return fmt.Sprintf("A's bridge %v %+v; B's bridge %v %+v; AB %+v; BA %+v; A's W %+v R %+v; B's W %+v R %+v",
		p.sa.Err(), p.sa.Stats(), p.sb.Err(), p.sb.Stats(), p.fa.ab.Stats(), p.fa.ba.Stats(), p.sa.W.Stats(), p.sa.R.Stats(), p.sb.W.Stats(), p.sb.R.Stats())
}

// endless writes seed's stream into r from start until stop (without
// leaving the ring: the writer of a downgraded stretch goes on on TCP),
// and sends how many bytes it wrote.
func endless(r *ring.Ring, start, seed uint64, stop *atomic.Bool) <-chan int64 {
	out := make(chan int64, 1)
	go func() {
		var n int64
		defer func() { out <- n }()
		w, err := ring.NewWriter(r, &wait.Policy{})
		if err != nil {
			return
		}
		for !w.ReaderAttached() && !stop.Load() {
			time.Sleep(100 * time.Microsecond)
		}
		w.Start(start)
		ww := w.NewWaiter(stop.Load)
		src := rand.NewChaCha8(seedBytes(seed))
		buf := make([]byte, 32<<10)
		for !stop.Load() {
			src.Read(buf)
			for off := 0; off < len(buf) && !stop.Load(); {
				k, err := w.TryWrite(buf[off:])
				off += k
				n += int64(k)
				if err != nil {
					return
				}
				if k == 0 {
					_ = ww.Wait(time.Now().Add(100 * time.Millisecond)) // a look at stop now and then
				}
			}
		}
	}()
	return out
}

func seedBytes(seed uint64) (b [32]byte) {
	for i := range b {
		b[i] = byte(seed >> (8 * (i % 8)))
	}
	return b
}

// prefix reports whether got is the first len(got) bytes of seed's stream.
func prefix(seed uint64, got []byte) bool {
	want := make([]byte, len(got))
	rand.NewChaCha8(seedBytes(seed)).Read(want)
	return bytes.Equal(got, want)
}

// TestStretchPairStop: a downgrade's stop between two VMs, mid-stream
// both ways (docs/vsock.md, "VM to VM"). Each room stops its
// out-direction at once (the flow's ring left at its X) and carries the
// other VM's stretch into its own VM's ring to that ring's mark, then
// stops and says so (Stopped: X, inLeft). Then each VM stops its own
// bridge, as at its RESUME: A's read ring must end exactly at B's room's
// X (so A reads B's stream to there, every byte in order), and A's write
// ring must still hold everything from A's room's X on (its bridge freed
// nothing past it), so that A resends exactly what B's ring does not
// hold; and the same the other way.
func TestStretchPairStop(t *testing.T) {
	const aStart, bStart = 1000, 5000
	p := newPairRig(t, 64<<10, true)
	deadline := time.Now().Add(60 * time.Second) // a way out, not a speed claim
	var stop atomic.Bool
	defer stop.Store(true)
	type readRes struct {
		start uint64
		got   []byte
		err   error
	}
	read := func(r *ring.Ring) <-chan readRes {
		c := make(chan readRes, 1)
		go func() {
			var b bytes.Buffer
			s, _, err := shmtest.ReadStream(r, nil, &b, deadline)
			c <- readRes{s, b.Bytes(), err}
		}()
		return c
	}
	aGot, bGot := read(p.sa.R), read(p.sb.R)
	aW, bW := endless(p.sa.W, aStart, 1, &stop), endless(p.sb.W, bStart, 2, &stop)
	for p.sa.Stats().BytesOut < 1<<20 || p.sb.Stats().BytesOut < 1<<20 {
		if time.Now().After(deadline) {
			t.Fatalf("no stream both ways\n%s", p.state())
		}
		time.Sleep(5 * time.Millisecond)
	}
	p.fa.stop <- proto.ReasonPolicy
	p.fb.stop <- proto.ReasonPolicy
	var xa, xb relay.End
	for _, w := range []struct {
		f *flowsFake
		e *relay.End
	}{{p.fa, &xa}, {p.fb, &xb}} {
		select {
		case *w.e = <-w.f.stopped:
		case <-time.After(time.Until(deadline)):
			t.Fatalf("a room did not say where its bridge stopped\n%s", p.state())
		}
		if !w.e.Started || !w.f.inLeft.Load() {
			t.Fatalf("a room's end %+v, the other VM's stretch whole in its VM's ring %v; want both\n%s", *w.e, w.f.inLeft.Load(), p.state())
		}
	}
	// The VMs' RESUME: each stops its bridge, its read ring left where
	// the bytes its bridge wrote end.
	ea, eb := p.sa.Stop(proto.ReasonPolicy), p.sb.Stop(proto.ReasonPolicy)
	if ea.X != xb.X || eb.X != xa.X {
		t.Fatalf("A's read ring ended at %d, B's room stopped at %d; B's read ring at %d, A's room at %d\n%s", ea.X, xb.X, eb.X, xa.X, p.state())
	}
	for _, w := range []struct {
		who   string
		s     *vstretch.Stretch
		start uint64
		x     uint64
	}{{"A", p.sa, aStart, xa.X}, {"B", p.sb, bStart, xb.X}} {
		if freed := w.s.Stats().Freed; freed > w.x-w.start {
			t.Fatalf("%s's write ring freed %d bytes, past its room's X %d (%d bytes)\n%s", w.who, freed, w.x, w.x-w.start, p.state())
		}
	}
	for _, w := range []struct {
		who   string
		c     <-chan readRes
		start uint64
		seed  uint64
		x     uint64
	}{{"A", aGot, bStart, 2, xb.X}, {"B", bGot, aStart, 1, xa.X}} {
		var r readRes
		select {
		case r = <-w.c:
		case <-time.After(time.Until(deadline)):
			t.Fatalf("%s's reader did not end at the leave mark\n%s", w.who, p.state())
		}
		if r.err != nil || r.start != w.start || uint64(len(r.got)) != w.x-w.start || !prefix(w.seed, r.got) {
			t.Fatalf("%s read start %d, %d bytes (want %d, the other's stream to its room's X), in order %v, err %v\n%s",
				w.who, r.start, len(r.got), w.x-w.start, prefix(w.seed, r.got), r.err, p.state())
		}
	}
	stop.Store(true)
	p.sa.W.Abort(0, &wait.Policy{}) // wakes the writers
	p.sb.W.Abort(0, &wait.Policy{})
	<-aW
	<-bW
	for _, c := range []<-chan struct{}{p.servedA, p.servedB} {
		select {
		case <-c:
		case <-time.After(time.Until(deadline)):
			t.Fatalf("a room's serve did not end\n%s", p.state())
		}
	}
}
