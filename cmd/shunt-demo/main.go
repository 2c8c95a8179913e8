//go:build linux

// Command shunt-demo is the quick start: it builds a demo host of two
// guests in network namespaces on this machine, starts hostd, measures the
// kernel's TCP over veth against Shunt side by side, prints a table, and
// removes everything again. It needs root.
//
//	shunt-demo [-hostd bin/hostd] [-quick]
package main

import (
	"bufio"
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
	peer := flag.String("peer", "", "internal: run as the peer process in a guest (kernel, busypoll or shunt)")
	addr := flag.String("addr", "", "internal: the peer's listen address")
	flag.Parse()
	if *peer != "" {
		fail(runPeer(*peer, *addr))
	}
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

// runPeer is the demo's guest-2 process: it listens with the given stack and
// serves echo and sink connections (perf.Serve) until killed.
func runPeer(stack, addr string) error {
	l, err := perf.Listen(stack, addr)
	if err != nil {
		return err
	}
	fmt.Println("ready")
	return perf.Serve(l, 8, stack == "busypoll")
}

// startPeer runs this binary as the peer process inside guest 2 and waits
// until it listens.
func startPeer(s *stack.Stack, stack string, port int) (string, *exec.Cmd, error) {
	g2 := s.Rig.Guests[1]
	addr := netip.AddrPortFrom(g2.Addr, uint16(port)).String()
	exe, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command(exe, "-peer", stack, "-addr", addr)
	cmd.Env = append(os.Environ(), "SHUNT_CONTROL="+s.Control(g2))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, err
	}
	if err := nsrig.Start(g2.NSPath(), cmd); err != nil {
		return "", nil, err
	}
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		cmd.Process.Kill()
		cmd.Wait()
		return "", nil, fmt.Errorf("peer process (%s): %q, %v", stack, line, err)
	}
	return addr, cmd, nil
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

	fmt.Println("shunt-demo: starting a peer process in guest 2 per stack ...")
	conns := map[string]net.Conn{}
	for i, st := range []string{"kernel", "busypoll", "shunt"} {
		addr, cmd, err := startPeer(s, st, 7001+i)
		if err != nil {
			return err
		}
		defer func() { cmd.Process.Kill(); cmd.Wait() }()
		var c net.Conn
		if st == "shunt" {
			sc, err := s.Dial(context.Background(), 1, addr)
			if err != nil {
				return err
			}
			if p := sc.Path(); !p.Fast {
				return fmt.Errorf("the Shunt connection stayed on TCP: %s", p)
			}
			c = sc
		} else {
			if err := nsrig.In(g1.NSPath(), func() (err error) { c, err = net.Dial("tcp4", addr); return err }); err != nil {
				return err
			}
			if st == "busypoll" {
				if c, err = perf.NewBusyPoll(c.(*net.TCPConn)); err != nil {
					return err
				}
			}
		}
		defer c.Close()
		conns[st] = c
	}

	fmt.Println("shunt-demo: measuring 8 B ping-pong (one-way latency) ...")
	lat := map[string]time.Duration{}
	for _, st := range []string{"kernel", "busypoll", "shunt"} {
		if lat[st], err = perf.RemotePingPong(conns[st], 8, iters); err != nil {
			return fmt.Errorf("%s ping-pong: %w", st, err)
		}
	}
	add("8 B one-way latency, kernel blocking vs Shunt adaptive", us(lat["kernel"]), us(lat["shunt"]), "us", false)
	add("8 B one-way latency, kernel busy-polling vs Shunt adaptive", us(lat["busypoll"]), us(lat["shunt"]), "us", false)

	fmt.Println("shunt-demo: measuring 64 KiB streaming ...")
	stream := map[string]float64{}
	for i, st := range []string{"kernel", "shunt"} {
		// A fresh connection each: the ping-pong ones are echoes.
		addr := netip.AddrPortFrom(g2.Addr, uint16(7001+2*i)).String()
		var c net.Conn
		if st == "shunt" {
			c, err = s.Dial(context.Background(), 1, addr)
		} else {
			err = nsrig.In(g1.NSPath(), func() (err error) { c, err = net.Dial("tcp4", addr); return err })
		}
		if err != nil {
			return err
		}
		n := total
		if st == "kernel" {
			n /= 8
		}
		stream[st], err = perf.RemoteStream(c, 64<<10, n)
		c.Close()
		if err != nil {
			return fmt.Errorf("%s stream: %w", st, err)
		}
	}
	add("64 KiB streaming throughput", stream["kernel"], stream["shunt"], "GB/s", true)

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
	sp, err := shunt(7300)
	if err != nil {
		return err
	}
	defer sp.client.Close()
	defer sp.server.Close()
	hostdBefore, _ := perf.ProcessCPU(s.Hostd.Process.Pid)
	selfBefore := perf.CPUTime()
	idle := make(chan error, 1)
	go func() {
		_, err := sp.server.Read(make([]byte, 1))
		idle <- err
	}()
	time.Sleep(2 * time.Second)
	selfCPU := perf.CPUTime() - selfBefore
	hostdAfter, _ := perf.ProcessCPU(s.Hostd.Process.Pid)
	sp.client.Write([]byte{1})
	if err := <-idle; err != nil {
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
	fmt.Printf("\n(medians; guest 1 is this process, guest 2 a peer process per stack; %d ping-pong round trips;\n %d MiB streamed through Shunt, %d MiB through the kernel; setup adds %.0f us with Shunt)\n", iters, total>>20, total>>23, us(sSetup)-us(kSetup))
	out, _ := exec.Command(hostd, "flows", "-admin", s.Admin).CombinedOutput()
	fmt.Printf("\nhostd flows at the end of the run:\n%s", out)

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
