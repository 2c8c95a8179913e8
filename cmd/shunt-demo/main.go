//go:build linux

// Command shunt-demo is the quick start: it builds a demo host of two
// guests in network namespaces on this machine, starts hostd, measures the
// kernel's TCP over veth against Shunt side by side in interleaved rounds,
// prints medians and p99s, and removes everything again. It needs root.
//
//	shunt-demo [-hostd bin/hostd] [-quick] [-rounds N]
package main

import (
	"bufio"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/perf"
	"github.com/shuntnet/shunt/integration/stack"
)

func main() {
	exe, _ := os.Executable()
	hostd := flag.String("hostd", filepath.Join(filepath.Dir(exe), "hostd"), "hostd binary")
	short := flag.Bool("quick", false, "fewer iterations (CI)")
	rounds := flag.Int("rounds", 0, "interleaved rounds (0: 7, or 5 with -quick)")
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
		fail(fmt.Errorf("nft not found: run scripts/deps.sh demo (or apt-get install nftables)"))
	}
	sz := full
	if *short {
		sz = quick
	}
	if *rounds > 0 {
		sz.rounds = *rounds
	}
	if err := run(*hostd, sz); err != nil {
		fail(err)
	}
	if err := runCross(*hostd, sz); err != nil {
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

// startPeerIn runs this binary as the peer process inside guest g2 of
// s's host and waits until it listens.
func startPeerIn(s *stack.Stack, g2 *nsrig.Guest, stack string, port int) (string, *exec.Cmd, error) {
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
