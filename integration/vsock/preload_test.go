//go:build linux

package vsock_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/nsexec"
	"github.com/shuntnet/shunt/internal/testenv"
)

// Ports of TestVsockPreload's process guest: shunt-edge's server and
// iperf3's.
const (
	edgePort  = 7101
	iperfPort = 7102
	edgeLen   = 4 << 20
	// flipLen is the paced stream's length each way (SHUNT_EDGE_PACE_US
	// 10 ms a call at both ends: at least 5 s), and preloadFlips how often
	// it is moved to TCP and back meanwhile.
	flipLen      = 24 << 20
	preloadFlips = 3
)

// TestVsockPreload: unmodified C programs under shunt-run in a VM without
// ivshmem (vhost-user-vsock served by hostd), to a process guest running
// theirs under shunt-run too: the C library's flows go over vsock
// stretches through shunt-vstretchd (docs/vsock.md, "The C library's
// stretches"). First shunt-edge's "stream" (4 MiB of a seeded stream each
// way at once, each end checking the other's byte for byte, then
// half-closes): both ends must pass, both libraries must have put the
// connection on rings (the VM's over vsock), and hostd's vsock device
// must have carried the stream each way. Then Debian's iperf3 (the VM
// runs the host's /usr over 9p) for 2 s: `hostd flows` must show its
// connection on rings via vsock while it runs, and the device must have
// carried what iperf3 says it sent.
func TestVsockPreload(t *testing.T) {
	if os.Getenv("SHUNT_TEST_VSOCK_PRELOAD") != "1" {
		// Landed before its first full run here finished (the machine's
		// heavy lock was held by other runs): its first phase passed in
		// its earlier runs, the iperf3 and flip phases are unproven.
		t.Skip("opt-in until its first full run: SHUNT_TEST_VSOCK_PRELOAD=1")
	}
	testenv.NeedTool(t, "iperf3", "iperf3")
	for _, tool := range []string{"make", "gcc"} {
		testenv.NeedTool(t, tool, "make gcc libc6-dev")
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	bin := func(name string) string { return filepath.Join(dir, name) }
	mk := exec.Command("make", "-s", "-C", "../..", "BIN="+dir, "preload", bin("shunt-edge"))
	mk.Env = append(os.Environ(), "MAKEFLAGS=")
	if out, err := mk.CombinedOutput(); err != nil {
		t.Fatalf("make preload shunt-edge: %v\n%s", err, out)
	}
	gb := exec.Command("go", "build", "-o", bin("shunt-vstretchd"), "../../cmd/shunt-vstretchd")
	gb.Env = append(os.Environ(), "CGO_ENABLED=0") // the initramfs's own files run before /usr is there
	if out, err := gb.CombinedOutput(); err != nil {
		t.Fatalf("build shunt-vstretchd: %v\n%s", err, out)
	}

	var edgeOut, iperfOut lockedBuffer
	var v *vsockVM
	// The process guest's servers under shunt-run, listening before the
	// VM boots.
	serve := func(out *lockedBuffer, port int, args ...string) {
		g := v.s.Rig.Guests[0]
		cmd := exec.Command(bin("shunt-run"), append([]string{"-v"}, args...)...)
		cmd.Env = append(os.Environ(), "SHUNT_CONTROL="+v.s.Control(g), "SHUNT_PRELOAD="+bin("libshunt-preload.so"), "SHUNT_EDGE_PACE_US=10000")
		cmd.Stdout, cmd.Stderr = out, out
		if err := nsexec.In(g.NSPath(), cmd.Start); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		go func() { cmd.Wait(); close(exited) }()
		t.Cleanup(func() { cmd.Process.Kill(); <-exited })
		for !listening(cmd.Process.Pid, port) {
			select {
			case <-exited:
				v.fail("the process guest's %s exited", args[0])
			case <-ctx.Done():
				v.fail("the process guest's %s does not listen on %d", args[0], port)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	files := []string{bin("shunt-run"), bin("libshunt-preload.so"), bin("shunt-edge"), bin("shunt-vstretchd")}
	how := vmHow{files: files, before: func(vm *vsockVM) {
		v = vm
		v.more = func() string {
			return fmt.Sprintf("process guest's shunt-edge server:\n%s\nprocess guest's iperf3 server:\n%s", edgeOut.String(), iperfOut.String())
		}
		addr := v.s.Rig.Guests[0].Addr.String()
		serve(&edgeOut, edgePort, bin("shunt-edge"), "server", addr, fmt.Sprint(edgePort))
		serve(&iperfOut, iperfPort, "iperf3", "-s", "-B", addr, "-p", fmt.Sprint(iperfPort), "-1", "-f", "m")
	}}
	startVsockVMHow(t, ctx, how, "cdir:"+dir+":0:0", "vstretchd:0:0:0", fmt.Sprintf("cedge:%d:%d:5", edgePort, edgeLen),
		fmt.Sprintf("cedgeflip:%d:%d:6", edgePort, flipLen), fmt.Sprintf("ciperf:%d:2:0", iperfPort), "pause:3000:0:0")
	edgeServing := edgeOut.String
	ctx = v.r.ctx

	// The checksummed stream.
	line, err := v.r.v.WaitAny(ctx, 0, "SHUNT-VSOCK cedge port=", "SHUNT-VSOCK ERROR")
	if err != nil || !strings.Contains(line, "err=<nil> PASS") {
		v.fail("the VM's shunt-edge stream: %q %v", line, err)
	}
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(edgeOut.String(), "PASS stream"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			v.fail("the process guest's shunt-edge server did not pass its end of the stream")
		}
	}
	console := v.r.v.Console()
	for _, want := range []string{"over vsock (shunt-vstretchd)", ": shunt (slot"} {
		if !strings.Contains(console, want) {
			v.fail("the VM's library never logged %q: its connection did not go on rings over vsock", want)
		}
	}
	if !strings.Contains(edgeOut.String(), ": shunt (slot") {
		v.fail("the process guest's library never put the connection on rings")
	}
	cs := counters(v.hostd, v.s.Admin)
	for _, dir := range []string{"rx", "tx"} {
		key := fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=vm}", dir)
		// Each end writes TCP until the ring its bytes go into is
		// attached: the VM's stretch opens only once the VM's reader
		// is back from its kernel recv (docs/vsock.md), so the process
		// guest's first few hundred KiB go by TCP (860 KiB in one run).
		if got := counterValue(cs, key); got < edgeLen/2 {
			v.fail("%s = %v after the stream: the device carried less than half the stream (%d bytes) each way", key, got, edgeLen)
		}
	}
	t.Logf("shunt-edge stream over vsock: %s", line)

	// A paced checked stream while the policy moves it to TCP and back:
	// each downgrade stops both bridges, the VM's library stops its
	// stretch (shunt-vstretchd's STOP) and says where its read ring
	// ended (ENDED), and both ends resend from RESUME's offsets on TCP
	// (docs/vsock.md, "Switching back").
	v.waitOn(ctx, edgePort, "rings")
	for i := range preloadFlips {
		t0 := time.Now()
		if _, err := v.s.SetPolicy(stack.PolicyTCP); err != nil {
			v.fail("flip %d: %v", i, err)
		}
		v.waitOn(ctx, edgePort, "tcp")
		t1 := time.Now()
		if _, err := v.s.SetPolicy(""); err != nil {
			v.fail("flip %d: %v", i, err)
		}
		v.waitOn(ctx, edgePort, "rings")
		t.Logf("flip %d: to tcp in %v, back on the rings in %v", i, t1.Sub(t0).Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))
	}
	line, err = v.r.v.WaitAny(ctx, 0, "SHUNT-VSOCK cedgeflip", "SHUNT-VSOCK ERROR")
	if err != nil || !strings.Contains(line, "err=<nil> PASS") {
		v.fail("the VM's shunt-edge stream across flips: %q %v", line, err)
	}
	for deadline := time.Now().Add(10 * time.Second); strings.Count(edgeServing(), "PASS stream") < 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			v.fail("the process guest's shunt-edge server did not pass its end of the stream across flips")
		}
	}
	if n := strings.Count(v.r.v.Console(), "stopped ("); n < preloadFlips {
		v.fail("the VM's library stopped %d stretches for RESUME, want %d (one per flip)", n, preloadFlips)
	}
	t.Logf("shunt-edge stream across %d flips: %s", preloadFlips, line)
	// iperf3: on rings via vsock while it runs, as hostd sees it. Its
	// first full run here hung: the server's blocking read of the
	// client's parameters never came back, since the VM's bytes went into
	// the stretch's ring before the server's reader had attached its ring
	// (docs/vsock.md, "The C library's stretches": the direction not
	// covered), and the room's bridge held them.
	seen := ""
	for seen == "" {
		fl, _ := v.s.Conns()
		for _, f := range fl {
			if strings.HasSuffix(f.Dst, fmt.Sprintf(":%d", iperfPort)) && f.Path == "rings" && f.Via == "vsock" {
				seen = fmt.Sprintf("%s %s -> %s path %s via %s", f.Name, f.Src, f.Dst, f.Path, f.Via)
			}
		}
		if v.r.v.Has(0, "SHUNT-VSOCK ciperf") && seen == "" {
			v.fail("iperf3 ended and hostd's flows never showed a connection of it on rings via vsock")
		}
		if ctx.Err() != nil {
			v.fail("iperf3: hostd's flows never showed it on rings via vsock")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("hostd flows: %s", seen)
	line, err = v.r.v.WaitAny(ctx, 0, "SHUNT-VSOCK ciperf", "SHUNT-VSOCK ERROR")
	if err != nil || !strings.Contains(line, "err=<nil>") || !strings.Contains(line, "receiver") {
		v.fail("the VM's iperf3: %q %v", line, err)
	}
	var sent float64
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if sent = iperfBytes(iperfOut.String()); sent > 0 {
			break
		}
		if time.Now().After(deadline) {
			v.fail("the process guest's iperf3 server gave no receiver summary")
		}
	}
	// Both programs' streams went from the VM through the device (the
	// edge stream's and iperf3's), less what went by TCP before the
	// rings were attached.
	rx := counterValue(counters(v.hostd, v.s.Admin), "shunt_vsock_bytes_total{direction=rx,guest=vm}")
	if rx < edgeLen/2+sent*3/4 {
		v.fail("iperf3's server received %.0f bytes, the edge stream was %d; the device carried %.0f from the VM: iperf3's stream did not go over vsock", sent, edgeLen, rx)
	}
	t.Logf("iperf3 over vsock: %s (its server received %.0f bytes; the device carried %.0f from the VM in all)", line, sent, rx)

	t.Logf("boot %v, whole test %v", v.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// waitOn waits until hostd's flows show the connection to the process
// guest's port on path ("rings": via vsock).
func (v *vsockVM) waitOn(ctx context.Context, port int, path string) {
	v.t.Helper()
	for {
		fl, err := v.s.Conns()
		for _, f := range fl {
			if strings.HasSuffix(f.Dst, fmt.Sprintf(":%d", port)) && f.Path == path && (path != "rings" || f.Via == "vsock") {
				return
			}
		}
		if ctx.Err() != nil {
			v.fail("hostd flows never showed the connection to port %d on %s: %v", port, path, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// listening reports whether the network namespace of process pid has a
// TCP socket listening on port (/proc/PID/net/tcp: state 0A).
func listening(pid, port int) bool {
	f, err := os.Open(fmt.Sprintf("/proc/%d/net/tcp", pid))
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	want := fmt.Sprintf(":%04X", port)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) > 3 && strings.HasSuffix(fs[1], want) && fs[3] == "0A" {
			return true
		}
	}
	return false
}

// iperfBytes is what iperf3's server says it received (its "receiver"
// summary line; -f m: MBytes, which iperf3 counts in MiB), in bytes; -1
// if it has none.
func iperfBytes(out string) float64 {
	for _, l := range strings.Split(out, "\n") {
		fs := strings.Fields(l)
		for i := 1; i < len(fs) && strings.Contains(l, "receiver"); i++ {
			var mb float64
			if fs[i] == "MBytes" {
				if _, err := fmt.Sscanf(fs[i-1], "%g", &mb); err == nil {
					return mb * (1 << 20)
				}
			}
		}
	}
	return -1
}
