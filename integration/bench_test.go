package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/perf"
	"github.com/shuntnet/shunt/integration/stack"
)

// Benchmarks between two namespace guests, kernel TCP over veth against
// Shunt, in one run (make bench-e2e; needs root). Figures are reported with
// b.ReportMetric; docs/BENCHMARKS.md has the table and the command.

// peerProcess starts the echo/sink child in guest 2 with the given stack
// and returns the address it listens on.
func peerProcess(b testing.TB, e *env, stack string, port int) string {
	g2 := e.rig.Guests[1]
	addr := netip.AddrPortFrom(g2.Addr, uint16(port)).String()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "SHUNT_E2E_CHILD=echo", "SHUNT_E2E_STACK="+stack, "SHUNT_E2E_SIZE=8",
		"SHUNT_E2E_ADDR="+addr, "SHUNT_CONTROL="+e.control(g2))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := nsrig.Start(g2.NSPath(), cmd); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "ready\n" {
		b.Fatalf("peer process: %q, %v", line, err)
	}
	return addr
}

// dialFrom dials addr from guest 1 with the given stack.
func dialFrom(b *testing.B, e *env, stack, addr string) net.Conn {
	var c net.Conn
	var err error
	if stack == "shunt" {
		var sc *guestlib.Conn
		sc, err = e.Dial(context.Background(), 1, addr)
		if err == nil && !fastSoon(b, sc) {
			b.Fatalf("path %s, want fast", sc.Path())
		}
		c = sc
	} else {
		err = nsrig.In(e.rig.Guests[0].NSPath(), func() (err error) { c, err = net.Dial("tcp4", addr); return err })
		if err == nil && stack == "busypoll" {
			c, err = perf.NewBusyPoll(c.(*net.TCPConn))
		}
	}
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return c
}

var stacks = []string{"kernel", "busypoll", "shunt"}

// BenchmarkGuestPingPong8B: 8-byte ping-pong between a process in guest 1
// (this one) and an echo process in guest 2.
func BenchmarkGuestPingPong8B(b *testing.B) {
	e := newEnv(b, 2, "")
	for i, stack := range stacks {
		b.Run(stack, func(b *testing.B) {
			c := dialFrom(b, e, stack, peerProcess(b, e, stack, 7400+i))
			c.Write([]byte{'e'})
			msg, back := make([]byte, 8), make([]byte, 8)
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

// BenchmarkGuestStream64K: 64 KiB writes from guest 1 to a sink process in
// guest 2; the figure counts the bytes the sink reports it received.
func BenchmarkGuestStream64K(b *testing.B) {
	e := newEnv(b, 2, "")
	for i, stack := range []string{"kernel", "shunt"} {
		b.Run(stack, func(b *testing.B) {
			c := dialFrom(b, e, stack, peerProcess(b, e, stack, 7410+i))
			c.Write([]byte{'s'})
			buf := make([]byte, 64<<10)
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			c.(interface{ CloseWrite() error }).CloseWrite()
			line, err := bufio.NewReader(c).ReadString('\n')
			n, _ := strconv.ParseInt(strings.TrimSpace(line), 10, 64)
			if err != nil || n != int64(b.N)*int64(len(buf)) {
				b.Fatalf("sink received %q (%v), want %d bytes", line, err, b.N*len(buf))
			}
			b.ReportMetric(float64(n)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

// BenchmarkGuestStreamFlips: BenchmarkGuestStream64K's Shunt stream while
// hostd moves it between the rings and TCP every flipEvery (a policy
// reload each time), against the same stream left alone: what repeated
// switches cost a stream (make bench-e2e). The flips reported are the
// reloads that moved a connection.
func BenchmarkGuestStreamFlips(b *testing.B) {
	const flipEvery = 20 * time.Millisecond
	e := newEnv(b, 2, "")
	for i, flips := range []bool{false, true} {
		name := map[bool]string{false: "steady", true: "flipping"}[flips]
		b.Run(name, func(b *testing.B) {
			c := dialFrom(b, e, "shunt", peerProcess(b, e, "shunt", 7420+i))
			c.Write([]byte{'s'})
			buf := make([]byte, 64<<10)
			b.SetBytes(int64(len(buf)))
			stop, moved := make(chan struct{}), make(chan int, 1)
			go func() {
				n := 0
				defer func() { e.SetPolicy(""); moved <- n }()
				for tcp := true; flips; tcp = !tcp {
					select {
					case <-stop:
						return
					case <-time.After(flipEvery):
					}
					policy := ""
					if tcp {
						policy = stack.PolicyTCP
					}
					if k, err := e.SetPolicy(policy); err == nil && (k > 0 || !tcp) {
						n++
					}
				}
				<-stop
			}()
			for b.Loop() {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			close(stop)
			n := <-moved
			c.(interface{ CloseWrite() error }).CloseWrite()
			line, err := bufio.NewReader(c).ReadString('\n')
			got, _ := strconv.ParseInt(strings.TrimSpace(line), 10, 64)
			if err != nil || got != int64(b.N)*int64(len(buf)) {
				b.Fatalf("sink received %q (%v), want %d bytes", line, err, b.N*len(buf))
			}
			b.ReportMetric(float64(got)/b.Elapsed().Seconds()/1e9, "GB/s")
			b.ReportMetric(float64(n), "flips")
		})
	}
}

// BenchmarkGuestSetup: connect + accept + one 8-byte message there and
// back, with both guests' sides in their own processes (a client process in
// guest 1, the echo peer in guest 2), and the rate of such short
// connections, close included. A Shunt connection starts on TCP at once
// and moves to the rings when hostd pairs it, so a short one may never
// leave TCP: what is measured is what the program sees. Each iteration
// is 20 connections; the figures are the medians over iterations.
func BenchmarkGuestSetup(b *testing.B) {
	e := newEnv(b, 2, "")
	g1 := e.rig.Guests[0]
	for i, stack := range []string{"kernel", "shunt"} {
		b.Run(stack, func(b *testing.B) {
			addr := peerProcess(b, e, stack, 7500+i)
			var ds []time.Duration
			var rates []float64
			for b.Loop() {
				cmd := exec.Command(os.Args[0], "-test.run=^$")
				cmd.Env = append(os.Environ(), "SHUNT_E2E_CHILD=setup", "SHUNT_E2E_STACK="+stack, "SHUNT_E2E_N=20",
					"SHUNT_E2E_ADDR="+addr, "SHUNT_CONTROL="+e.control(g1))
				cmd.Stderr = os.Stderr
				var out strings.Builder
				cmd.Stdout = &out
				if err := nsrig.Start(g1.NSPath(), cmd); err != nil {
					b.Fatal(err)
				}
				if err := cmd.Wait(); err != nil {
					b.Fatalf("setup client: %v", err)
				}
				var ns int64
				var rate float64
				if _, err := fmt.Sscan(out.String(), &ns, &rate); err != nil {
					b.Fatalf("setup client printed %q", out.String())
				}
				ds = append(ds, time.Duration(ns))
				rates = append(rates, rate)
			}
			b.ReportMetric(float64(perf.Median(ds).Nanoseconds())/1e3, "us/setup")
			b.ReportMetric(median(rates), "conns/s")
		})
	}
}
