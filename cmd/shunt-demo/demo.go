//go:build linux

package main

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/perf"
	"github.com/shuntnet/shunt/integration/stack"
)

// sizes says how much the demo measures: every round runs every stack on
// every measure, in rotating order, so that the machine's slow drifts
// (cache placement, a neighbour's load) fall on all stacks alike.
type sizes struct {
	rounds   int
	pings    int   // ping-pong round trips per stack per round
	streamed int64 // bytes streamed through Shunt per round (the kernel gets an eighth)
	setups   int   // connection setups per stack per round
}

var (
	full  = sizes{rounds: 7, pings: 4000, streamed: 512 << 20, setups: 40}
	quick = sizes{rounds: 5, pings: 500, streamed: 64 << 20, setups: 20}
)

// The stacks: the kernel's TCP with a blocking reader, the kernel's TCP
// with a busy-polling reader (sockperf --nonblocked), and Shunt.
const (
	kernel   = "kernel"
	busypoll = "busypoll"
	shunt    = "shunt"
)

var stacks = []string{kernel, busypoll, shunt}

// demo holds the running demo host and what it measured.
type demo struct {
	s      *stack.Stack
	peers  map[string]string // stack -> the peer process's address
	echo   map[string]net.Conn
	lat    map[string][]time.Duration // one-way latency samples
	stream map[string][]float64       // GB/s per round, the sink reading with io.Copy
	read8k map[string][]float64       // GB/s per round, the sink reading 8 KiB per Read
	setup  map[string][]time.Duration
}

func run(hostd string, sz sizes) error {
	say("creating a host with two guests (network namespaces) and starting hostd ...")
	s, err := stack.Start(stack.Options{Name: "demo", Guests: 2, HostdBin: hostd})
	if err != nil {
		return err
	}
	defer s.Close()
	d := &demo{s: s, peers: map[string]string{}, echo: map[string]net.Conn{},
		lat: map[string][]time.Duration{}, stream: map[string][]float64{}, read8k: map[string][]float64{},
		setup: map[string][]time.Duration{}}

	say("starting a peer process in guest 2 for each stack (kernel, kernel busy-polling, Shunt) ...")
	stop, err := d.startPeers(s, s.Rig.Guests[1], stacks, 7001)
	defer stop()
	if err != nil {
		return err
	}

	for r := range sz.rounds {
		say(fmt.Sprintf("round %d of %d: 8 B ping-pong, 64 KiB streaming (two sinks), connection setup; stacks in turn ...", r+1, sz.rounds))
		for k := range stacks {
			st := stacks[(r+k)%len(stacks)]
			if err := d.round(st, sz); err != nil {
				return fmt.Errorf("%s, round %d: %w", st, r+1, err)
			}
		}
	}

	say("measuring idle CPU (2 s, one idle fast-path flow) ...")
	hostdCPU, guestCPU, err := d.idleCPU()
	if err != nil {
		return err
	}
	d.print(sz, hostdCPU, guestCPU)
	out, _ := exec.Command(hostd, "flows", "-admin", s.Admin).CombinedOutput()
	fmt.Printf("\nhostd flows at the end of the run:\n%s", out)
	say("removing the demo host")
	return nil
}

// startPeers starts a peer process in guest g of host s for each of
// stacks (on ports from base), and an echo connection to each from guest
// 1 of the demo's host (d.s). stop ends them all.
func (d *demo) startPeers(s *stack.Stack, g *nsrig.Guest, stacks []string, base int) (stop func(), err error) {
	var undo []func()
	stop = func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	for i, st := range stacks {
		addr, cmd, err := startPeerIn(s, g, st, base+i)
		if err != nil {
			return stop, err
		}
		undo = append(undo, func() { cmd.Process.Kill(); cmd.Wait() })
		d.peers[st] = addr
		c, err := d.dial(st, true)
		if err != nil {
			return stop, err
		}
		undo = append(undo, func() { c.Close() })
		if err := perf.StartEcho(c); err != nil {
			return stop, err
		}
		d.echo[st] = c
	}
	return stop, nil
}

func say(line string) { fmt.Println("shunt-demo:", line) }

// dial connects guest 1 to the peer of stack st. A Shunt connection
// starts on TCP and moves to the rings once hostd has paired it: for the
// steady-state measures, dial waits for that (fast); the setup measure
// does not, as no program does.
func (d *demo) dial(st string, fast bool) (net.Conn, error) {
	addr := d.peers[st]
	if st == shunt {
		c, err := d.s.Dial(context.Background(), 1, addr)
		if err != nil || !fast {
			return c, err
		}
		if err := onRings(c); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}
	var c net.Conn
	err := nsrig.In(d.s.Rig.Guests[0].NSPath(), func() (err error) { c, err = net.Dial("tcp4", addr); return err })
	if err != nil || st != busypoll {
		return c, err
	}
	return perf.NewBusyPoll(c.(*net.TCPConn))
}

// onRings waits, within 5 s, until hostd has moved c to the rings.
func onRings(c *guestlib.Conn) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	p := c.WaitPath(ctx)
	for !p.Fast && ctx.Err() == nil {
		time.Sleep(time.Millisecond)
		p = c.Path()
	}
	if !p.Fast {
		return fmt.Errorf("the Shunt connection stayed on TCP: %s (hostd's log says why)", p)
	}
	return nil
}

// round measures stack st once on every measure.
func (d *demo) round(st string, sz sizes) error {
	ds, err := perf.PingPongSamples(d.echo[st], 8, sz.pings)
	if err != nil {
		return fmt.Errorf("ping-pong: %w", err)
	}
	d.lat[st] = append(d.lat[st], ds...)
	if st == busypoll {
		return nil // streaming and setup are the same kernel path as "kernel"
	}
	n := sz.streamed
	if st == kernel {
		n /= 8
	}
	// The sink reads as programs do: io.Copy(io.Discard, conn), then
	// Read calls of 8 KiB (bufio and net/http read in 4-8 KiB pieces).
	for _, sink := range []struct {
		read int
		to   map[string][]float64
	}{{0, d.stream}, {8 << 10, d.read8k}} {
		c, err := d.dial(st, true)
		if err != nil {
			return err
		}
		gbs, err := perf.RemoteStreamSized(c, 64<<10, sink.read, n)
		c.Close()
		if err != nil {
			return fmt.Errorf("stream: %w", err)
		}
		sink.to[st] = append(sink.to[st], gbs)
	}
	setups, err := perf.SetupSamples(func() (net.Conn, error) { return d.dial(st, false) }, sz.setups, 8)
	if err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	d.setup[st] = append(d.setup[st], setups...)
	return nil
}

// idleCPU measures, over 2 s, the CPU of hostd and of this process while a
// fast-path connection's reader waits for data.
func (d *demo) idleCPU() (hostd, guest time.Duration, err error) {
	l, err := d.s.Listen(2, 7300)
	if err != nil {
		return 0, 0, err
	}
	defer l.Close()
	acc := make(chan *guestlib.Conn, 1)
	go func() { c, _ := l.AcceptShunt(); acc <- c }()
	c, err := d.s.Dial(context.Background(), 1, netip.AddrPortFrom(d.s.Rig.Guests[1].Addr, 7300).String())
	if err != nil {
		return 0, 0, err
	}
	defer c.Close()
	srv := <-acc
	if srv == nil {
		return 0, 0, fmt.Errorf("accept failed")
	}
	defer srv.Close()
	if err := onRings(srv); err != nil {
		return 0, 0, err
	}
	pid := d.s.Hostd.Process.Pid
	hostdBefore, _ := perf.ProcessCPU(pid)
	selfBefore := perf.CPUTime()
	idle := make(chan error, 1)
	go func() {
		_, err := srv.Read(make([]byte, 1))
		idle <- err
	}()
	time.Sleep(2 * time.Second)
	guest = perf.CPUTime() - selfBefore
	hostdAfter, _ := perf.ProcessCPU(pid)
	if _, err := c.Write([]byte{1}); err != nil {
		return 0, 0, err
	}
	if err := <-idle; err != nil {
		return 0, 0, err
	}
	return hostdAfter - hostdBefore, guest, nil
}

// row is one line of the table; why explains a ratio below 1.
type row struct {
	what, kernel, shunt, ratio, why string
}

func (d *demo) print(sz sizes, hostdCPU, guestCPU time.Duration) {
	var rows []row
	latency := func(what, k, why string) {
		km, sm := perf.Median(d.lat[k]), perf.Median(d.lat[shunt])
		rows = append(rows, row{what: what, kernel: medP99(d.lat[k]), shunt: medP99(d.lat[shunt]),
			ratio: ratio(us(km), us(sm), false), why: why})
	}
	latency("8 B one-way latency: kernel blocking vs Shunt adaptive", kernel,
		"not expected: a ring's reader polls before it sleeps, so it sees a message without a wake-up unless "+
			"other work holds the cores (check the load with uptime and run the demo again)")
	latency("8 B one-way latency: kernel busy-polling vs Shunt adaptive", busypoll,
		"the kernel's busy-polling reader spins for as long as it waits and keeps its core; Shunt's adaptive "+
			"reader spins a bounded while, then sleeps in a futex, and a message that finds it asleep pays the "+
			"wake-up: a futex call and a pass of the scheduler")
	stream := func(what string, m map[string][]float64) {
		ks, ss := medianF(m[kernel]), medianF(m[shunt])
		rows = append(rows, row{what: what, kernel: fmt.Sprintf("%.2f GB/s", ks),
			shunt: fmt.Sprintf("%.2f GB/s", ss), ratio: ratio(ks, ss, true),
			why: "not expected with both ends on a core of their own (make bench-sizes: 6-13x); a ring's ends poll " +
				"before they sleep, so on a machine whose cores are busy with other work they wait for a core " +
				"where the kernel's ends sleep at once: check the load (uptime) and run the demo again"})
	}
	stream("64 KiB writes, sink io.Copy(io.Discard, conn) (*)", d.stream)
	stream("64 KiB writes, sink Read of 8 KiB at a time", d.read8k)
	km, sm := perf.Median(d.setup[kernel]), perf.Median(d.setup[shunt])
	rows = append(rows, row{what: "connect + accept + first 8 B round trip", kernel: medP99(d.setup[kernel]),
		shunt: medP99(d.setup[shunt]), ratio: ratio(us(km), us(sm), false),
		why: "every connection starts on kernel TCP at once and reaches hostd only after the open delay (5 ms), " +
			"so what remains is the library's own work per connection (its tables and the delayed OPEN's queue)"})
	rows = append(rows,
		row{what: "idle CPU of hostd (2 s)", kernel: "-", shunt: fmt.Sprintf("%.2f %%core", 100*hostdCPU.Seconds()/2), ratio: "-"},
		row{what: "idle CPU of a guest blocked in Read, adaptive (2 s)", kernel: "-", shunt: fmt.Sprintf("%.2f %%core", 100*guestCPU.Seconds()/2), ratio: "-"})

	fmt.Println()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MEASURE (guest 1 -> guest 2)\tKERNEL TCP (veth)\tSHUNT\tSHUNT / KERNEL")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.what, r.kernel, r.shunt, r.ratio)
	}
	tw.Flush()
	fmt.Printf("\nMedians (and p99) of %d interleaved rounds: per stack and round, %d ping-pong round trips, two streams\n"+
		"(%d MiB each through Shunt, %d MiB through the kernel) and %d connection setups. Ratios above 1x favour Shunt.\n"+
		"Every figure is what a program sees: the peer is a separate process in guest 2, a Go program using\n"+
		"guestlib (Listen) or the net package; a stream counts the bytes the sink reports it received.\n"+
		"(*) io.Copy uses the Conn's WriteTo on Shunt (the ring's bytes copied once, into its pooled 32 KiB buffer)\n"+
		"and 8 KiB reads on the kernel; the 8 KiB row makes both copy every byte into the program's buffer.\n",
		sz.rounds, sz.pings, sz.streamed>>20, sz.streamed>>23, sz.setups)
	for _, r := range rows {
		if r.why != "" && strings.HasPrefix(r.ratio, "0.") {
			fmt.Printf("Where Shunt is slower: %s: %s.\n", r.what, r.why)
		}
	}
}

func medP99(ds []time.Duration) string {
	m := perf.Median(ds)
	p := perf.Percentile(ds, 0.99)
	return fmt.Sprintf("%s (p99 %s)", fmtUS(m), fmtUS(p))
}

func fmtUS(d time.Duration) string {
	if v := us(d); v < 10 {
		return fmt.Sprintf("%.2f us", v)
	}
	return fmt.Sprintf("%.0f us", us(d))
}

// ratio is Shunt's advantage: kernel/shunt for times, shunt/kernel for rates.
func ratio(k, s float64, higherBetter bool) string {
	if k == 0 || s == 0 {
		return "-"
	}
	r := k / s
	if higherBetter {
		r = s / k
	}
	if r < 10 {
		return fmt.Sprintf("%.2fx", r)
	}
	return fmt.Sprintf("%.0fx", r)
}

func medianF(xs []float64) float64 {
	ds := make([]time.Duration, len(xs))
	for i, x := range xs {
		ds[i] = time.Duration(x * 1e6)
	}
	return float64(perf.Median(ds)) / 1e6
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
