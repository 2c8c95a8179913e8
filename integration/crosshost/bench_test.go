//go:build linux

package crosshost_test

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/netip"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
)

// The cross-host benchmarks (make bench-cross): a guest on h1 to a guest
// on h2, kernel TCP (through both hosts' forwarding and firewalls) against
// Shunt through the two relays, side by side in one run. Each benchmark
// builds its own two-host rig; `make bench-cross` interleaves rounds.

var crossStacks = []string{"kernel", "shunt"}

// crossBench is a peered pair for benchmarks.
func crossBench(b *testing.B) *pairEnv {
	e := newPair(b, 1, [2][]string{{"10.78.0.0/16"}, {"10.77.0.0/16"}}, [2]bool{true, true})
	e.within(10*time.Second, "both channels up", func() bool {
		a, c := e.peersOf(0), e.peersOf(1)
		return len(a) == 1 && len(c) == 1 && a[0].Announced >= 1 && c[0].Announced >= 1
	})
	return e
}

// dialCross connects h1's guest to port on h2's guest, by stack: kernel
// (h2 serves with a plain socket) or shunt (guestlib both ends, waited
// onto the relay). serve handles h2's end.
func (e *pairEnv) dialCross(b *testing.B, stack string, port int, serve func(net.Conn)) net.Conn {
	g1, g2 := e.f.Hosts[0].Guests[0], e.f.Hosts[1].Guests[0]
	at := netip.AddrPortFrom(g2.Addr, uint16(port))
	if stack == "kernel" {
		var l net.Listener
		if err := nsrig.In(g2.NSPath(), func() (err error) { l, err = net.Listen("tcp4", at.String()); return err }); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { l.Close() })
		go acceptAll(l, serve)
		return g1.Dial(b, at)
	}
	l, err := e.hosts[1].Listen(1, port)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { l.Close() })
	go acceptAll(l, serve)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := e.hosts[0].Dial(ctx, 1, at.String())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return c
}

func acceptAll(l net.Listener, serve func(net.Conn)) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go serve(c)
	}
}

func echo(c net.Conn) { io.Copy(c, c); c.Close() }

// BenchmarkCrossPingPong8B: 8-byte round trips, reported one way.
func BenchmarkCrossPingPong8B(b *testing.B) {
	e := crossBench(b)
	for i, stack := range crossStacks {
		b.Run(stack, func(b *testing.B) {
			c := e.dialCross(b, stack, 7600+i, echo)
			msg, back := make([]byte, 8), make([]byte, 8)
			warm(b, e, c, stack, 7600+i, msg, back)
			for b.Loop() {
				c.Write(msg)
				if _, err := io.ReadFull(c, back); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2/1e3, "us/oneway")
		})
	}
}

// warm makes round trips until a Shunt connection is on the relay (a
// kernel one: a few), so the loop measures the path, not the switch.
func warm(b *testing.B, e *pairEnv, c net.Conn, stack string, port int, msg, back []byte) {
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; ; i++ {
		c.Write(msg)
		if _, err := io.ReadFull(c, back); err != nil {
			b.Fatal(err)
		}
		if stack == "kernel" && i > 100 {
			return
		}
		if stack == "shunt" && i%50 == 0 {
			if f, ok := e.connOn(0, port); ok && f.Path == "rings" && f.Via != "" && f.RingsAB > 0 {
				return
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("not on the relay within 10 s\n%s", e.flows())
		}
	}
}

// sink counts what it reads and, at EOF, writes the count (8 bytes).
func sink(c net.Conn) {
	buf := make([]byte, 256<<10)
	var n uint64
	for {
		k, err := c.Read(buf)
		n += uint64(k)
		if err != nil {
			break
		}
	}
	var out [8]byte
	binary.LittleEndian.PutUint64(out[:], n)
	c.Write(out[:])
	c.Close()
}

// BenchmarkCrossStream64K: 64 KiB writes from h1's guest to a sink on
// h2's; the figure counts what the sink received.
func BenchmarkCrossStream64K(b *testing.B) {
	e := crossBench(b)
	for i, stack := range crossStacks {
		b.Run(stack, func(b *testing.B) {
			c := e.dialCross(b, stack, 7610+i, sink)
			buf := make([]byte, 64<<10)
			if stack == "shunt" {
				deadline := time.Now().Add(10 * time.Second)
				for {
					c.Write(buf[:1])
					if f, ok := e.connOn(0, 7610+i); ok && f.Path == "rings" && f.Via != "" {
						break
					}
					if time.Now().After(deadline) {
						b.Fatalf("not on the relay within 10 s\n%s", e.flows())
					}
					time.Sleep(20 * time.Millisecond)
				}
			}
			b.SetBytes(int64(len(buf)))
			sent := uint64(0)
			for b.Loop() {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
				sent += uint64(len(buf))
			}
			c.(interface{ CloseWrite() error }).CloseWrite()
			var got [8]byte
			c.SetReadDeadline(time.Now().Add(30 * time.Second))
			if _, err := io.ReadFull(c, got[:]); err != nil {
				b.Fatalf("the sink's count: %v\n%s", err, e.flows())
			}
			if n := binary.LittleEndian.Uint64(got[:]); n < sent {
				b.Fatalf("the sink received %d bytes, want at least %d", n, sent)
			}
			b.ReportMetric(float64(sent)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

// BenchmarkCrossConcurrent16: 16 streams at once; the aggregate and the
// slowest stream's share of a fair split.
func BenchmarkCrossConcurrent16(b *testing.B) {
	const n = 16
	e := crossBench(b)
	for i, stack := range crossStacks {
		b.Run(stack, func(b *testing.B) {
			var cs []net.Conn
			for k := range n {
				cs = append(cs, e.dialCross(b, stack, 7700+i*100+k, sink))
			}
			time.Sleep(time.Second) // the Shunt ones move to the relay
			per := make([]uint64, n)
			buf := make([]byte, 64<<10)
			b.ResetTimer()
			var wg sync.WaitGroup
			end := time.Now().Add(2 * time.Second)
			for k, c := range cs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(end) {
						if _, err := c.Write(buf); err != nil {
							return
						}
						per[k] += uint64(len(buf))
					}
				}()
			}
			wg.Wait()
			el := b.Elapsed()
			var total uint64
			for _, p := range per {
				total += p
			}
			sort.Slice(per, func(x, y int) bool { return per[x] < per[y] })
			b.ReportMetric(float64(total)/el.Seconds()/1e9, "GB/s")
			b.ReportMetric(float64(per[0])/(float64(total)/n), "min-share")
		})
	}
}

// BenchmarkCrossSetup: connect and one 8-byte round trip, repeated.
func BenchmarkCrossSetup(b *testing.B) {
	e := crossBench(b)
	g2 := e.f.Hosts[1].Guests[0]
	for i, stack := range crossStacks {
		b.Run(stack, func(b *testing.B) {
			port := 7800 + i
			e.dialCross(b, stack, port, echo).Close()
			at := netip.AddrPortFrom(g2.Addr, uint16(port)).String()
			msg := make([]byte, 8)
			for b.Loop() {
				var c net.Conn
				if stack == "kernel" {
					c = e.f.Hosts[0].Guests[0].Dial(b, netip.MustParseAddrPort(at))
				} else {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					gc, err := e.hosts[0].Dial(ctx, 1, at)
					cancel()
					if err != nil {
						b.Fatal(err)
					}
					c = gc
				}
				c.Write(msg)
				if _, err := io.ReadFull(c, msg); err != nil {
					b.Fatal(err)
				}
				c.Close()
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "us/conn")
		})
	}
}
