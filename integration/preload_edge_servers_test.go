package integration

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// fixedDelay keeps the open delay at SHUNT_OPEN_DELAY_MS in the edge
// suites: their servers serve one short connection per test, and an
// adapting delay would climb past the 150 ms each test gives hostd's READY
// (SHUNT_EDGE_SETTLE_MS), so later tests would find no ring.
const fixedDelay = "SHUNT_OPEN_DELAY_ADAPT=0"

// TestPreloadEdgeServers runs the edge suite's cases taken from packaged
// servers (issue 21) under shunt-run: Apache's event MPM (a worker adds a
// connection to the listener thread's sleeping epoll set), and raw system
// calls that end a connection's fd (libuv's syscall(SYS_close),
// close_range, a raw dup2), after which the fd number's next connection
// must work. Each failed on
// the library before its fix. SHUNT_EDGE_PRELOAD names another library
// to run them against (an older build, to see them fail).
func TestPreloadEdgeServers(t *testing.T) {
	e := newEnv(t, 2, "")
	needPreload(t)
	lib := preloadLib
	if p := os.Getenv("SHUNT_EDGE_PRELOAD"); p != "" {
		lib = p
	}
	dir := t.TempDir()
	edge := filepath.Join(dir, "shunt-edge")
	if err := makeC(dir, edge); err != nil {
		testenv.Missing(t, "cannot build the edge suite: "+err.Error(), "apt-get install make gcc libc6-dev")
	}
	g2 := e.rig.Guests[1].Addr.String()
	env := func(guest int) []string {
		return append(os.Environ(), "SHUNT_CONTROL="+e.control(e.rig.Guests[guest]), "SHUNT_PRELOAD="+lib, fixedDelay)
	}
	srv := exec.Command(shuntRun, "-v", edge, "server", g2, "7720")
	srv.Env = env(1)
	srvOut := e.startLog(2, srv)
	e.waitListening(2, 7720)
	client := func(test string) *exec.Cmd {
		cmd := exec.Command(shuntRun, "-v", edge, "client", g2, "7720", test)
		cmd.Env = env(0)
		return cmd
	}
	// vfork and clone(CLONE_VM) children that take a connection onto
	// their stdio and exec cat, the parent keeping its copy for 1 s or
	// closing it at once, and CPython's subprocess doing the same (vfork):
	// 4 MiB echoed intact, and the parent's own stdout still its own.
	vforkSrv := func(port string, args ...string) *outLog {
		cmd := exec.Command(shuntRun, append([]string{"-v"}, args...)...)
		cmd.Env = env(1)
		o := e.startLog(2, cmd)
		p, _ := strconv.Atoi(port)
		e.waitListening(2, p)
		return o
	}
	py, err := filepath.Abs(filepath.Join("ctest", "subproc_server.py"))
	if err != nil {
		t.Fatal(err)
	}
	testenv.NeedTool(t, "python3", "python3")
	spawners := []struct {
		name, port, pass string
		out              *outLog
	}{
		{"vfork-keep", "7721", "PASS vforkserver-parent", vforkSrv("7721", edge, "vforkserver", g2, "7721", "vfork", "1000")},
		{"vfork-close", "7722", "PASS vforkserver-parent", vforkSrv("7722", edge, "vforkserver", g2, "7722", "vfork", "0")},
		{"clonevm-keep", "7723", "PASS vforkserver-parent", vforkSrv("7723", edge, "vforkserver", g2, "7723", "clonevm", "1000")},
		{"python-keep", "7724", "PASS served", vforkSrv("7724", "python3", py, g2, "7724", "keep")},
		{"python-close", "7725", "PASS served", vforkSrv("7725", "python3", py, g2, "7725", "close")},
	}
	for _, sp := range spawners {
		t.Run(sp.name, func(t *testing.T) {
			for i := 1; i <= 2; i++ { // the second: the parent survived the first
				cmd := exec.Command(shuntRun, "-v", edge, "client", g2, sp.port, "bulk4m")
				cmd.Env = env(0)
				out := e.runT(t, 1, cmd)
				if !strings.Contains(out, "PASS bulk4m (4194304 bytes)") {
					t.Fatalf("client %d:\n%s\nserver:\n%s", i, out, sp.out.String())
				}
				if !sp.out.waitCount(sp.pass, i, 10*time.Second) || strings.Contains(sp.out.String(), "FAIL") ||
					strings.Contains(sp.out.String(), "Traceback") {
					t.Fatalf("the server's parent after connection %d:\n%s", i, sp.out.String())
				}
			}
		})
	}
	// settlestorm: short connections from four threads, libpq's way,
	// with the open delay at 1 ms and each settle held 3 ms longer, so
	// the leaver OPENs connections whose settle is not done: the
	// tab_mu/settle_mu inversion hung it (pgbench -C).
	for _, tc := range []struct {
		test string
		fast int // connections on the fast path (-1: any number)
		env  []string
	}{
		{"apacheevent", 4, nil},
		{"rawclose", 5, nil},
		{"settlestorm", -1, []string{"SHUNT_OPEN_DELAY_MS=1", "SHUNT_TEST_SETTLE_DELAY_US=3000"}},
	} {
		t.Run(tc.test, func(t *testing.T) {
			cmd := client(tc.test)
			cmd.Env = append(cmd.Env, tc.env...)
			out := e.runT(t, 1, cmd)
			if !strings.Contains(out, "PASS "+tc.test) || (tc.fast >= 0 && fastLines(out) != tc.fast) {
				t.Fatalf("%s (%d connections on the fast path, want %d):\n%s\nserver:\n%s", tc.test, fastLines(out), tc.fast, out,
					srvOut.String())
			}
			if tc.fast < 0 {
				t.Logf("%s: %s", tc.test, strings.TrimSpace(out[strings.Index(out, "PASS "):]))
			}
		})
	}
	// No threads: the process limit of HAProxy as packaged. The session
	// starts (listen) before the drop; then no thread can start, and the
	// library says so once, not once per connection.
	t.Run("nproc", func(t *testing.T) {
		out := e.runT(t, 1, client("nproc"))
		if !strings.Contains(out, "PASS nproc") || strings.Count(out, "cannot start the leaver thread") != 1 {
			t.Fatalf("nproc: want PASS and the leaver's failure said once:\n%s", out)
		}
		t.Logf("nproc: %d of 20 connections on the fast path", fastLines(out))
	})
	// No session for good: hostd restarts while the client sits in a
	// chroot where the control socket is not: every connection after that
	// works on TCP, and the unreachable hostd is said once.
	t.Run("lostsession", func(t *testing.T) {
		cmd := client("lostsession")
		cmd.Env = append(cmd.Env, "SHUNT_EDGE_CHROOT="+t.TempDir())
		stdin, r, stderr := e.startAt(t, 1, cmd, "ready\n")
		defer cmd.Process.Kill()
		e.killHostd()
		e.startHostd()
		fmt.Fprintln(stdin, "go")
		rest, _ := io.ReadAll(r)
		cmd.Wait()
		out := string(rest) + stderr.String()
		if !strings.Contains(out, "PASS lostsession") || strings.Count(out, "hostd unreachable") > 1 ||
			strings.Contains(out, "reconnected to hostd") {
			t.Fatalf("lostsession: want PASS, on TCP, the unreachable hostd said at most once:\n%s", out)
		}
	})
}

// startAt starts cmd in guest i with pipes to its stdin and stdout, and
// waits for its first line, which must be want (the client is ready for
// the test's step): its stdin, the rest of its stdout, and its stderr.
func (e *env) startAt(t *testing.T, i int, cmd *exec.Cmd, want string) (io.WriteCloser, *bufio.Reader, *bytes.Buffer) {
	t.Helper()
	stdout, _ := cmd.StdoutPipe()
	stdin, _ := cmd.StdinPipe()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := nsrig.Start(e.rig.Guests[i-1].NSPath(), cmd); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(stdout)
	if line, err := r.ReadString('\n'); err != nil || line != want {
		cmd.Process.Kill()
		t.Fatalf("client: %q, %v\n%s", line, err, stderr.String())
	}
	return stdin, r, &stderr
}
