package integration

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/perf"
)

// Benchmarks between two namespace guests, kernel TCP over veth against
// Shunt, in one run (make bench-e2e; needs root). Figures are reported with
// b.ReportMetric; docs/BENCHMARKS.md has the table and the command.

type connPair struct{ c, s net.Conn }

func kernelPair(b *testing.B, e *env, port int) connPair {
	g1, g2 := e.rig.Guests[0], e.rig.Guests[1]
	var l net.Listener
	if err := nsrig.In(g2.NSPath(), func() (err error) {
		l, err = net.Listen("tcp4", netip.AddrPortFrom(g2.Addr, uint16(port)).String())
		return err
	}); err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	acc := make(chan net.Conn, 1)
	go func() { c, _ := l.Accept(); acc <- c }()
	var c net.Conn
	if err := nsrig.In(g1.NSPath(), func() (err error) {
		c, err = net.Dial("tcp4", netip.AddrPortFrom(g2.Addr, uint16(port)).String())
		return err
	}); err != nil {
		b.Fatal(err)
	}
	p := connPair{c, <-acc}
	b.Cleanup(func() { p.c.Close(); p.s.Close() })
	return p
}

func shuntPair(b *testing.B, e *env, port int) connPair {
	l, err := e.Listen(2, port)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	acc := make(chan net.Conn, 1)
	go func() { c, _ := l.AcceptShunt(); acc <- c }()
	c, err := e.Dial(context.Background(), 1, fmt.Sprintf("%s:%d", e.rig.Guests[1].Addr, port))
	if err != nil {
		b.Fatal(err)
	}
	if !c.Path().Fast {
		b.Fatalf("path %s, want fast", c.Path())
	}
	p := connPair{c, <-acc}
	b.Cleanup(func() { p.c.Close(); p.s.Close() })
	return p
}

func busyPair(b *testing.B, p connPair) connPair {
	c, err := perf.NewBusyPoll(p.c.(*net.TCPConn))
	if err != nil {
		b.Fatal(err)
	}
	s, err := perf.NewBusyPoll(p.s.(*net.TCPConn))
	if err != nil {
		b.Fatal(err)
	}
	return connPair{c, s}
}

func BenchmarkGuestPingPong8B(b *testing.B) {
	e := newEnv(b, 2, "")
	cases := []struct {
		name string
		mk   func() connPair
	}{
		{"kernel-blocking", func() connPair { return kernelPair(b, e, 7400) }},
		{"kernel-busypoll", func() connPair { return busyPair(b, kernelPair(b, e, 7401)) }},
		{"shunt-adaptive", func() connPair { return shuntPair(b, e, 7402) }},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			p := tc.mk()
			go echo(p.s, 8)
			msg, back := make([]byte, 8), make([]byte, 8)
			for b.Loop() {
				p.c.Write(msg)
				if _, err := io.ReadFull(p.c, back); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/2/1e3, "us/oneway")
		})
	}
}

func echo(c net.Conn, size int) {
	buf := make([]byte, size)
	for {
		if _, err := io.ReadFull(c, buf); err != nil {
			return
		}
		if _, err := c.Write(buf); err != nil {
			return
		}
	}
}

func BenchmarkGuestStream64K(b *testing.B) {
	e := newEnv(b, 2, "")
	for _, tc := range []struct {
		name string
		mk   func() connPair
	}{
		{"kernel", func() connPair { return kernelPair(b, e, 7410) }},
		{"shunt", func() connPair { return shuntPair(b, e, 7411) }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			p := tc.mk()
			done := make(chan int64)
			go func() { n, _ := io.Copy(io.Discard, p.s); done <- n }()
			buf := make([]byte, 64<<10)
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				if _, err := p.c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			p.c.(interface{ CloseWrite() error }).CloseWrite()
			n := <-done
			b.ReportMetric(float64(n)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

// BenchmarkGuestSetup: connect + accept + the first byte there and back,
// against a listener that already exists (what the fast path adds to a
// connection, not to a listen).
func BenchmarkGuestSetup(b *testing.B) {
	e := newEnv(b, 2, "")
	g1, g2 := e.rig.Guests[0], e.rig.Guests[1]
	addr := netip.AddrPortFrom(g2.Addr, 7500).String()
	var kl net.Listener
	if err := nsrig.In(g2.NSPath(), func() (err error) { kl, err = net.Listen("tcp4", addr); return err }); err != nil {
		b.Fatal(err)
	}
	defer kl.Close()
	sl, err := e.Listen(2, 7501)
	if err != nil {
		b.Fatal(err)
	}
	defer sl.Close()
	for _, tc := range []struct {
		name string
		l    net.Listener
		dial func() (net.Conn, error)
	}{
		{"kernel", kl, func() (c net.Conn, err error) {
			err = nsrig.In(g1.NSPath(), func() error { c, err = net.Dial("tcp4", addr); return err })
			return c, err
		}},
		{"shunt", sl, func() (net.Conn, error) {
			return e.Dial(context.Background(), 1, netip.AddrPortFrom(g2.Addr, 7501).String())
		}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var ds []time.Duration
			for b.Loop() {
				start := time.Now()
				acc := make(chan net.Conn, 1)
				go func() {
					s, err := tc.l.Accept()
					if err == nil {
						s.Write([]byte{1})
					}
					acc <- s
				}()
				c, err := tc.dial()
				if err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(start))
				c.Close()
				(<-acc).Close()
			}
			b.ReportMetric(float64(perf.Median(ds).Nanoseconds())/1e3, "us/setup")
		})
	}
}
