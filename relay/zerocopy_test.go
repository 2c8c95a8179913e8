package relay

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// zcFlows is one flow over two fake RDMA links, with a registered region
// of seeded bytes on a's side.
type zcFlows struct {
	la, lb *RDMALink
	va, vb *fakeVerbs
	fa, fb *Flow
	mem    []byte
	reg    *Region
	z      *zcFlow
}

func newZCFlows(t *testing.T) *zcFlows {
	t.Helper()
	la, lb, va, vb := rdmaLinks(t, MinRing, 16, RDMAOptions{})
	x := &zcFlows{la: la, lb: lb, va: va, vb: vb, mem: seeded(7, 1<<20)}
	var err error
	if x.reg, err = la.Register(x.mem); err != nil {
		t.Fatal(err)
	}
	if x.fa, err = la.Open(1); err != nil {
		t.Fatal(err)
	}
	if x.fb, err = lb.Open(1); err != nil {
		t.Fatal(err)
	}
	if !x.fa.WaitOpen(10 * time.Second) {
		t.Fatal("the flow did not open")
	}
	if x.z = newZCFlow(x.fa, x.reg); x.z == nil {
		t.Fatal("no zero-copy sender for a region of the flow's link")
	}
	return x
}

// readN reads n bytes from f within 10 s.
func readN(t *testing.T, f *Flow, n int) []byte {
	t.Helper()
	got := make([]byte, n)
	done := make(chan error, 1)
	go func() { _, err := io.ReadFull(f, got); done <- err }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("read: %v; %s", err, f.state())
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("read %d bytes: not within 10s; %s", n, f.state())
	}
	return got
}

func (x *zcFlows) violations() []string {
	x.va.mu.Lock()
	defer x.va.mu.Unlock()
	return append([]string(nil), x.va.violation...)
}

// TestZeroCopyBySGE: a payload in a registered region goes by scatter
// entry, the NIC (fake) reading it from the region: the link's Gathered
// and the fake's bytes read under the region's key both equal the
// payload, and the peer gets it intact. A small payload, and one outside
// the registration, are copied (Gathered does not move).
func TestZeroCopyBySGE(t *testing.T) {
	x := newZCFlows(t)
	p := x.mem[1000 : 1000+300<<10] // two frames: 256 KiB and 44 KiB
	if _, err := x.fa.writeFrom(p, x.z); err != nil {
		t.Fatal(err)
	}
	if got := readN(t, x.fb, len(p)); !bytes.Equal(got, p) {
		t.Fatalf("payload differs at %d", firstDiff(got, p))
	}
	st := x.la.Stats()
	if st.Gathered != uint64(len(p)) || st.GatherWrites == 0 || x.va.gatheredFrom(x.reg.key) != uint64(len(p)) {
		t.Fatalf("gathered %d in %d writes, the NIC read %d from the region; want %d", st.Gathered, st.GatherWrites, x.va.gatheredFrom(x.reg.key), len(p))
	}
	small := x.mem[5 : 5+zcMin-1]
	outside := seeded(8, 64<<10)
	for _, q := range [][]byte{small, outside} {
		if _, err := x.fa.writeFrom(q, x.z); err != nil {
			t.Fatal(err)
		}
		if got := readN(t, x.fb, len(q)); !bytes.Equal(got, q) {
			t.Fatalf("copied payload of %d bytes differs at %d", len(q), firstDiff(got, q))
		}
	}
	if st := x.la.Stats(); st.Gathered != uint64(len(p)) {
		t.Fatalf("gathered %d after copies; want %d", st.Gathered, len(p))
	}
	x.z.wait()
	x.reg.Deregister()
	if v := x.violations(); len(v) > 0 || x.va.regs[x.reg.key] != nil {
		t.Fatalf("deregistration: %v; still registered: %v", v, x.va.regs[x.reg.key] != nil)
	}
}

// TestOffsetIn: where a slice lies in a region, and every way it can lie
// outside.
func TestOffsetIn(t *testing.T) {
	mem := make([]byte, 4096)
	other := make([]byte, 4096)
	for _, c := range []struct {
		name string
		p    []byte
		off  uint64
		ok   bool
	}{
		{"whole", mem, 0, true},
		{"inside", mem[100:200], 100, true},
		{"at the end", mem[4000:4096], 4000, true},
		{"empty", mem[10:10], 0, false},
		{"another buffer", other[:100], 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			off, ok := offsetIn(mem, c.p)
			if ok != c.ok || (ok && off != c.off) {
				t.Fatalf("offsetIn: %d, %v; want %d, %v", off, ok, c.off, c.ok)
			}
		})
	}
	// Slices of a larger buffer of which the region is a part.
	big := make([]byte, 8192)
	if _, ok := offsetIn(big[:4096], big[4000:4200]); ok {
		t.Fatal("a slice past the region's end was taken")
	}
	if _, ok := offsetIn(big[100:4096], big[50:200]); ok {
		t.Fatal("a slice before the region's start was taken")
	}
}

// TestZeroCopyUnregisteredRefused: a gather from memory no longer
// registered (behind the link's back) is refused by the NIC (fake: a
// local protection error, as a device gives): the link ends, nothing is
// read from that memory.
func TestZeroCopyUnregisteredRefused(t *testing.T) {
	x := newZCFlows(t)
	if err := x.va.Deregister(x.reg.key); err != nil {
		t.Fatal(err)
	}
	if _, err := x.fa.writeFrom(x.mem[:64<<10], x.z); err != nil {
		t.Fatal(err)
	}
	select {
	case <-x.la.Finished():
	case <-time.After(10 * time.Second):
		t.Fatal("the link did not end")
	}
	if err := x.la.Err(); err == nil || !strings.Contains(err.Error(), "local protection") {
		t.Fatalf("link error %v; want a local protection error", err)
	}
	if g := x.va.gatheredFrom(x.reg.key); g != 0 {
		t.Fatalf("the NIC read %d bytes of unregistered memory", g)
	}
	if _, err := x.la.Register(x.mem); err == nil {
		t.Fatal("a finished link registered memory")
	}
}

// TestZeroCopyRegisterRefused: verbs that gather too few entries give no
// registration (the relay copies).
func TestZeroCopyRegisterRefused(t *testing.T) {
	va, vb := fakePair(MinRing, 16)
	va.maxSGE = 2
	la := NewRDMALink(va, RDMAOptions{})
	lb := NewRDMALink(vb, RDMAOptions{})
	defer func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() }()
	if _, err := la.Register(make([]byte, 4096)); !errors.Is(err, ErrNoGather) {
		t.Fatalf("register: %v; want ErrNoGather", err)
	}
}

// TestZeroCopyDeregisterWaits: a region's deregistration waits for the
// writes that gather from it: with a write held in the (fake) NIC, the
// registration stays until it completed (the fake records a removal
// under a posted read as a violation); frames written meanwhile are
// copied; after Deregister the memory may be unmapped.
func TestZeroCopyDeregisterWaits(t *testing.T) {
	x := newZCFlows(t)
	x.va.holdWrites()
	p := x.mem[:100<<10]
	if _, err := x.fa.writeFrom(p, x.z); err != nil {
		t.Fatal(err)
	}
	waitState(t, "the write posted", func() bool { return x.va.heldWrites() > 0 })
	dereg := make(chan struct{})
	go func() { x.reg.Deregister(); close(dereg) }()
	waitState(t, "the deregistration begun", func() bool { x.reg.mu.Lock(); defer x.reg.mu.Unlock(); return x.reg.closing })
	select {
	case <-dereg:
		t.Fatal("Deregister returned with a write reading the region in flight")
	default:
	}
	q := x.mem[200<<10 : 300<<10]
	if _, err := x.fa.writeFrom(q, x.z); err != nil {
		t.Fatal(err)
	}
	x.va.releaseWrites()
	deadline(t, 10*time.Second, "Deregister", dereg, x.fa.state)
	got := readN(t, x.fb, len(p)+len(q))
	if !bytes.Equal(got[:len(p)], p) || !bytes.Equal(got[len(p):], q) {
		t.Fatal("bytes differ")
	}
	if v := x.violations(); len(v) > 0 {
		t.Fatal(v)
	}
	if g := x.la.Stats().Gathered; g != uint64(len(p)) {
		t.Fatalf("gathered %d; want %d (the second write copied)", g, len(p))
	}
	if x.la.Err() != nil {
		t.Fatalf("the link ended: %v", x.la.Err())
	}
}

// TestZeroCopyDeregisterBounded: a write that never completes (a peer
// that never lets it through) does not hold Deregister for ever: past
// zcWait the link ends (its queue pair freed: no more reads), then it
// returns.
func TestZeroCopyDeregisterBounded(t *testing.T) {
	old := zcWait
	zcWait = 100 * time.Millisecond
	defer func() { zcWait = old }()
	x := newZCFlows(t)
	x.va.holdWrites()
	defer x.va.releaseWrites()
	if _, err := x.fa.writeFrom(x.mem[:64<<10], x.z); err != nil {
		t.Fatal(err)
	}
	waitState(t, "the write posted", func() bool { return x.va.heldWrites() > 0 })
	dereg := make(chan struct{})
	go func() { x.reg.Deregister(); close(dereg) }()
	deadline(t, 10*time.Second, "Deregister", dereg, x.fa.state)
	if !errors.Is(x.la.Err(), errZCStuck) {
		t.Fatalf("link error %v; want %v", x.la.Err(), errZCStuck)
	}
	select {
	case <-x.la.Finished():
	default:
		t.Fatal("Deregister returned before the link finished")
	}
}

// waitState waits for cond, a state that stays once reached, for at most
// 10 s.
func waitState(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// zcBridged bridges two hosts over fake RDMA links, each host's region
// registered on its link.
func zcBridged(t *testing.T, capacity int) (*bridged, *RDMALink, *RDMALink, *fakeVerbs, *fakeVerbs, *Region, *Region) {
	t.Helper()
	la, lb, va, vb := rdmaLinks(t, MinRing, 16, RDMAOptions{Window: 256 << 10})
	h1, h2 := newPair(t, capacity), newPair(t, capacity)
	r1, err := la.Register(h1.reg.Mem())
	if err != nil {
		t.Fatal(err)
	}
	r2, err := lb.Register(h2.reg.Mem())
	if err != nil {
		t.Fatal(err)
	}
	x := onPairs(t, la, lb, nil, nil, h1, h2, 5, BridgeOptions{Region: r1}, BridgeOptions{Region: r2})
	return x, la, lb, va, vb, r1, r2
}

// TestZeroCopyBridge: seeded 4 MiB streams both ways from guest ring to
// guest ring, each host's bridge sending from its registered region:
// every byte arrives once, in order (checksums); the NIC (fake) read the
// bytes the links count as gathered from the regions' keys, and most of
// each stream went that way; after the bridges stopped and the regions
// were deregistered, no write read a region after its registration went.
func TestZeroCopyBridge(t *testing.T) {
	const size = 4 << 20
	x, la, lb, va, vb, r1, r2 := zcBridged(t, 256<<10)
	a := &bstream{start: 1000, data: seeded(1, size)}
	b := &bstream{start: 1 << 40, data: seeded(2, size)}
	var stop atomic.Bool
	x.run(t, 2*time.Minute, a, b, true, &stop, nil)
	a.check(t, "a to b")
	b.check(t, "b to a")
	for _, c := range []struct {
		name string
		l    *RDMALink
		v    *fakeVerbs
		r    *Region
	}{{"h1", la, va, r1}, {"h2", lb, vb, r2}} {
		st := c.l.Stats()
		if st.Gathered == 0 || st.Gathered != c.v.gatheredFrom(c.r.key) || st.Gathered > size {
			t.Fatalf("%s: gathered %d, the NIC read %d from the region; stream %d", c.name, st.Gathered, c.v.gatheredFrom(c.r.key), size)
		}
		t.Logf("%s: %d of %d bytes gathered from the guest's ring, in %d of %d writes", c.name, st.Gathered, size, st.GatherWrites, st.Writes)
	}
	x.b1.Stop(proto.ReasonShutdown)
	x.b2.Stop(proto.ReasonShutdown)
	r1.Deregister()
	r2.Deregister()
	for _, v := range []*fakeVerbs{va, vb} {
		v.mu.Lock()
		viol := v.violation
		v.mu.Unlock()
		if len(viol) > 0 {
			t.Fatal(viol)
		}
	}
}

// TestZeroCopyStopReleased: Bridge.Stop returns within a wake-up even
// while the NIC still holds writes that read the guest's ring (hostd's
// relay calls it on its event loop), and Released closes only once those
// writes completed (the ring's memory may be reused after): with h1's
// writes held in the NIC, Stop returns with the out ring marked left and
// Released still open; it closes after the writes are let go.
func TestZeroCopyStopReleased(t *testing.T) {
	x, _, _, va, _, _, _ := zcBridged(t, 256<<10)
	va.holdWrites()
	var stop atomic.Bool
	var guests sync.WaitGroup
	defer func() { stop.Store(true); x.wakeGuests(); guests.Wait() }() // before the regions go
	defer va.releaseWrites()
	guests.Add(2)
	go func() { defer guests.Done(); _, _ = guestWrite(x.h1.ab, 0, seeded(3, 64<<10), false, &stop) }()
	go func() { defer guests.Done(); _, _, _, _ = guestRead(x.h2.ab, &stop, nil) }()
	waitState(t, "a gather posted", func() bool {
		va.mu.Lock()
		defer va.mu.Unlock()
		for _, n := range va.reading {
			if n > 0 {
				return true
			}
		}
		return false
	})
	stopped := make(chan struct{})
	go func() { x.b1.Stop(proto.ReasonShutdown); close(stopped) }()
	deadline(t, 10*time.Second, "Stop (with the writes held in the NIC)", stopped, x.state)
	rd, err := ring.NewReader(x.h1.ba, &wait.Policy{})
	if err != nil {
		t.Fatal(err)
	}
	if !rd.WriterLeft() {
		t.Fatal("Stop returned but the ring h1's guest reads is not marked left")
	}
	select {
	case <-x.b1.Released():
		t.Fatalf("Released closed while the NIC still holds %d writes reading the ring", va.heldWrites())
	default:
	}
	if va.heldWrites() == 0 {
		t.Fatal("the held writes went before they were let go")
	}
	va.releaseWrites()
	deadline(t, 10*time.Second, "Released (the writes let go)", x.b1.Released(), x.state)
	if err := x.la.Err(); err != nil {
		t.Fatalf("the link ended: %v", err)
	}
	va.mu.Lock()
	defer va.mu.Unlock()
	if len(va.violation) > 0 {
		t.Fatalf("the NIC read memory no longer registered: %v", va.violation)
	}
}

// TestZeroCopyOtherLinkIgnored: a registration of another link (the
// link was replaced, or the flow is on a TCP link) gives the bridge no
// frames by reference: it copies.
func TestZeroCopyOtherLinkIgnored(t *testing.T) {
	x := newZCFlows(t)
	other, _, _, _ := rdmaLinks(t, MinRing, 16, RDMAOptions{})
	reg, err := other.Register(x.mem)
	if err != nil {
		t.Fatal(err)
	}
	if newZCFlow(x.fa, reg) != nil {
		t.Fatal("a flow took a region of another RDMA link")
	}
	la, _ := links(t, 1, LinkOptions{})
	f, err := la.Open(9)
	if err != nil {
		t.Fatal(err)
	}
	if newZCFlow(f, x.reg) != nil || newZCFlow(f, nil) != nil {
		t.Fatal("a TCP link's flow took an RDMA link's region")
	}
}

// TestZeroCopyMixedBatches: 8 flows write seeded spans from one
// registered region, half of them small (up to 8 KiB: copied below 4 KiB,
// else by reference), half up to 300 KiB, over a
// device that gathers only 3 entries (the fewest Register takes), so
// batches end early and mix runs of the send buffer with entries of the
// region: every flow's bytes arrive in order, and the fake NIC read
// exactly what the link counts as gathered.
func TestZeroCopyMixedBatches(t *testing.T) {
	va, vb := fakePair(MinRing, 16)
	va.maxSGE = 3
	_, _ = va.PostRecv(16), vb.PostRecv(16) // as DialRDMA posts them
	la, lb := NewRDMALink(va, RDMAOptions{}), NewRDMALink(vb, RDMAOptions{})
	defer func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() }()
	mem := seeded(11, 2<<20)
	reg, err := la.Register(mem)
	if err != nil {
		t.Fatal(err)
	}
	const flows, spans = 8, 40
	var wg sync.WaitGroup
	errs := make(chan error, 2*flows)
	for i := range flows {
		fa, err := la.Open(uint32(100 + i))
		if err != nil {
			t.Fatal(err)
		}
		fb, err := lb.Open(uint32(100 + i))
		if err != nil {
			t.Fatal(err)
		}
		z := newZCFlow(fa, reg)
		rng := seeded(uint64(i), 2*spans)
		var want []byte
		var ps [][]byte
		for k := range spans {
			n := 1 + int(rng[2*k+1])*32 // small: up to 8 KiB, copied below zcMin
			if rng[2*k]&1 == 1 {
				n = 1 + (int(rng[2*k])<<8|int(rng[2*k+1]))*300<<10/65536 // up to 300 KiB
			}
			off := (k * 37 << 10) % (len(mem) - n)
			ps = append(ps, mem[off:off+n])
			want = append(want, mem[off:off+n]...)
		}
		wg.Add(2)
		go func() {
			defer wg.Done()
			for _, p := range ps {
				if _, err := fa.writeFrom(p, z); err != nil {
					errs <- err
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			got := make([]byte, len(want))
			if _, err := io.ReadFull(fb, got); err != nil {
				errs <- err
				return
			}
			if !bytes.Equal(got, want) {
				errs <- fmt.Errorf("flow %d: bytes differ at %d", 100+i, firstDiff(got, want))
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	deadline(t, 30*time.Second, "8 flows", done, func() string { return fmt.Sprintf("links: %v / %v", la.Err(), lb.Err()) })
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	st := la.Stats()
	if st.Gathered == 0 || st.Gathered != va.gatheredFrom(reg.key) {
		t.Fatalf("gathered %d, the NIC read %d from the region", st.Gathered, va.gatheredFrom(reg.key))
	}
	t.Logf("%d bytes gathered in %d of %d writes (%d frames)", st.Gathered, st.GatherWrites, st.Writes, st.Frames)
}
