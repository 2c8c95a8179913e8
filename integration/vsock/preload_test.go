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

// TestVsockPreload's process guest's shunt-edge server port, and its first
// stream's length each way.
const (
	edgePort = 7101
	edgeLen  = 4 << 20
	// flipLen is the paced stream's length each way (SHUNT_EDGE_PACE_US
	// 10 ms a call at both ends: at least 5 s), and preloadFlips how often
	// it is moved to TCP and back meanwhile.
	flipLen      = 24 << 20
	preloadFlips = 3
)

// TestVsockPreload: an unmodified C program under shunt-run in a VM
// without ivshmem (vhost-user-vsock served by hostd; the host's /usr over
// 9p), to a process guest running its own under shunt-run too: the C
// library's flows go over vsock stretches through shunt-vstretchd
// (docs/vsock.md, "The C library's stretches"). First shunt-edge's
// "stream" (4 MiB of a seeded stream each way at once, each end checking
// the other's byte for byte, then half-closes): both ends must pass, both
// libraries must have put the connection on rings (the VM's over vsock),
// and the stretch (shunt-vstretchd's count) and hostd's vsock device must
// have carried bytes each way. Then a paced 24 MiB stream, checked so,
// across 3 policy flips, each waited for in `hostd flows` (rings via
// vsock, then tcp): the VM's library must have stopped its stretch once
// per flip (RESUME: STOP, ENDED). The stream across flips stalled 1 run
// in 4 before the stretches were attached end to end (docs/vsock.md,
// "The C library's stretches"); iperf3 is TestVsockIperf3's.
func TestVsockPreload(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	dir, bin := buildCSide(t)
	var edgeOut lockedBuffer
	var v *vsockVM
	how := vmHow{files: cSideFiles(bin), before: func(vm *vsockVM) {
		v = vm
		v.more = func() string {
			return fmt.Sprintf("process guest's shunt-edge server:\n%s", edgeOut.String())
		}
		addr := v.s.Rig.Guests[0].Addr.String()
		v.serveC(ctx, bin, &edgeOut, edgePort, []string{"SHUNT_EDGE_PACE_US=10000"}, bin("shunt-edge"), "server", addr, fmt.Sprint(edgePort))
	}}
	startVsockVMHow(t, ctx, how, "cdir:"+dir+":0:0", "vstretchd:0:0:0", fmt.Sprintf("cedge:%d:%d:5", edgePort, edgeLen),
		fmt.Sprintf("cedgeflip:%d:%d:6", edgePort, flipLen), "pause:3000:0:0")
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
	// Each end writes TCP until the ring its bytes go into is attached,
	// and the VM's stretch opens only once the VM's reader is back from
	// its kernel recv (docs/vsock.md), so how much of the stream the
	// stretch carries varies (1.6-3.9 MB of the VM's in three runs): it
	// must have carried some each way, and the device at least that.
	var closed string // shunt-vstretchd's line at the first stretch's BYE
	for {
		if c := v.r.v.Console(); strings.Contains(c, " closed: {BytesIn:") {
			closed = c[strings.Index(c, " closed: {BytesIn:")+len(" closed: "):]
			break
		}
		if ctx.Err() != nil {
			v.fail("shunt-vstretchd never said the first stretch closed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	var in, out float64
	if _, err := fmt.Sscanf(closed, "{BytesIn:%g Freed:%g BytesOut:%g", &in, new(float64), &out); err != nil || in <= 0 || out <= 0 {
		v.fail("the stretch carried %v bytes from the VM and %v to it (%q, %v): its connection did not go over vsock", in, out, closed, err)
	}
	cs := counters(v.hostd, v.s.Admin)
	for dir, n := range map[string]float64{"rx": in, "tx": out} {
		key := fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=vm}", dir)
		if got := counterValue(cs, key); got < n {
			v.fail("%s = %v after the stream: less than the stretch carried (%v)", key, got, n)
		}
	}
	t.Logf("the stretch carried %.0f bytes of the VM's stream and %.0f of the process guest's", in, out)
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
	t.Logf("boot %v, whole test %v", v.booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// buildCSide builds the C side's programs into a directory of their own
// (mode 0755: the VM and the process guest run them): shunt-run,
// libshunt-preload.so, shunt-edge, and shunt-vstretchd (static, Go: the
// VM's initramfs runs it before the host's /usr is there). bin names a
// file in it.
func buildCSide(t *testing.T) (dir string, bin func(string) string) {
	t.Helper()
	for _, tool := range []string{"make", "gcc"} {
		testenv.NeedTool(t, tool, "make gcc libc6-dev")
	}
	dir = t.TempDir()
	os.Chmod(dir, 0o755)
	bin = func(name string) string { return filepath.Join(dir, name) }
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
	return dir, bin
}

// cSideFiles are buildCSide's files for the VM's initramfs (vmHow.files).
func cSideFiles(bin func(string) string) []string {
	return []string{bin("shunt-run"), bin("libshunt-preload.so"), bin("shunt-edge"), bin("shunt-vstretchd")}
}

// serveC starts a server under shunt-run -v in the process guest (env
// added; its output to out), killed at the test's end, and waits until
// it listens on port. Called from vmHow.before: before the VM boots.
func (v *vsockVM) serveC(ctx context.Context, bin func(string) string, out *lockedBuffer, port int, env []string, args ...string) {
	v.t.Helper()
	g := v.s.Rig.Guests[0]
	cmd := exec.Command(bin("shunt-run"), append([]string{"-v"}, args...)...)
	cmd.Env = append(append(os.Environ(), "SHUNT_CONTROL="+v.s.Control(g), "SHUNT_PRELOAD="+bin("libshunt-preload.so")), env...)
	cmd.Stdout, cmd.Stderr = out, out
	if err := nsexec.In(g.NSPath(), cmd.Start); err != nil {
		v.t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	v.t.Cleanup(func() { cmd.Process.Kill(); <-exited })
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
