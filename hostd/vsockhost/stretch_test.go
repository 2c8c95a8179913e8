//go:build linux

package vsockhost

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/guestlib/vstretch"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// flowsFake is hostd's record of one flow between the VM (guest vm, side
// A: it writes ring AB) and a process guest, in a real region.
type flowsFake struct {
	vm             uint32
	hello          relay.Hello
	ab, ba         *ring.Ring
	gone, peerGone chan struct{} // the broker's word that an end is done
	stop           chan proto.Reason
	stopped        chan relay.End // Held.Stopped's report (Start unset)
	onRelease      func()         // what the broker does at the release
	pair           bool           // Held.Pair: the other end is another room's VM
	inLeft         atomic.Bool    // Held.Stopped's inLeft
	mu             sync.Mutex
	held           bool
	freed          chan struct{}
}

func (f *flowsFake) Stretch(guest uint32, h relay.Hello) (Held, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case guest != f.vm || (relay.Hello{Region: h.Region, Slot: h.Slot, Gen: h.Gen}) != f.hello:
		return Held{}, fmt.Errorf("guest %d has no flow %+v", guest, h)
	case f.held:
		return Held{}, errors.New("the flow has a stretch")
	}
	f.held = true
	release := func() {
		if f.onRelease != nil {
			f.onRelease()
		}
		close(f.freed)
	}
	stopped := func(started bool, x uint64, outLeft, inLeft bool) {
		f.inLeft.Store(inLeft)
		f.stopped <- relay.End{Started: started, X: x}
	}
	return Held{Writes: f.ab, Reads: f.ba, Gone: f.gone, PeerGone: f.peerGone, Release: release, Stop: f.stop, Pair: f.pair, Stopped: stopped}, nil
}

func newFlowsFake(t *testing.T, capacity int) *flowsFake {
	reg, _ := shmtest.Region(t, region.Geometry{Size: int64(4*capacity + 1<<20), Slots: 4})
	pool := region.NewPool(reg, nil)
	slot, e, err := pool.Alloc(region.Request{OwnerA: 3, OwnerB: 4, Capacity: capacity})
	if err != nil {
		t.Fatal(err)
	}
	ab, ba, err := reg.Rings(slot, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	return &flowsFake{vm: 3, hello: relay.Hello{Region: 9, Slot: uint32(slot), Gen: e.Gen}, ab: ab, ba: ba,
		gone: make(chan struct{}), peerGone: make(chan struct{}), freed: make(chan struct{}),
		stop: make(chan proto.Reason, 1), stopped: make(chan relay.End, 1)}
}

// streamPair is a stream between the VM's side (vm) and the room (host),
// over loopback TCP standing for a vsock stream.
func streamPair(t *testing.T) (vm, host net.Conn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	vm, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	host, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return vm, host
}

func seeded(seed uint64, n int64) io.Reader {
	var b [32]byte
	for i := range b {
		b[i] = byte(seed >> (8 * (i % 8)))
	}
	return io.LimitReader(rand.NewChaCha8(b), n)
}

func sum(r io.Reader) []byte {
	h := sha256.New()
	io.Copy(h, r)
	return h.Sum(nil)
}

// ringEnd is one direction of exchangeRings: seeded bytes written to w
// from start, read from r by who.
type ringEnd struct {
	w, r  *ring.Ring
	start uint64
	who   string
}

// exchangeRings writes n seeded bytes each way at once (seed 1 for a,
// 2 for b) and checks that each reader got its stream whole, from its
// exact start (SHA-256); state says both ends' state on a failure.
func exchangeRings(t *testing.T, n int64, deadline time.Time, a, b ringEnd, state func() string) {
	t.Helper()
	got := []<-chan shmtest.Sum{shmtest.ReadSum(a.r, nil, deadline), shmtest.ReadSum(b.r, nil, deadline)}
	var errs []chan error
	for i, e := range []ringEnd{a, b} {
		c := make(chan error, 1)
		go func() { _, err := shmtest.WriteStream(e.w, nil, e.start, seeded(uint64(i+1), n), deadline); c <- err }()
		errs = append(errs, c)
	}
	for _, c := range errs {
		if err := <-c; err != nil {
			t.Fatalf("writer: %v\n%s", err, state())
		}
	}
	for i, e := range []ringEnd{a, b} {
		r := <-got[i]
		want := sum(seeded(uint64(i+1), n))
		if r.Err != nil || r.Start != e.start || r.N != n || !bytes.Equal(r.Sum, want) {
			t.Fatalf("%s read: start %d (want %d), %d bytes (want %d), sum ok %v, err %v\n%s", e.who, r.Start, e.start, r.N, n,
				bytes.Equal(r.Sum, want), r.Err, state())
		}
	}
}

// stretchRig is a stretch's flow with rings of capacity, the room serving
// its stream (served closes when serve returns) and the VM's stretch.
func stretchRig(t *testing.T, capacity int) (*flowsFake, *stretches, *vstretch.Stretch, <-chan struct{}) {
	f := newFlowsFake(t, capacity)
	vmc, hostc := streamPair(t)
	st := &stretches{open: map[*relay.Bridge]bool{}}
	served := make(chan struct{})
	go func() { defer close(served); st.serve(hostc, 3, f, nil, hclog.NewNullLogger()) }()
	s, err := vstretch.Open(vmc, f.hello, capacity, nil)
	if err != nil {
		t.Fatal(err)
	}
	return f, st, s, served
}

// TestStretch: a VM's stretch carries 8 MiB each way at once between the
// library's rings in the VM (vstretch) and a process guest's real ring
// pair, through the room's bridge: every byte in order (SHA-256), each
// writer's start offset arrives exact, each writer's leave ends the other
// side's read, and the flow's rings are released once the bridge stopped.
func TestStretch(t *testing.T) {
	const capacity, n = 256 << 10, 8 << 20
	const vmStart, procStart = 1234567, 7654321
	f, st, s, served := stretchRig(t, capacity)
	defer s.Close()
	deadline := time.Now().Add(60 * time.Second) // a way out, not a speed claim
	state := func() string {
		return fmt.Sprintf("vm bridge %v %+v; AB %+v; BA %+v; local W %+v; local R %+v", s.Err(), s.Stats(), f.ab.Stats(), f.ba.Stats(), s.W.Stats(), s.R.Stats())
	}
	exchangeRings(t, n, deadline, ringEnd{s.W, f.ab, vmStart, "process guest"}, ringEnd{f.ba, s.R, procStart, "VM"}, state)
	select {
	case <-s.Done():
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the VM's bridge did not end after both directions left\n%s", state())
	}
	if !errors.Is(s.Err(), relay.ErrEnded) {
		t.Fatalf("VM bridge ended with %v", s.Err())
	}
	s.Close()
	select {
	case <-served:
	case <-time.After(time.Until(deadline)):
		t.Fatalf("the room's bridge did not end\n%s", state())
	}
	select {
	case <-f.freed:
	default:
		t.Fatal("the flow's rings were not released after the bridge stopped")
	}
	if st.served != 1 || st.bad != 0 || len(st.open) != 0 {
		t.Fatalf("stretches: served %d bad %d open %d", st.served, st.bad, len(st.open))
	}
}

// TestStretchRefused: a stream that does not open with a Hello of a flow
// of its own VM is closed, counted, and touches no ring; a second stretch
// of a flow is refused too.
func TestStretchRefused(t *testing.T) {
	f := newFlowsFake(t, 64<<10)
	st := &stretches{open: map[*relay.Bridge]bool{}}
	other := f.hello
	other.Gen++
	for i, hello := range [][]byte{
		[]byte("GET / HTTP/1.1\r\nHost: \r\n"), // not a Hello (24 bytes)
		other.Encode(),                         // another generation of the slot
		relay.Hello{Region: 1}.Encode(),        // no such flow
		f.hello.Encode(),                       // the right flow, but as guest 4 (below)
	} {
		vmc, hostc := streamPair(t)
		guest := uint32(3)
		if i == 3 {
			guest = 4
		}
		done := make(chan struct{})
		go func() { defer close(done); st.serve(hostc, guest, f, nil, hclog.NewNullLogger()) }()
		vmc.Write(hello)
		vmc.SetReadDeadline(time.Now().Add(30 * time.Second))
		if k, err := vmc.Read(make([]byte, 1)); k != 0 || err == nil || errors.Is(err, errTimeout) {
			t.Fatalf("hello %d: stream not closed: %d %v", i, k, err)
		}
		<-done
		vmc.Close()
	}
	if st.bad != 4 || st.served != 0 || f.held {
		t.Fatalf("bad %d served %d held %v", st.bad, st.served, f.held)
	}
	if st := f.ab.Stats(); st.Written != 0 || st.Read != 0 {
		t.Fatalf("a refused stream touched the rings: %+v", st)
	}
}

var errTimeout = errors.New("i/o timeout")

// TestStretchStop: a downgrade by RESUME (Held.Stop) stops the room's
// bridge mid-stream, with both directions' rings full, and the room says
// where the ring the VM writes ended (Held.Stopped); the VM's side, told
// by its RESUME, stops its own bridge the same way. Each receiving ring
// is left at its X, and each writer's ring still holds every byte from
// the other side's X to its end W, which it resends on TCP: nothing is
// freed that the other ring does not hold.
func TestStretchStop(t *testing.T) {
	const capacity = 64 << 10
	const vmStart, procStart = 1000, 5000
	f, _, s, served := stretchRig(t, capacity)
	defer s.Close()
	for _, r := range []*ring.Ring{f.ab, s.R} { // readers that attach and never read
		rd, err := ring.NewReader(r, nil)
		if err != nil {
			t.Fatal(err)
		}
		rd.Attach()
	}
	full := time.Now().Add(time.Second) // long enough to fill rings and link
	write := func(r *ring.Ring, start, seed uint64) chan error {
		c := make(chan error, 1)
		go func() { _, err := shmtest.WriteStream(r, nil, start, seeded(seed, 1<<30), full); c <- err }()
		return c
	}
	vmW, procW := write(s.W, vmStart, 1), write(f.ba, procStart, 2)
	<-vmW
	<-procW
	f.stop <- proto.ReasonPolicyReload
	var hostEnd relay.End
	select {
	case hostEnd = <-f.stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("the room did not report where the bridge stopped")
	}
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatal("the room's bridge did not end after the stop")
	}
	vmEnd := s.Stop(proto.ReasonPolicyReload)
	ab, ba, w, r := f.ab.Stats(), f.ba.Stats(), s.W.Stats(), s.R.Stats()
	state := fmt.Sprintf("host end %+v, VM end %+v; AB %+v; BA %+v; VM W %+v; VM R %+v", hostEnd, vmEnd, ab, ba, w, r)
	if !hostEnd.Started || hostEnd.X != vmStart+ab.Written || !ab.Left || ab.Written == 0 {
		t.Fatalf("the room's end is not the ring it wrote: %s", state)
	}
	if !vmEnd.Started || vmEnd.X != procStart+r.Written || !r.Left || r.Written == 0 {
		t.Fatalf("the VM's end is not the ring its bridge wrote: %s", state)
	}
	// Each writer's ring still holds [X, W): its freed bytes are at most
	// what the other ring holds, and its stretch reaches past X.
	if w.Read > ab.Written || w.Written < ab.Written {
		t.Fatalf("the VM's write ring freed bytes the host's ring does not hold: %s", state)
	}
	if ba.Read > r.Written || ba.Written < r.Written {
		t.Fatalf("the process guest's write ring freed bytes the VM's ring does not hold: %s", state)
	}
	select {
	case <-f.freed:
	default:
		t.Fatal("the flow's rings were not released after the stop")
	}
}

// TestStretchVMToVM: two VMs' stretches on one flow, each bridged by its
// own room (its own device's stretches) onto the flow's real ring pair:
// 8 MiB each way at once between the two VMs' own rings (A's ring, A's
// stream, A's room bridge, ring AB, B's room bridge, B's stream, B's
// ring), every byte in order, exact starts, each writer's leave ending
// the other's read; all four bridges end by themselves and both sides
// are released.
func TestStretchVMToVM(t *testing.T) {
	const capacity, n = 256 << 10, 8 << 20
	const aStart, bStart = 1234567, 7654321
	fa := newFlowsFake(t, capacity)
	fb := &flowsFake{vm: 4, hello: fa.hello, ab: fa.ba, ba: fa.ab, // B writes BA, reads AB
		gone: make(chan struct{}), peerGone: make(chan struct{}), freed: make(chan struct{}),
		stop: make(chan proto.Reason, 1), stopped: make(chan relay.End, 1)}
	open := func(f *flowsFake, guest uint32) (*vstretch.Stretch, <-chan struct{}) {
		vmc, hostc := streamPair(t)
		st := &stretches{open: map[*relay.Bridge]bool{}}
		served := make(chan struct{})
		go func() { defer close(served); st.serve(hostc, guest, f, nil, hclog.NewNullLogger()) }()
		s, err := vstretch.Open(vmc, f.hello, capacity, nil)
		if err != nil {
			t.Fatal(err)
		}
		return s, served
	}
	sa, servedA := open(fa, 3)
	defer sa.Close()
	sb, servedB := open(fb, 4)
	defer sb.Close()
	deadline := time.Now().Add(60 * time.Second) // a way out, not a speed claim
	state := func() string {
		return fmt.Sprintf("A's bridge %v %+v; B's bridge %v %+v; AB %+v; BA %+v", sa.Err(), sa.Stats(), sb.Err(), sb.Stats(), fa.ab.Stats(), fa.ba.Stats())
	}
	exchangeRings(t, n, deadline, ringEnd{sa.W, sb.R, aStart, "B"}, ringEnd{sb.W, sa.R, bStart, "A"}, state)
	for _, s := range []*vstretch.Stretch{sa, sb} {
		select {
		case <-s.Done():
		case <-time.After(time.Until(deadline)):
			t.Fatalf("a VM's bridge did not end after both directions left\n%s", state())
		}
		if !errors.Is(s.Err(), relay.ErrEnded) {
			t.Fatalf("a VM's bridge ended with %v\n%s", s.Err(), state())
		}
		s.Close()
	}
	for _, c := range []<-chan struct{}{servedA, servedB} {
		select {
		case <-c:
		case <-time.After(time.Until(deadline)):
			t.Fatalf("a room's bridge did not end\n%s", state())
		}
	}
	for _, f := range []*flowsFake{fa, fb} {
		select {
		case <-f.freed:
		default:
			t.Fatal("a side was not released after its bridge stopped")
		}
	}
}
