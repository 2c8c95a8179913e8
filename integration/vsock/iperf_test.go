//go:build linux

package vsock_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/testenv"
)

// iperfPort is TestVsockIperf3's server port in the process guest, and
// iperfSecs each run's length.
const (
	iperfPort = 5211
	iperfSecs = 2
)

// TestVsockIperf3: iperf3 under shunt-run in a VM without ivshmem
// (vhost-user-vsock served by hostd; the C library's stretches through
// shunt-vstretchd) against iperf3's server under shunt-run in a process
// guest, 2 s each way (the VM sends, then -R: the server sends). It hung
// before the stretches were attached end to end (docs/vsock.md, "The C
// library's stretches"): the server reads the client's parameters with a
// blocking read right after the cookie, its READY comes while it sleeps
// there, and the VM's client wrote them into a ring the server's reader
// never attached. Both runs must succeed, both libraries must have put
// connections on rings (the VM's over vsock), hostd's flows must show the
// connection on the rings via vsock meanwhile, and the VM's stretches
// (shunt-vstretchd's counts at each BYE) must have carried at least
// 1 MiB from the VM and 1 MiB to it, which hostd's vsock device must
// cover (shunt_vsock_bytes_total). From the VM only what hostd
// acknowledged counts (Freed): the sender's last ring of bytes, in
// flight when iperf3's receiver closes at the end, never reaches hostd,
// though the VM's bridge counted it sent. After 120 s it fails with hostd's
// flows, counters and log, the server's output and the VM's console.
func TestVsockIperf3(t *testing.T) {
	testenv.NeedTool(t, "iperf3", "iperf3")
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	dir, bin := buildCSide(t)
	var srvOut lockedBuffer
	var v *vsockVM
	how := vmHow{files: cSideFiles(bin), before: func(vm *vsockVM) {
		v = vm
		v.more = func() string { return fmt.Sprintf("process guest's iperf3 server:\n%s", srvOut.String()) }
		addr := v.s.Rig.Guests[0].Addr.String()
		v.serveC(ctx, bin, &srvOut, iperfPort, nil, "iperf3", "-s", "-B", addr, "-p", fmt.Sprint(iperfPort))
	}}
	startVsockVMHow(t, ctx, how, "cdir:"+dir+":0:0", "vstretchd:0:0:0",
		fmt.Sprintf("ciperf:%d:%d:0", iperfPort, iperfSecs), fmt.Sprintf("ciperf:%d:%d:1", iperfPort, iperfSecs), "pause:3000:0:0")
	ctx = v.r.ctx

	for _, reverse := range []bool{false, true} {
		prefix := fmt.Sprintf("SHUNT-VSOCK ciperf port=%d reverse=%v ", iperfPort, reverse)
		// hostd's flows show a connection to the server on the rings via
		// vsock while the run lasts (its control connection, at least,
		// lasts the whole run).
		seen := false
		for !v.r.v.Has(0, prefix) && !v.r.v.Has(0, "SHUNT-VSOCK ERROR") && ctx.Err() == nil {
			if !seen {
				if fl, err := v.s.Conns(); err == nil {
					for _, f := range fl {
						seen = seen || strings.HasSuffix(f.Dst, fmt.Sprintf(":%d", iperfPort)) && f.Path == "rings" && f.Via == "vsock"
					}
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
		line, err := v.r.v.WaitAny(ctx, 0, prefix, "SHUNT-VSOCK ERROR")
		if err != nil || !strings.Contains(line, "err=<nil> ") || !strings.Contains(line, "receiver") {
			v.fail("iperf3 (reverse %v) in the VM: %q %v", reverse, line, err)
		}
		if !seen {
			v.fail("iperf3 (reverse %v): hostd's flows never showed a connection to port %d on the rings via vsock while it ran", reverse, iperfPort)
		}
		t.Logf("iperf3 -t %d (reverse %v) over vsock: %s", iperfSecs, reverse, strings.TrimPrefix(line, prefix))
	}
	console := v.r.v.Console()
	for _, want := range []string{"over vsock (shunt-vstretchd)", ": shunt (slot"} {
		if !strings.Contains(console, want) {
			v.fail("the VM's library never logged %q: its connections did not go on rings over vsock", want)
		}
	}
	if !strings.Contains(srvOut.String(), ": shunt (slot") {
		v.fail("the process guest's library never put a connection on rings")
	}

	in, out := stretchCounts(ctx, t, "vm", v.r, v.fail)
	if in < 1<<20 || out < 1<<20 {
		v.fail("the stretches carried %.0f bytes from the VM and %.0f to it: want at least 1 MiB each way (iperf3's data over vsock, not TCP)", in, out)
	}
	cs := counters(v.hostd, v.s.Admin)
	for dir, n := range map[string]float64{"rx": in, "tx": out} {
		key := fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=vm}", dir)
		if got := counterValue(cs, key); got < n {
			v.fail("%s = %v: less than the stretches carried (%v)", key, got, n)
		}
	}
	t.Logf("boot %v, whole test %v", v.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// stretchCounts waits until every stretch shunt-vstretchd opened in r's VM
// closed (its connection's BYE) and sums their bridges' counts: the bytes
// from the VM that hostd acknowledged (Freed), and the bytes to it.
func stretchCounts(ctx context.Context, t *testing.T, name string, r *rig, fail func(string, ...any)) (in, out float64) {
	t.Helper()
	open := regexp.MustCompile(`shunt-vstretchd: stretch \S+ open`)
	closed := regexp.MustCompile(`shunt-vstretchd: stretch \S+ closed: \{BytesIn:\d+ Freed:(\d+) BytesOut:(\d+) `)
	for {
		c := r.v.Console()
		ends := closed.FindAllStringSubmatch(c, -1)
		if n := len(open.FindAllString(c, -1)); n > 0 && len(ends) == n {
			for _, m := range ends {
				i, _ := strconv.ParseFloat(m[1], 64)
				o, _ := strconv.ParseFloat(m[2], 64)
				in, out = in+i, out+o
			}
			t.Logf("%s: %d stretches carried %.0f bytes from the VM (acknowledged by hostd) and %.0f to it", name, n, in, out)
			return in, out
		}
		if ctx.Err() != nil {
			fail("%s: shunt-vstretchd did not close every stretch it opened (%d open, %d closed)", name, len(open.FindAllString(c, -1)), len(ends))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestVsockIperf3VMToVM: TestVsockIperf3 between two vsock VMs (the
// rig of TestVsockVMToVM): iperf3's server under shunt-run in VM B, its
// client in VM A, 2 s each way. Both runs must succeed, both VMs'
// libraries must have put connections on rings over vsock, hostd's flows
// must show a connection on the rings via vsock meanwhile, and each VM's
// stretches must have carried at least 1 MiB each way (A's from A in the
// first run, to A in the -R run; B's the other way), which each VM's
// device must cover. A writer in either VM moves to its ring only once
// the other VM's reader attached (attached end to end, through the
// flow's rings: docs/vsock.md).
func TestVsockIperf3VMToVM(t *testing.T) {
	testenv.NeedTool(t, "iperf3", "iperf3")
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	dir, bin := buildCSide(t)
	c := []string{"cdir:" + dir + ":0:0", "vstretchd:0:0:0"}
	p := startVMPairFiles(t, ctx, cSideFiles(bin), append(c, fmt.Sprintf("ciperfd:%d:0:0", iperfPort), "pause:100000:0:0"), // B serves until the test ends
		append(c, fmt.Sprintf("ciperf:%d:%d:0", iperfPort, iperfSecs), fmt.Sprintf("ciperf:%d:%d:1", iperfPort, iperfSecs)))
	ctx = p.a.ctx
	for _, reverse := range []bool{false, true} {
		prefix := fmt.Sprintf("SHUNT-VSOCK ciperf port=%d reverse=%v ", iperfPort, reverse)
		seen := false
		for !p.a.v.Has(0, prefix) && !p.a.v.Has(0, "SHUNT-VSOCK ERROR") && ctx.Err() == nil {
			if !seen {
				if fl, err := p.s.Conns(); err == nil {
					for _, f := range fl {
						seen = seen || strings.HasSuffix(f.Dst, fmt.Sprintf(":%d", iperfPort)) && f.Path == "rings" && f.Via == "vsock"
					}
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
		line, err := p.a.v.WaitAny(ctx, 0, prefix, "SHUNT-VSOCK ERROR")
		if err != nil || !strings.Contains(line, "err=<nil> ") || !strings.Contains(line, "receiver") {
			p.fail("iperf3 (reverse %v) in VM A: %q %v", reverse, line, err)
		}
		if !seen {
			p.fail("iperf3 (reverse %v): hostd's flows never showed a connection to port %d on the rings via vsock while it ran", reverse, iperfPort)
		}
		t.Logf("iperf3 -t %d (reverse %v) VM to VM over vsock: %s", iperfSecs, reverse, strings.TrimPrefix(line, prefix))
	}
	for g, r := range map[string]*rig{"vma": p.a, "vmb": p.b} {
		if !strings.Contains(r.v.Console(), "over vsock (shunt-vstretchd)") {
			p.fail("%s's library never put a connection on rings over vsock", g)
		}
		in, out := stretchCounts(ctx, t, g, r, p.fail)
		if in < 1<<20 || out < 1<<20 {
			p.fail("%s's stretches carried %.0f bytes from it and %.0f to it: want at least 1 MiB each way", g, in, out)
		}
		cs := counters(p.hostd, p.s.Admin)
		for dir, n := range map[string]float64{"rx": in, "tx": out} {
			key := fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=%s}", dir, g)
			if got := counterValue(cs, key); got < n {
				p.fail("%s = %v: less than the stretches carried (%v)", key, got, n)
			}
		}
	}
	t.Logf("boot %v, whole test %v", p.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}
