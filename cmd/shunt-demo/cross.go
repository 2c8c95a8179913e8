//go:build linux

package main

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/hostd/peers/peertest"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/perf"
	"github.com/shuntnet/shunt/integration/stack"
)

// The cross-host table (docs/crosshost.md): two hosts, each a network
// namespace with its own conntrack, firewall and hostd, joined by a
// fabric veth; hostds that peer over mutual TLS; a guest on each. Kernel
// TCP crosses both hosts' forwarding and firewalls; Shunt goes through
// each host's relay. The same interleaved rounds as the one-host table.

// crossStacks: the kernel's TCP and Shunt through the relays.
var crossStacks = []string{kernel, shunt}

// runCross builds the two hosts, measures, prints the table and removes
// everything.
func runCross(hostd string, sz sizes) error {
	say("creating two hosts joined by a fabric, a guest on each, and a hostd on each, peered over mutual TLS ...")
	f, err := nsrig.NewFabric("demox", 2, 1)
	if err != nil {
		return err
	}
	if err := f.Create(); err != nil {
		return err
	}
	defer f.Destroy()
	dir, err := os.MkdirTemp("", "shunt-demo-cross")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	ca, err := peertest.NewCA(dir, "ca")
	if err != nil {
		return err
	}
	var hosts [2]*stack.Stack
	for k := range 2 {
		cert, key, err := ca.Issue(fmt.Sprintf("h%d", k+1))
		if err != nil {
			return err
		}
		o := 1 - k
		extra := fmt.Sprintf("peering {\n  listen = %q\n  certificate = %q\n  key = %q\n  ca = %q\n}\npeer \"h%d\" {\n  address = %q\n  prefixes = [%q]\n}\n",
			net.JoinHostPort(f.Addrs[k].String(), "7470"), cert, key, ca.Path, o+1,
			net.JoinHostPort(f.Addrs[o].String(), "7470"), netip.PrefixFrom(f.Hosts[o].Guests[0].Addr, 16).Masked().String())
		hdir := filepath.Join(dir, fmt.Sprintf("h%d", k+1))
		if err := os.MkdirAll(hdir, 0o755); err != nil {
			return err
		}
		s, err := stack.Start(stack.Options{Rig: f.Hosts[k], HostdBin: hostd, Dir: hdir, Extra: extra})
		if err != nil {
			return err
		}
		defer s.Close()
		hosts[k] = s
	}
	if err := peered(hosts); err != nil {
		return err
	}
	d := &demo{s: hosts[0], peers: map[string]string{}, echo: map[string]net.Conn{},
		lat: map[string][]time.Duration{}, stream: map[string][]float64{}, read8k: map[string][]float64{},
		setup: map[string][]time.Duration{}}
	stop, err := d.startPeers(hosts[1], f.Hosts[1].Guests[0], crossStacks, 7101)
	defer stop()
	if err != nil {
		return err
	}
	for r := range sz.rounds {
		say(fmt.Sprintf("across hosts, round %d of %d ...", r+1, sz.rounds))
		for k := range crossStacks {
			st := crossStacks[(r+k)%len(crossStacks)]
			if err := d.crossRound(st, sz); err != nil {
				return fmt.Errorf("across hosts, %s, round %d: %w", st, r+1, err)
			}
		}
	}
	d.printCross(sz)
	out, _ := exec.Command(hostd, "peers", "-admin", hosts[0].Admin).CombinedOutput()
	fmt.Printf("\nh1's hostd peers at the end of the run:\n%s", out)
	say("removing the two hosts")
	return nil
}

// peered waits until each hostd accepted the other's guest.
func peered(hosts [2]*stack.Stack) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		ok := true
		for _, s := range hosts {
			var ps []peers.Info
			if err := admin.Call(s.Admin, admin.Request{Cmd: admin.CmdPeers}, &ps); err != nil || len(ps) != 1 || ps[0].State != peers.StateUp || ps[0].Announced < 1 {
				ok = false
			}
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the two hostds did not peer within 20 s (hostd's log: %s)", strings.TrimSpace(hosts[0].Log()))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// crossRound measures stack st once: ping-pong, one stream (64 KiB writes,
// 8 KiB reads), setups.
func (d *demo) crossRound(st string, sz sizes) error {
	ds, err := perf.PingPongSamples(d.echo[st], 8, sz.pings)
	if err != nil {
		return fmt.Errorf("ping-pong: %w", err)
	}
	d.lat[st] = append(d.lat[st], ds...)
	c, err := d.dial(st, true)
	if err != nil {
		return err
	}
	gbs, err := perf.RemoteStreamSized(c, 64<<10, 8<<10, sz.streamed/4)
	c.Close()
	if err != nil {
		return fmt.Errorf("stream: %w", err)
	}
	d.read8k[st] = append(d.read8k[st], gbs)
	setups, err := perf.SetupSamples(func() (net.Conn, error) { return d.dial(st, false) }, sz.setups, 8)
	if err != nil {
		return fmt.Errorf("setup: %w", err)
	}
	d.setup[st] = append(d.setup[st], setups...)
	return nil
}

func (d *demo) printCross(sz sizes) {
	km, sm := perf.Median(d.lat[kernel]), perf.Median(d.lat[shunt])
	ks, ss := medianF(d.read8k[kernel]), medianF(d.read8k[shunt])
	ku, su := perf.Median(d.setup[kernel]), perf.Median(d.setup[shunt])
	rows := []row{
		{what: "8 B one-way latency", kernel: medP99(d.lat[kernel]), shunt: medP99(d.lat[shunt]), ratio: ratio(us(km), us(sm), false),
			why: "each relay hands a message between its goroutines and the link's TCP connection on each host: " +
				"the relay adds user-space hops to a kernel TCP hop, so it only gains where the guests' own path is slow (VMs)"},
		{what: "64 KiB writes, sink Read of 8 KiB at a time", kernel: fmt.Sprintf("%.2f GB/s", ks), shunt: fmt.Sprintf("%.2f GB/s", ss), ratio: ratio(ks, ss, true),
			why: "the relay copies every byte twice more than the kernel (ring to link frame, link to ring) and " +
				"still crosses kernel TCP between the hosts; on two cores shared by four hostd and guest processes " +
				"that costs more than the kernel's forwarding it saves"},
		{what: "connect + accept + first 8 B round trip", kernel: medP99(d.setup[kernel]), shunt: medP99(d.setup[shunt]), ratio: ratio(us(ku), us(su), false),
			why: "every connection starts on kernel TCP at once; the pairing across hosts comes after the open delay"},
	}
	fmt.Println()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MEASURE ACROSS HOSTS (h1/g1 -> h2/g1)\tKERNEL TCP (forwarded by both hosts)\tSHUNT (through both relays)\tSHUNT / KERNEL")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.what, r.kernel, r.shunt, r.ratio)
	}
	tw.Flush()
	fmt.Printf("\nMedians (and p99) of %d interleaved rounds: per stack and round, %d ping-pong round trips, one\n"+
		"stream of %d MiB and %d connection setups, between a guest on each of two hosts (network namespaces\n"+
		"joined by a veth, each with its own conntrack, firewall and hostd). Ratios above 1x favour Shunt.\n",
		sz.rounds, sz.pings, sz.streamed>>22, sz.setups)
	for _, r := range rows {
		if r.why != "" && strings.HasPrefix(r.ratio, "0.") {
			fmt.Printf("Where Shunt is slower: %s: %s.\n", r.what, r.why)
		}
	}
}
