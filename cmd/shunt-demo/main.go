// Command shunt-demo is the quick start: it builds a demo host of two
// guests in network namespaces on this machine, starts hostd, measures the
// kernel's TCP over veth against Shunt side by side, prints a table, and
// removes everything again. It needs root.
//
//	shunt-demo [-hostd bin/hostd] [-quick]
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"text/tabwriter"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/perf"
	"github.com/shuntnet/shunt/integration/stack"
)

func main() {
	exe, _ := os.Executable()
	hostd := flag.String("hostd", filepath.Join(filepath.Dir(exe), "hostd"), "hostd binary")
	quick := flag.Bool("quick", false, "fewer iterations")
	flag.Parse()
	if os.Geteuid() != 0 {
		fail(fmt.Errorf("the demo builds network namespaces and needs root: sudo %s", os.Args[0]))
	}
	if _, err := exec.LookPath("nft"); err != nil {
		fail(fmt.Errorf("nft not found: apt-get install nftables"))
	}
	if err := run(*hostd, *quick); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "shunt-demo:", err)
	os.Exit(1)
}

// pair is one connection as both ends hold it.
type pair struct{ client, server net.Conn }

func run(hostd string, quick bool) error {
	fmt.Println("shunt-demo: creating a host with two guests (network namespaces), starting hostd ...")
	s, err := stack.Start(stack.Options{Name: "demo", Guests: 2, HostdBin: hostd})
	if err != nil {
		return err
	}
	defer s.Close()
	g1, g2 := s.Rig.Guests[0], s.Rig.Guests[1]

	iters, total := 20000, int64(2<<30)
	if quick {
		iters, total = 2000, 256<<20
	}
	// Kernel TCP: plain sockets between the two guests through the host.
	kernel := func(port int) (pair, error) {
		var l net.Listener
		if err := nsrig.In(g2.NSPath(), func() (err error) {
			l, err = net.Listen("tcp4", netip.AddrPortFrom(g2.Addr, uint16(port)).String())
			return err
		}); err != nil {
			return pair{}, err
		}
		defer l.Close()
		acc := make(chan net.Conn, 1)
		go func() { c, _ := l.Accept(); acc <- c }()
		var c net.Conn
		err := nsrig.In(g1.NSPath(), func() (err error) {
			c, err = net.Dial("tcp4", netip.AddrPortFrom(g2.Addr, uint16(port)).String())
			return err
		})
		if err != nil {
			return pair{}, err
		}
		return pair{c, <-acc}, nil
	}
	shunt := func(port int) (pair, error) {
		l, err := s.Listen(2, port)
		if err != nil {
			return pair{}, err
		}
		defer l.Close()
		acc := make(chan net.Conn, 1)
		go func() { c, _ := l.AcceptShunt(); acc <- c }()
		c, err := s.Dial(context.Background(), 1, netip.AddrPortFrom(g2.Addr, uint16(port)).String())
		if err != nil {
			return pair{}, err
		}
		srv := <-acc
		if p := c.Path(); !p.Fast {
			return pair{}, fmt.Errorf("the Shunt connection stayed on TCP: %s", p)
		}
		return pair{c, srv}, nil
	}
	busy := func(p pair) (pair, error) {
		a, err := perf.NewBusyPoll(p.client.(*net.TCPConn))
		if err != nil {
			return p, err
		}
		b, err := perf.NewBusyPoll(p.server.(*net.TCPConn))
		return pair{a, b}, err
	}

	type row struct {
		what          string
		kernel, shunt string
		ratio         string
	}
	var rows []row
	add := func(what string, k, sh float64, unit string, higherBetter bool) {
		r := row{what: what, kernel: fmt.Sprintf("%.2f %s", k, unit), shunt: fmt.Sprintf("%.2f %s", sh, unit)}
		if higherBetter {
			r.ratio = fmt.Sprintf("%.1fx", sh/k)
		} else {
			r.ratio = fmt.Sprintf("%.1fx", k/sh)
		}
		rows = append(rows, r)
	}

	fmt.Println("shunt-demo: measuring 8 B ping-pong (one-way latency) ...")
	kp, err := kernel(7001)
	if err != nil {
		return err
	}
	kLat, err := perf.PingPong(kp.client, kp.server, 8, iters)
	if err != nil {
		return err
	}
	kb, err := kernel(7002)
	if err != nil {
		return err
	}
	kbp, err := busy(kb)
	if err != nil {
		return err
	}
	kBusy, err := perf.PingPong(kbp.client, kbp.server, 8, iters)
	if err != nil {
		return err
	}
	sp, err := shunt(7003)
	if err != nil {
		return err
	}
	sLat, err := perf.PingPong(sp.client, sp.server, 8, iters)
	if err != nil {
		return err
	}
	add("8 B one-way latency, kernel blocking vs Shunt adaptive", us(kLat), us(sLat), "us", false)
	add("8 B one-way latency, kernel busy-polling vs Shunt adaptive", us(kBusy), us(sLat), "us", false)

	fmt.Println("shunt-demo: measuring 64 KiB streaming ...")
	kStream, err := perf.Stream(kp.client, kp.server, 64<<10, total/4)
	if err != nil {
		return err
	}
	sStream, err := perf.Stream(sp.client, sp.server, 64<<10, total)
	if err != nil {
		return err
	}
	add("64 KiB streaming throughput", kStream, sStream, "GB/s", true)

	fmt.Println("shunt-demo: measuring connection setup (connect + accept + first byte) ...")
	kSetup, err := setupTime(func() (net.Listener, error) {
		var l net.Listener
		err := nsrig.In(g2.NSPath(), func() (err error) {
			l, err = net.Listen("tcp4", netip.AddrPortFrom(g2.Addr, 7100).String())
			return err
		})
		return l, err
	}, func() (c net.Conn, err error) {
		err = nsrig.In(g1.NSPath(), func() error {
			c, err = net.Dial("tcp4", netip.AddrPortFrom(g2.Addr, 7100).String())
			return err
		})
		return c, err
	})
	if err != nil {
		return err
	}
	sSetup, err := setupTime(func() (net.Listener, error) { return s.Listen(2, 7101) }, func() (net.Conn, error) {
		return s.Dial(context.Background(), 1, netip.AddrPortFrom(g2.Addr, 7101).String())
	})
	if err != nil {
		return err
	}
	add("connect + accept + first byte", us(kSetup), us(sSetup), "us", false)

	fmt.Println("shunt-demo: measuring idle CPU (2 s, one idle fast-path flow) ...")
	hostdBefore, _ := perf.ProcessCPU(s.Hostd.Process.Pid)
	selfBefore := perf.CPUTime()
	idle, idleErr := make(chan error, 1), make(chan error, 1)
	go func() {
		_, err := sp.server.Read(make([]byte, 1))
		idle <- err
	}()
	time.Sleep(2 * time.Second)
	selfCPU := perf.CPUTime() - selfBefore
	hostdAfter, _ := perf.ProcessCPU(s.Hostd.Process.Pid)
	sp.client.Write([]byte{1})
	go func() { idleErr <- <-idle }()
	if err := <-idleErr; err != nil {
		return err
	}
	idleRow := func(what string, cpu time.Duration) {
		rows = append(rows, row{what: what, kernel: "-", shunt: fmt.Sprintf("%.2f %%core", 100*cpu.Seconds()/2), ratio: "-"})
	}
	idleRow("idle CPU of hostd", hostdAfter-hostdBefore)
	idleRow("idle CPU of a guest blocked in Read (adaptive)", selfCPU)

	fmt.Println()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MEASURE\tKERNEL TCP (veth)\tSHUNT\tSHUNT ADVANTAGE")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.what, r.kernel, r.shunt, r.ratio)
	}
	tw.Flush()
	fmt.Printf("\n(medians; %d ping-pong round trips, %d MiB streamed through Shunt; setup adds %.0f us with Shunt)\n", iters, total>>20, us(sSetup)-us(kSetup))
	out, _ := exec.Command(hostd, "flows", "-admin", s.Admin).CombinedOutput()
	fmt.Printf("\nhostd flows at the end of the run:\n%s", out)
	for _, p := range []pair{kp, kb, sp} {
		p.client.Close()
		p.server.Close()
	}
	fmt.Println("shunt-demo: removing the demo host")
	return nil
}

// setupTime measures connect + accept + one byte back, against a listener
// that already exists, 50 times, and returns the median.
func setupTime(listen func() (net.Listener, error), dial func() (net.Conn, error)) (time.Duration, error) {
	l, err := listen()
	if err != nil {
		return 0, err
	}
	defer l.Close()
	var ds []time.Duration
	for range 50 {
		start := time.Now()
		acc := make(chan net.Conn, 1)
		go func() {
			c, err := l.Accept()
			if err == nil {
				c.Write([]byte{1})
			}
			acc <- c
		}()
		c, err := dial()
		if err != nil {
			return 0, err
		}
		if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
			return 0, err
		}
		ds = append(ds, time.Since(start))
		c.Close()
		if sc := <-acc; sc != nil {
			sc.Close()
		}
	}
	return perf.Median(ds), nil
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
