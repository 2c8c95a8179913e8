package relay

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// The bridge's cost, guest ring to guest ring through both hosts' bridges
// and a link over loopback TCP, against kernel TCP on loopback: 64 KiB
// streaming and an 8-byte ping-pong, as the link's benchmarks measure
// (docs/crosshost.md, "The bridge": run interleaved, under the heavy
// lock). Rings of 1 MiB (hostd's default for bulk flows), the link's
// default window.

func BenchmarkBridgeStream64KiB(b *testing.B) {
	b.Run("tcp", onTCP(stream))
	b.Run("bridge", func(b *testing.B) {
		a, c, done := bridgedConns(b, testPolicy)
		defer done()
		stream(b, a, c)
	})
}

func BenchmarkBridgePingPong8B(b *testing.B) {
	b.Run("tcp", onTCP(pingPong))
	b.Run("bridge", func(b *testing.B) {
		a, c, done := bridgedConns(b, testPolicy)
		defer done()
		pingPong(b, a, c)
	})
	// The guests' ends also sleep in a Hub (h1's link's): their sleeps
	// hold no P of their own, as none does in hostd, where the guests
	// are other processes. What is left is the bridges' and the link's
	// (and one P held by each host's Hub).
	b.Run("bridge-guesthub", func(b *testing.B) {
		a, c, done := bridgedConns(b, nil)
		defer done()
		pingPong(b, a, c)
	})
}

// ringConn is a guest's ring pair as an io.ReadWriter, with the
// libraries' blocking waits (spin, then a futex).
// The calls in progress are counted, so that the benchmark's end waits
// for them (its goroutines outlive it) before the rings are unmapped.
type ringConn struct {
	w    *ring.Writer
	rd   *ring.Reader
	busy atomic.Int32
}

func (c *ringConn) Read(p []byte) (int, error) {
	c.busy.Add(1)
	defer c.busy.Add(-1)
	return c.rd.Read(p)
}

func (c *ringConn) Write(p []byte) (int, error) {
	c.busy.Add(1)
	defer c.busy.Add(-1)
	return c.w.Write(p)
}

// bridgedConns is guest a's and guest b's ring pairs, bridged across a
// link of two loopback connections, both directions started; the guests'
// ends wait as guest says (nil: in h1's link's Hub).
func bridgedConns(b *testing.B, guest *wait.Policy) (*ringConn, *ringConn, func()) {
	x := newBridged(b, 1<<20, 0, 1)
	if guest == nil {
		guest = x.la.(*Link).waitPolicy()
	}
	end := func(wr, rr *ring.Ring) *ringConn {
		w, err := ring.NewWriter(wr, guest)
		if err != nil {
			b.Fatal(err)
		}
		rd, err := ring.NewReader(rr, guest)
		if err != nil {
			b.Fatal(err)
		}
		rd.Attach()
		return &ringConn{w: w, rd: rd}
	}
	a, c := end(x.h1.ab, x.h1.ba), end(x.h2.ba, x.h2.ab)
	for _, e := range []*ringConn{a, c} {
		for t := time.Now(); !e.w.ReaderAttached(); time.Sleep(100 * time.Microsecond) {
			if time.Since(t) > 5*time.Second {
				b.Fatalf("the bridge did not attach: %s", x.state())
			}
		}
		e.w.Start(0)
	}
	var once atomic.Bool
	return a, c, func() {
		if once.Swap(true) {
			return
		}
		x.b1.Stop(proto.ReasonShutdown)
		x.b2.Stop(proto.ReasonShutdown)
		for _, e := range []*ringConn{a, c} {
			e.w.Close()
			e.rd.Close()
		}
		for _, e := range []*ringConn{a, c} {
			for t := time.Now(); e.busy.Load() != 0; time.Sleep(100 * time.Microsecond) {
				if time.Since(t) > 5*time.Second {
					b.Fatalf("a guest call did not return at Close")
				}
			}
		}
	}
}
