package relay

import (
	"bytes"
	"errors"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// rdmaLinks sets up two RDMA links over a fake queue pair pair, through
// DialRDMA over a pipe (the side channel).
func rdmaLinks(t testing.TB, size, depth uint32, o RDMAOptions) (*RDMALink, *RDMALink, *fakeVerbs, *fakeVerbs) {
	t.Helper()
	va, vb := fakePair(size, depth)
	sa, sb := net.Pipe()
	defer sa.Close()
	defer sb.Close()
	type res struct {
		l   *RDMALink
		err error
	}
	ch := make(chan res, 1)
	go func() { l, err := DialRDMA(sb, vb, o); ch <- res{l, err} }()
	la, err := DialRDMA(sa, va, o)
	r := <-ch
	if err != nil || r.err != nil {
		t.Fatalf("dial: %v, %v", err, r.err)
	}
	lb := r.l
	t.Cleanup(func() { la.Close(); lb.Close(); la.Wait(); lb.Wait() })
	return la, lb, va, vb
}

// TestRDMAStreamsBothWays: 16 flows each carry a seeded 1 MiB stream both
// ways over the fake verbs, with the smallest ring (2 MiB) and 16 batches
// in flight, so the ring wraps many times and writers wait for ring
// credit; every byte arrives in order and is acknowledged.
func TestRDMAStreamsBothWays(t *testing.T) {
	la, lb, _, _ := rdmaLinks(t, MinRing, 16, RDMAOptions{Window: 256 << 10})
	streamsBothWays(t, la, lb, 16, 1<<20)
	la.Close()
	lb.Close()
	la.Wait()
	lb.Wait()
	if la.wpos < 4*MinRing || lb.rpos != la.wpos {
		t.Fatalf("a wrote %d ring bytes, b took %d: want several wraps of %d", la.wpos, lb.rpos, MinRing)
	}
}

// TestRDMANoHeadOfLineBlocking: as for the TCP link, a flow whose reader
// never reads stops at its window while another carries 32 MiB.
func TestRDMANoHeadOfLineBlocking(t *testing.T) {
	const window = 128 << 10
	la, lb, _, _ := rdmaLinks(t, MinRing, 32, RDMAOptions{Window: window})
	noHeadOfLineBlocking(t, la, lb, window)
}

func TestRDMADownAndLeftInOrder(t *testing.T) {
	la, lb, _, _ := rdmaLinks(t, MinRing, 32, RDMAOptions{})
	downAndLeftInOrder(t, la, lb)
}

// TestRDMABatching: 64 flows each writing 100 small messages share
// batches: fewer RDMA writes than frames.
func TestRDMABatching(t *testing.T) {
	la, lb, _, _ := rdmaLinks(t, MinRing, 32, RDMAOptions{})
	var fs []*Flow
	for id := range uint32(64) {
		fa, _ := la.Open(id)
		fb, _ := lb.Open(id)
		fs = append(fs, fa, fb)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 100 {
			for j := 0; j < len(fs); j += 2 {
				fs[j].Write([]byte{byte(i), byte(j)})
			}
		}
		for j := 0; j < len(fs); j += 2 {
			fs[j].Left()
		}
	}()
	for j := 1; j < len(fs); j += 2 {
		got, err := io.ReadAll(fs[j])
		if err != nil || len(got) != 200 {
			t.Fatalf("flow %d: %d bytes, %v", j/2, len(got), err)
		}
	}
	<-done
	st := la.Stats()
	if st.Frames < 2*st.Writes {
		t.Fatalf("%d frames in %d writes: want batching", st.Frames, st.Writes)
	}
	t.Logf("%d frames in %d RDMA writes", st.Frames, st.Writes)
}

// TestRDMAQueuePairError: a queue pair in error mid-stream ends the link
// on that side; the writer returns, and no side claims more than
// happened: acked <= taken <= sent.
func TestRDMAQueuePairError(t *testing.T) {
	la, lb, va, _ := rdmaLinks(t, MinRing, 16, RDMAOptions{Window: 64 << 10})
	fa, _ := la.Open(0)
	fb, _ := lb.Open(0)
	// The relay ends the other side once this one failed (its peer is gone).
	cutMidStream(t, fa, fb, va.fail, lb.Close)
	if err := la.Err(); err == nil || !strings.Contains(err.Error(), "flush") {
		t.Fatalf("link error %v, want the completion's status", err)
	}
}

// TestRDMADeviceGone: the device's removal beginning mid-stream (Gone,
// as `rdma link delete` makes the ibv layer's say) ends the link with
// ErrDeviceGone within a few checks, while its queue pair still works (a
// removal that waits for the device's users), and the link releases the
// device (Close); no side claims more than happened.
func TestRDMADeviceGone(t *testing.T) {
	la, lb, va, _ := rdmaLinks(t, MinRing, 16, RDMAOptions{Window: 64 << 10})
	fa, _ := la.Open(0)
	fb, _ := lb.Open(0)
	cut := time.Time{}
	cutMidStream(t, fa, fb, func() { cut = time.Now(); va.gone.Store(true) }, lb.Close)
	if err := la.Err(); !errors.Is(err, ErrDeviceGone) {
		t.Fatalf("link error %v, want ErrDeviceGone", err)
	}
	t.Logf("ended %s after the removal began: %v", time.Since(cut).Round(time.Millisecond), la.Err())
	la.Wait()
	for end := time.Now().Add(5 * time.Second); !va.closed.Load(); time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the link still holds the device 5 s after it ended")
		}
	}
}

// hostileRDMA is a link whose peer is the test: it writes the link's ring
// and credit area by hand and delivers completions with any immediate.
type hostileRDMA struct {
	l *RDMALink
	v *fakeVerbs
}

func newHostileRDMA(t *testing.T, depth uint32) *hostileRDMA {
	va, vb := fakePair(MinRing, depth)
	va.PostRecv(int(depth))
	vb.PostRecv(int(depth))
	l := NewRDMALink(va, RDMAOptions{Window: 4096})
	t.Cleanup(func() { l.Close(); l.Wait() })
	if _, err := l.Open(1); err != nil {
		t.Fatal(err)
	}
	return &hostileRDMA{l: l, v: va}
}

// batch writes b into the link's ring at off and completes it with imm.
func (h *hostileRDMA) batch(off int, b []byte, imm uint32) {
	h.v.mu.Lock()
	copy(h.v.recv[off:], b)
	h.v.mu.Unlock()
	h.v.deliver(Completion{Op: OpRecv, Imm: imm})
}

func (h *hostileRDMA) wantProtocolError(t *testing.T) {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); h.l.Err() == nil; time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the link took it")
		}
	}
	if !errors.Is(h.l.Err(), ErrProtocol) {
		t.Fatalf("link error %v, want a protocol error", h.l.Err())
	}
	t.Log(h.l.Err())
}

// flood writes k batches of about n bytes of DOWN frames for a flow not
// open here, each where the ring rule puts it, each after the link took
// the one before, until the link ends.
func (h *hostileRDMA) flood(k, n int) {
	pad := frames(frame{typ: fDown, flow: 7})
	b := bytes.Repeat(pad, n/len(pad))
	pos := 0
	for range k {
		off := pos % MinRing
		if off+len(b) > MinRing {
			pos += MinRing - off
			off = 0
		}
		pos += len(b)
		want := h.l.Dropped() + uint64(len(b)/len(pad))
		h.batch(off, b, uint32(len(b)))
		for end := time.Now().Add(5 * time.Second); h.l.Dropped() < want && h.l.Err() == nil && time.Now().Before(end); time.Sleep(100 * time.Microsecond) {
		}
		if h.l.Err() != nil {
			return
		}
	}
}

func frames(fs ...frame) []byte {
	var b []byte
	for _, f := range fs {
		b = append(f.header(b), f.data...)
	}
	return b
}

// TestRDMAHostilePeer: what a peer writes into the ring and its credit
// area is untrusted. Immediates that are too small or over a quarter
// ring, batches beyond the ring or batch credit, frames that run past
// their batch or leave stray bytes, bad frames, and ring credit that goes
// back or releases what was never written each end the link with
// ErrProtocol; flow-level violations end it as on the TCP link. A good
// batch beside them is taken.
func TestRDMAHostilePeer(t *testing.T) {
	credit := frame{typ: fCredit, flow: 1}
	data := func(off uint64, n int) frame { return frame{typ: fData, flow: 1, arg: off, data: make([]byte, n)} }
	good := frames(credit, data(0, 100))
	for name, run := range map[string]func(h *hostileRDMA){
		"imm below a header": func(h *hostileRDMA) { h.batch(0, good, 19) },
		"imm over a quarter": func(h *hostileRDMA) { h.batch(0, good, MinRing/4+1) },
		"stray bytes":        func(h *hostileRDMA) { h.batch(0, append(frames(credit), 1, 2, 3), headerSize+3) },
		"frame past its batch": func(h *hostileRDMA) {
			h.batch(0, good, uint32(len(good)-1))
		},
		"bad frame type": func(h *hostileRDMA) {
			b := frames(credit)
			b[0] = 9
			h.batch(0, b, headerSize)
		},
		"beyond credit (flow)": func(h *hostileRDMA) { h.batch(0, frames(credit, data(0, 4097)), 2*headerSize+4097) },
		"beyond the ring": func(h *hostileRDMA) {
			// The link's first release stays in flight: after it, at
			// most a ring more may come; 8 batches of a quarter ring
			// are more.
			h.v.hold.Store(true)
			h.flood(8, MinRing/4)
		},
		"beyond the batches": func(h *hostileRDMA) {
			h.v.hold.Store(true)
			h.flood(12, headerSize) // depth 8, a release after 2
		},
		"credit goes back": func(h *hostileRDMA) {
			for end := time.Now().Add(5 * time.Second); h.l.Stats().Writes < 1 && time.Now().Before(end); time.Sleep(time.Millisecond) {
			}
			f, _ := h.l.Open(2)
			h.batch(0, frames(frame{typ: fCredit, flow: 2}), headerSize)
			atomic.StoreUint64(&h.v.credit[0], headerSize) // the first batch (flow 1's CREDIT): true
			atomic.StoreUint64(&h.v.credit[1], 1)
			f.Write(make([]byte, 100)) // the writer reads it
			time.Sleep(20 * time.Millisecond)
			atomic.StoreUint64(&h.v.credit[0], 0)
			f.Write(make([]byte, 100))
		},
		"credit for bytes never written": func(h *hostileRDMA) {
			f, _ := h.l.Open(2)
			h.batch(0, frames(frame{typ: fCredit, flow: 2}), headerSize)
			atomic.StoreUint64(&h.v.credit[0], 1<<40)
			f.Write(make([]byte, 100))
		},
	} {
		t.Run(name, func(t *testing.T) {
			h := newHostileRDMA(t, 8)
			run(h)
			h.wantProtocolError(t)
		})
	}
	// A good batch, then one that wraps: the position is the link's own.
	h := newHostileRDMA(t, 64)
	f := h.l.flowsFor(1)
	h.batch(0, good, uint32(len(good)))
	got := make([]byte, 150)
	if _, err := io.ReadFull(f, got[:100]); err != nil {
		t.Fatalf("read %v; link %v", err, h.l.Err())
	}
	pad := frames(frame{typ: fDown, flow: 9}) // a flow not open here: dropped
	at, dropped := len(good), uint64(0)
	for range 3 {
		big := bytes.Repeat(pad, (MinRing/4)/len(pad))
		h.batch(at, big, uint32(len(big)))
		at += len(big)
		dropped += uint64(len(big) / len(pad))
		for end := time.Now().Add(5 * time.Second); h.l.Dropped() < dropped; time.Sleep(time.Millisecond) {
			if time.Now().After(end) {
				t.Fatalf("dropped %d of %d; link %v", h.l.Dropped(), dropped, h.l.Err())
			}
		}
	}
	// Under a quarter ring is left before the end: a quarter-ring batch
	// goes to 0, and the link must look for it there.
	wrap := frames(data(100, 50))
	wrap = append(wrap, bytes.Repeat(pad, (MinRing/4-len(wrap))/len(pad))...)
	if MinRing-at >= len(wrap) {
		t.Fatalf("the batch of %d bytes fits at %d", len(wrap), at)
	}
	h.batch(0, wrap, uint32(len(wrap)))
	if _, err := io.ReadFull(f, got[100:]); err != nil {
		t.Fatalf("read %v; link %v", err, h.l.Err())
	}
	if h.l.Err() != nil {
		t.Fatalf("link error %v", h.l.Err())
	}
}

// flowsFor is flow id (open).
func (m *mux) flowsFor(id uint32) *Flow {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.flows[id]
}

// TestRDMAEndpoint: an endpoint survives the side channel; a peer's
// endpoint that is malformed or does not fit is refused.
func TestRDMAEndpoint(t *testing.T) {
	me := Endpoint{QPN: 17, PSN: 99, MTU: 3, Ring: 0xdead0000, RKey: 5, Size: MinRing, Depth: 64}
	me.GID[15] = 1
	got, err := UnmarshalEndpoint(me.Marshal())
	if err != nil || got != me {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	if err := me.Check(got); err != nil {
		t.Fatal(err)
	}
	for name, mod := range map[string]func(e *Endpoint){
		"qpn 0":      func(e *Endpoint) { e.QPN = 0 },
		"qpn 2^24":   func(e *Endpoint) { e.QPN = 1 << 24 },
		"psn 2^24":   func(e *Endpoint) { e.PSN = 1 << 24 },
		"mtu 0":      func(e *Endpoint) { e.MTU = 0 },
		"mtu 6":      func(e *Endpoint) { e.MTU = 6 },
		"other size": func(e *Endpoint) { e.Size *= 2 },
		"depth":      func(e *Endpoint) { e.Depth = 8 },
	} {
		e := me
		mod(&e)
		if err := me.Check(e); !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: %v", name, err)
		}
	}
	b := me.Marshal()
	b[60] = 1
	if _, err := UnmarshalEndpoint(b); err == nil {
		t.Error("reserved bytes taken")
	}
	if _, err := UnmarshalEndpoint(b[:63]); err == nil {
		t.Error("short endpoint taken")
	}
}

// TestRDMADialRefuses: ends whose rings differ do not connect, and a side
// channel that says nothing times out.
func TestRDMADialRefuses(t *testing.T) {
	va, _ := fakePair(MinRing, 16)
	vb, _ := fakePair(2*MinRing, 16)
	sa, sb := net.Pipe()
	defer sa.Close()
	defer sb.Close()
	go DialRDMA(sb, vb, RDMAOptions{})
	if _, err := DialRDMA(sa, va, RDMAOptions{}); !errors.Is(err, ErrProtocol) {
		t.Fatalf("dial with mismatched rings: %v", err)
	}
	sc, sd := net.Pipe()
	defer sc.Close()
	defer sd.Close()
	go io.Copy(io.Discard, sd)
	start := time.Now()
	if _, err := DialRDMA(sc, va, RDMAOptions{Timeout: 200 * time.Millisecond}); err == nil || time.Since(start) > 5*time.Second {
		t.Fatalf("dial to a silent peer: %v after %s", err, time.Since(start))
	}
}

// FuzzRDMABatch: any bytes and immediate in the ring end the link with an
// error or are taken, never a panic.
func FuzzRDMABatch(f *testing.F) {
	f.Add(frames(frame{typ: fCredit, flow: 1}, frame{typ: fData, flow: 1, data: []byte("abc")}), uint32(43))
	f.Add([]byte{1, 0, 0, 0}, uint32(4))
	f.Fuzz(func(t *testing.T, b []byte, imm uint32) {
		va, _ := fakePair(MinRing, 8)
		l := &RDMALink{v: va, size: MinRing, depth: 8, maxBatch: MinRing / 4}
		l.init(4096, 2)
		l.route = func(uint32) func(frame) { return func(frame) {} }
		l.Open(1)
		copy(va.recv, b)
		_ = l.batch(imm)
	})
}
