package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/mpirig"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// Unmodified programs under shunt-run in the namespace rig: sockperf,
// iperf3, redis and Open MPI. Each test asserts the fast path through
// hostd (a flow listed while the program runs, or the library's -v lines),
// and checks the program's own results.

// needPreload stops a test that needs libshunt-preload.so when TestMain
// could not build it (its output says why).
func needPreload(t testing.TB) {
	t.Helper()
	if preloadLib == "" {
		testenv.Missing(t, "libshunt-preload.so did not build (see TestMain's output)", "apt-get install make gcc libc6-dev")
	}
}

// makeC runs make for C targets from the repository root, with BIN=dir:
// the compiler flags live only in the Makefile.
func makeC(dir string, targets ...string) error {
	for _, tool := range []string{"make", "gcc"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s is not installed; fix: apt-get install make gcc libc6-dev", tool)
		}
	}
	cmd := exec.Command("make", append([]string{"-s", "-C", "..", "BIN=" + dir}, targets...)...)
	cmd.Env = append(os.Environ(), "MAKEFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("make %s: %w\n%s", strings.Join(targets, " "), err, out)
	}
	return nil
}

// guestCmd is a command run in guest i under shunt-run -v.
func (e *env) guestCmd(i int, name string, args ...string) *exec.Cmd {
	return e.toolCmd(e.t, true, i, name, args...)
}

// toolCmd is a command for guest i, under shunt-run -v if preload.
func (e *env) toolCmd(t testing.TB, preload bool, i int, name string, args ...string) *exec.Cmd {
	t.Helper()
	if preload {
		needPreload(t)
	}
	testenv.NeedTool(t, name, map[string]string{"sockperf": "sockperf", "iperf3": "iperf3", "redis-server": "redis-server",
		"redis-benchmark": "redis-tools", "redis-cli": "redis-tools"}[name])
	cmd := exec.Command(name, args...)
	if preload {
		cmd = exec.Command(shuntRun, append([]string{"-v", name}, args...)...)
	}
	cmd.Env = append(os.Environ(), "SHUNT_CONTROL="+e.control(e.rig.Guests[i-1]), "SHUNT_PRELOAD="+preloadLib)
	return cmd
}

// start starts cmd in guest i; it is killed when the test ends.
func (e *env) start(i int, cmd *exec.Cmd) *bytes.Buffer {
	e.t.Helper()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := nsrig.Start(e.rig.Guests[i-1].NSPath(), cmd); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return &out
}

// outLog is a process's output as it comes, safe to read while it is
// written; waitCount waits for a line to appear, without polling.
type outLog struct {
	mu      sync.Mutex
	b       bytes.Buffer
	changed chan struct{} // closed at the next write
}

func newOutLog() *outLog { return &outLog{changed: make(chan struct{})} }

func (l *outLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	close(l.changed)
	l.changed = make(chan struct{})
	return l.b.Write(p)
}

func (l *outLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// count reports how often sub appears, and a channel closed at the next
// write.
func (l *outLog) count(sub string) (int, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.b.String(), sub), l.changed
}

// waitCount waits until sub appears n times, for at most bound: whether
// it did.
func (l *outLog) waitCount(sub string, n int, bound time.Duration) bool {
	timer := time.NewTimer(bound)
	defer timer.Stop()
	for {
		c, changed := l.count(sub)
		if c >= n {
			return true
		}
		select {
		case <-changed:
		case <-timer.C:
			return false
		}
	}
}

// startLog is start with the output in an outLog.
func (e *env) startLog(i int, cmd *exec.Cmd) *outLog {
	e.t.Helper()
	out := newOutLog()
	cmd.Stdout, cmd.Stderr = out, out
	if err := nsrig.Start(e.rig.Guests[i-1].NSPath(), cmd); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return out
}

// run runs cmd in guest i and returns its output.
func (e *env) run(i int, cmd *exec.Cmd) string { return e.runT(e.t, i, cmd) }

// runT is run reporting to t (a subtest's own).
func (e *env) runT(t testing.TB, i int, cmd *exec.Cmd) string {
	return runIn(t, e.rig.Guests[i-1].NSPath(), cmd, 60*time.Second)
}

// runIn runs cmd in the namespace at ns, fails t if it fails or outlives
// timeout, and returns its combined output.
func runIn(t testing.TB, ns string, cmd *exec.Cmd, timeout time.Duration) string {
	t.Helper()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := nsrig.Start(ns, cmd); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s: %v\n%s", cmd.Args, err, out.String())
		}
	case <-time.After(timeout):
		cmd.Process.Kill()
		<-done
		t.Fatalf("%s did not finish in %s\n%s", cmd.Args, timeout, out.String())
	}
	return out.String()
}

// waitListening waits until something listens on port in guest i.
func (e *env) waitListening(i, port int) { waitListening(e.t, e, i, port) }

func waitListening(t testing.TB, e *env, i, port int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, _ := nsrig.Run(e.rig.Guests[i-1].NSPath(), "ss", "-ltnH", fmt.Sprintf("sport = :%d", port))
		if strings.Contains(out, strconv.Itoa(port)) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on port %d in g%d after 10s", port, i)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// fastLines counts the library's "shunt (slot" lines: READYs that a
// connection attached (one per connection unless hostd moved it to TCP
// and back).
func fastLines(out string) int { return strings.Count(out, ": shunt (slot ") }

func TestPreloadSockperf(t *testing.T) {
	e := newEnv(t, 2, "")
	g2 := e.rig.Guests[1].Addr.String()
	srv := e.start(2, e.guestCmd(2, "sockperf", "server", "--tcp", "-i", g2, "-p", "11111"))
	e.waitListening(2, 11111)
	// --mps sizes sockperf's table of replies: its default ("max") assumes
	// at most ~600K messages a second, which the fast path exceeds.
	var pp string
	flows := e.ringsMoved(func() {
		pp = e.run(1, e.guestCmd(1, "sockperf", "ping-pong", "--tcp", "-i", g2, "-p", "11111", "-t", "2", "-m", "14", "--mps", "5000000"))
	})
	p50 := regexp.MustCompile(`percentile 50\.000 =\s+([0-9.]+)`).FindStringSubmatch(pp)
	if fastLines(pp) != 1 || p50 == nil || flows != 1 {
		t.Fatalf("sockperf ping-pong did not run on the fast path (hostd moved %d flows onto the rings):\n%s", flows, pp)
	}
	t.Logf("sockperf ping-pong 14 B one-way p50: %s us", p50[1])
	tp := e.run(1, e.guestCmd(1, "sockperf", "throughput", "--tcp", "-i", g2, "-p", "11111", "-t", "2", "-m", "64000", "--mps", "max"))
	bw := regexp.MustCompile(`BandWidth is ([0-9.]+) MBps`).FindStringSubmatch(tp)
	if fastLines(tp) != 1 || bw == nil {
		t.Fatalf("sockperf throughput did not run on the fast path:\n%s", tp)
	}
	t.Logf("sockperf throughput 64000 B: %s MBps", bw[1])
	if got := fastLines(srv.String()); got < 2 {
		t.Fatalf("the server accepted %d fast-path connections, want 2:\n%s", got, srv.String())
	}
}

func TestPreloadIperf3(t *testing.T) {
	e := newEnv(t, 2, "")
	g2 := e.rig.Guests[1].Addr.String()
	e.start(2, e.guestCmd(2, "iperf3", "-s", "-1", "-B", g2, "-p", "5301"))
	e.waitListening(2, 5301)
	var out string
	flows := e.ringsMoved(func() { out = e.run(1, e.guestCmd(1, "iperf3", "-c", g2, "-p", "5301", "-t", "2", "-J")) })
	res, err := parseIperf3(out)
	if err != nil || res.Bytes == 0 {
		t.Fatalf("iperf3 result: %v\n%s", err, out)
	}
	if flows < 2 {
		t.Fatalf("hostd moved %d flows onto the rings during iperf3, want its control and data connections", flows)
	}
	t.Logf("iperf3: %.1f Gbit/s over the fast path", res.BitsPerSecond/1e9)
}

// iperf3Result is what the tests read of iperf3 -J: what the receiver
// counted, and iperf3's own error, if any.
type iperf3Result struct {
	Bytes, BitsPerSecond float64
	Error                string
}

// parseIperf3 finds iperf3 -J's JSON in out (the library's -v lines go
// around it) and reads it.
func parseIperf3(out string) (iperf3Result, error) {
	i, j := strings.Index(out, "{"), strings.LastIndex(out, "}")
	if i < 0 || j < i {
		return iperf3Result{}, fmt.Errorf("no JSON in iperf3's output")
	}
	var res struct {
		End struct {
			SumReceived struct {
				Bytes         float64 `json:"bytes"`
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
		Error string `json:"error"`
	}
	err := json.Unmarshal([]byte(out[i:j+1]), &res)
	return iperf3Result{res.End.SumReceived.Bytes, res.End.SumReceived.BitsPerSecond, res.Error}, err
}

// TestPreloadHostdRestart: hostd is killed and restarted while an iperf3
// pair (under the library) streams over the fast path, and while another
// iperf3 server idles in accept. The libraries see their control sockets
// close, reconnect, REATTACH the live flows (so the stream finishes instead
// of being revoked when the new hostd's grace ends) and announce the
// listener again, so a client started afterwards gets the fast path too.
func TestPreloadHostdRestart(t *testing.T) {
	e := newEnv(t, 2, "")
	g2 := e.rig.Guests[1].Addr.String()
	srv := e.start(2, e.guestCmd(2, "iperf3", "-s", "-B", g2, "-p", "5302"))
	e.start(2, e.guestCmd(2, "iperf3", "-s", "-1", "-B", g2, "-p", "5303"))
	e.waitListening(2, 5303)
	var live bytes.Buffer
	stream := e.guestCmd(1, "iperf3", "-c", g2, "-p", "5303", "-t", "6")
	stream.Stdout, stream.Stderr = &live, &live
	if err := nsrig.Start(e.rig.Guests[0].NSPath(), stream); err != nil {
		t.Fatal(err)
	}
	streamDone := make(chan error, 1)
	go func() { streamDone <- stream.Wait() }()
	eventually(t, 10*time.Second, "the stream's flows", func() bool { return len(e.flows()) == 2 })
	listening := func() bool {
		var gs []broker.GuestInfo
		_ = admin.Call(e.Admin, admin.Request{Cmd: "guests"}, &gs)
		return len(gs) == 2 && len(gs[1].Listening) == 2
	}
	eventually(t, 10*time.Second, "iperf3's listener in hostd", listening)
	e.killHostd()
	e.startHostd()
	eventually(t, 10*time.Second, "iperf3's listener announced to the new hostd", listening)
	// The stream outlives the new hostd's reattach grace (3s) only if its
	// flows were reattached. (The new hostd moves them to TCP until their
	// leases show packets past the firewall since its start: the busy one
	// returns to the rings, one more "shunt" line.)
	select {
	case err := <-streamDone:
		if err != nil || fastLines(live.String()) < 2 {
			t.Fatalf("the stream across the restart: %v\n%s", err, live.String())
		}
	case <-time.After(30 * time.Second):
		stream.Process.Kill()
		t.Fatalf("the stream across the restart did not end\n%s", live.String())
	}
	var out string
	flows := e.ringsMoved(func() { out = e.run(1, e.guestCmd(1, "iperf3", "-c", g2, "-p", "5302", "-t", "1")) })
	if flows < 2 || fastLines(out) != 2 {
		t.Fatalf("after the restart: hostd moved %d flows onto the rings, the client took the fast path %d times; want 2 and 2\n%s", flows, fastLines(out), out)
	}
	if !strings.Contains(srv.String(), "shunt: reconnected to hostd") {
		t.Fatalf("the server's library did not reconnect:\n%s", srv.String())
	}
}

func TestPreloadRedis(t *testing.T) {
	e := newEnv(t, 2, "")
	g2 := e.rig.Guests[1].Addr.String()
	srv := e.start(2, e.guestCmd(2, "redis-server", "--bind", g2, "--port", "6390", "--save", "", "--appendonly", "no", "--protected-mode", "no"))
	e.waitListening(2, 6390)
	set := e.run(1, e.guestCmd(1, "redis-cli", "-h", g2, "-p", "6390", "set", "shunt", "fast"))
	get := e.run(1, e.guestCmd(1, "redis-cli", "-h", g2, "-p", "6390", "get", "shunt"))
	// redis-cli's connections may end before hostd's READY comes (nothing
	// waits for it): correct answers are what counts for them.
	if !strings.Contains(set, "OK") || !strings.Contains(get, "fast") {
		t.Fatalf("redis-cli under the library: set %q, get %q", set, get)
	}
	bench := e.run(1, e.guestCmd(1, "redis-benchmark", "-h", g2, "-p", "6390", "-n", "20000", "-c", "4", "-t", "set,get", "-q"))
	rps := regexp.MustCompile(`GET: ([0-9.]+) requests per second`).FindStringSubmatch(bench)
	if rps == nil || fastLines(bench) < 4 {
		t.Fatalf("redis-benchmark did not run over the fast path:\n%s", bench)
	}
	t.Logf("redis GET: %s requests/s over the fast path", rps[1])
	if fastLines(srv.String()) < 4 {
		t.Fatalf("redis-server's connections took the rings %d times, want at least 4", fastLines(srv.String()))
	}
}

// TestPreloadMPI runs an MPI ping-pong and bandwidth program of our own
// across the two guests with Open MPI's TCP BTL under the preload library.
// mpirun runs in the rig's host namespace (which routes to both guests);
// its rsh agent starts orted inside each guest namespace.
func TestPreloadMPI(t *testing.T) {
	testenv.NeedTool(t, "mpicc", "libopenmpi-dev openmpi-bin")
	testenv.NeedTool(t, "mpirun", "openmpi-bin")
	e := newEnv(t, 2, "")
	needPreload(t)
	dir := t.TempDir()
	prog := filepath.Join(dir, "pingpong")
	if out, err := exec.Command("mpicc", "-O2", "-o", prog, "mpi/pingpong.c").CombinedOutput(); err != nil {
		t.Fatalf("mpicc: %v\n%s", err, out)
	}
	out := e.mpirun(t, dir, prog, true)
	if !strings.Contains(out, "data ok") || fastLines(out) < 2 {
		t.Fatalf("MPI over the fast path:\n%s", out)
	}
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "lat 8 ") || strings.HasPrefix(l, "bw ") {
			t.Log(l)
		}
	}
}

// mpirun runs prog on two ranks, one per guest; preload puts the ranks
// under the Shunt library.
func (e *env) mpirun(t testing.TB, dir, prog string, preload bool, args ...string) string {
	var guests []mpirig.Guest
	for _, g := range e.rig.Guests {
		guests = append(guests, mpirig.Guest{Addr: g.Addr.String(), NS: g.NS, Control: e.control(g)})
	}
	env := "SHUNT_VERBOSE=1"
	if preload {
		env += " LD_PRELOAD=" + preloadLib
	}
	// Each orted gets a session directory of its own: two that share the
	// machine's name and /tmp raced to make the same one ("A call to
	// mkdir was unable to create the desired directory ... File exists").
	rsh, err := mpirig.WriteAgent(dir, guests, env)
	if err != nil {
		t.Fatal(err)
	}
	hosts := fmt.Sprintf("%s:1,%s:1", e.rig.Guests[0].Addr, e.rig.Guests[1].Addr)
	cmd := exec.Command("mpirun", append([]string{"--allow-run-as-root", "-np", "2", "--host", hosts,
		"--mca", "routed", "direct", "--mca", "plm_rsh_agent", rsh, "--mca", "pml", "ob1", "--mca", "btl", "self,tcp",
		"--mca", "btl_tcp_if_include", "10.77.0.0/16", "--mca", "oob_tcp_if_include", "10.77.0.0/16",
		// Two orteds on one machine: no hwloc shared-memory topology
		// (it crashes when both map it), no binding (both ranks would get
		// core 0).
		"--mca", "rtc", "^hwloc", "--bind-to", "none", prog}, args...)...)
	return runIn(t, e.rig.HostNSPath(), cmd, 120*time.Second)
}

// manyConns is edge.c's MANY: the connections of epollmany and pollmany.
const manyConns = 200

// regionSlots restarts hostd with a region of n flow slots: the stack's
// has 64, fewer than the many-connection tests hold at once. (This edits
// the config integration/stack writes; a Slots option there would be
// cleaner.)
func (e *env) regionSlots(n int) {
	e.t.Helper()
	const old = "slots = 64"
	b, err := os.ReadFile(e.Config)
	if err != nil || !bytes.Contains(b, []byte(old)) {
		e.t.Fatalf("hostd's config has no %q (did integration/stack change?): %v\n%s", old, err, b)
	}
	e.StopHostd()
	b = bytes.Replace(b, []byte(old), []byte(fmt.Sprintf("slots = %d", n)), 1)
	if err := os.WriteFile(e.Config, b, 0o600); err != nil {
		e.t.Fatal(err)
	}
	if err := os.Remove(e.RegionPath()); err != nil && !os.IsNotExist(err) { // its geometry changes
		e.t.Fatal(err)
	}
	e.startHostd()
}

// TestPreloadEarlyCaller: a shared library whose constructor reads and
// writes before the preload library's constructor has run (OpenSSH's sshd
// through libcap-ng) must not crash: every wrapper resolves the real
// symbols on first use. The library before that crashed with SIGSEGV.
func TestPreloadEarlyCaller(t *testing.T) {
	needPreload(t)
	dir := t.TempDir()
	early := filepath.Join(dir, "shunt-early")
	if err := makeC(dir, early); err != nil {
		testenv.Missing(t, "cannot build the early-caller program: "+err.Error(), "apt-get install make gcc libc6-dev")
	}
	cmd := exec.Command(shuntRun, early)
	cmd.Env = append(os.Environ(), "SHUNT_PRELOAD="+preloadLib, "SHUNT_CONTROL="+filepath.Join(dir, "no-hostd.sock"))
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "PASS early") {
		t.Fatalf("shunt-run %s: %v\n%s", early, err, out)
	}
}

// TestPreloadEdgeCases runs the C edge-semantics suite (ctest/edge.c):
// MSG_PEEK and MSG_DONTWAIT, MSG_WAITALL, half-close, dup/dup2/F_DUPFD,
// non-blocking connect, epoll with fast-path and kernel fds in one set,
// nested epoll, fork, exec with the fd open, exit with the fd open (the
// peer reads EOF, as with kernel TCP), a blocked read ending in
// ECONNRESET on revocation, a program without hostd running on plain TCP
// and saying why, and epoll and poll over more fast-path connections than
// one futex_waitv call can watch, with data on the last. Then calls
// blocked in one thread and acted on from another, as with kernel
// sockets: a signal handler without SA_RESTART ends a blocked read or
// send with EINTR (or the bytes moved so far), one with SA_RESTART lets
// it go on; SO_RCVTIMEO and SO_SNDTIMEO end it with EAGAIN, and with a
// timeout any handler ends it with EINTR; another thread's send and
// non-blocking recv do not wait behind a blocked recv, its shutdown(SHUT_RD)
// ends the recv with 0, shutdown(SHUT_WR) a blocked send with EPIPE, and
// close a blocked read with EBADF; and fork while another thread connects
// leaves the child able to connect.
//
// SHUNT_EDGE_PRELOAD runs the suite against another build of the library,
// for example one from an older commit, to see a case fail there.
func TestPreloadEdgeCases(t *testing.T) {
	testenv.NeedTool(t, "conntrack", "conntrack")
	// The many-connection tests get their own server, with the smallest
	// rings, so that manyConns flows fit in the region.
	e := newEnv(t, 2, `rule "many" {
  action    = "fastpath"
  ports     = ["7701"]
  ring_size = "4KiB"
}`)
	needPreload(t)
	lib := preloadLib
	if p := os.Getenv("SHUNT_EDGE_PRELOAD"); p != "" {
		lib = p
	}
	e.regionSlots(512)
	dir := t.TempDir()
	edge := filepath.Join(dir, "shunt-edge")
	if err := makeC(dir, edge); err != nil {
		testenv.Missing(t, "cannot build the edge suite: "+err.Error(), "apt-get install make gcc libc6-dev")
	}
	g2 := e.rig.Guests[1].Addr.String()
	clientAt := func(port, test string) *exec.Cmd {
		cmd := exec.Command(shuntRun, "-v", edge, "client", g2, port, test)
		cmd.Env = append(os.Environ(), "SHUNT_CONTROL="+e.control(e.rig.Guests[0]), "SHUNT_PRELOAD="+lib, fixedDelay)
		return cmd
	}
	client := func(test string) *exec.Cmd { return clientAt("7700", test) }
	server := func(port string) *outLog {
		srv := exec.Command(shuntRun, "-v", edge, "server", g2, port)
		srv.Env = append(os.Environ(), "SHUNT_CONTROL="+e.control(e.rig.Guests[1]), "SHUNT_PRELOAD="+lib, fixedDelay)
		return e.startLog(2, srv)
	}
	srvOut := server("7700")
	server("7701")
	e.waitListening(2, 7700)
	e.waitListening(2, 7701)
	for _, test := range []string{"peek", "waitall", "halfclose", "dup", "nonblock", "nonblock64", "sendfile64", "epoll", "nested", "fork", "exec",
		"rst", "chk", "mmsg", "splice", "iov"} {
		t.Run(test, func(t *testing.T) {
			out := e.runT(t, 1, client(test))
			if !strings.Contains(out, "PASS "+test) || fastLines(out) != 1 {
				t.Fatalf("%s:\n%s", test, out)
			}
		})
	}
	// A close with the client's bytes unread in the server's ring resets
	// the connection, as the kernel's close does for its own unread data
	// (the server's library says so: without it the client read EOF).
	t.Run("unread", func(t *testing.T) {
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("the server's log:\n%s", srvOut.String())
			}
		})
		out := e.runT(t, 1, client("unread"))
		if !strings.Contains(out, "PASS unread") || fastLines(out) != 1 {
			t.Fatalf("unread:\n%s", out)
		}
		if !srvOut.waitCount("closed with unread bytes (ring 10,", 1, 5*time.Second) {
			t.Fatalf("the server's library did not reset for its unread ring bytes:\n%s", srvOut.String())
		}
	})
	for _, test := range []string{"epollmany", "pollmany"} {
		t.Run(test, func(t *testing.T) {
			out := e.runT(t, 1, clientAt("7701", test))
			if !strings.Contains(out, "PASS "+test) || fastLines(out) != manyConns {
				t.Fatalf("%s (%d of %d connections on the fast path):\n%s", test, fastLines(out), manyConns, out)
			}
		})
	}
	t.Run("exitopen", func(t *testing.T) {
		out := e.runT(t, 1, client("exitopen"))
		if !strings.Contains(out, "PASS exitopen") || fastLines(out) != 1 {
			t.Fatalf("client:\n%s", out)
		}
		if !srvOut.waitCount("exitopen-server", 1, 5*time.Second) {
			t.Fatalf("the server's verdict: not within 5s:\n%s", srvOut.String())
		}
		if !strings.Contains(srvOut.String(), "PASS exitopen-server") {
			t.Fatalf("server, after the client exited with the connection open:\n%s", srvOut.String())
		}
	})
	// A raw write(2) to a fast-path fd lands on its kernel socket: the
	// library must end the flow with ECONNRESET on both ends, not hang.
	t.Run("rawwrite", func(t *testing.T) {
		out := e.runT(t, 1, client("rawwrite"))
		if !strings.Contains(out, "PASS rawwrite") || fastLines(out) != 1 {
			t.Fatalf("client:\n%s", out)
		}
		if !srvOut.waitCount("rawwrite-server", 1, 10*time.Second) {
			t.Fatalf("the server's verdict: not within 10s:\n%s", srvOut.String())
		}
		if !strings.Contains(srvOut.String(), "PASS rawwrite-server") {
			t.Fatalf("server, after the client's raw write:\n%s", srvOut.String())
		}
	})
	// Nothing listens on 7799: the kernel's errors, kept (no fast path).
	t.Run("connrefused", func(t *testing.T) {
		out := e.runT(t, 1, clientAt("7799", "connrefused"))
		if !strings.Contains(out, "PASS connrefused") || fastLines(out) != 0 {
			t.Fatalf("connrefused:\n%s", out)
		}
	})
	// Short connections in a row (shunt-connrate's loop), some of them
	// paired while they close. hostd reads the client's session slowly
	// meanwhile (the OPEN of a connection already gone costs it a
	// conntrack lookup's retries): nothing may wait for it. connect() and
	// close() once blocked in a full control socket for ~10 s at a time.
	t.Run("shortconns", func(t *testing.T) {
		cmd := client("shortconns")
		cmd.Env = append(cmd.Env, "SHUNT_EDGE_CONNS=1000")
		out := e.runT(t, 1, cmd)
		m := regexp.MustCompile(`PASS shortconns (\d+) connections in (\d+) ms`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("client:\n%s", out)
		}
		if ms, _ := strconv.Atoi(m[2]); ms > 5000 {
			t.Fatalf("%s connections took %s ms: a call waited for hostd\n%s", m[1], m[2], out)
		}
		t.Log(m[0])
	})
	t.Run("uring", func(t *testing.T) {
		out := e.runT(t, 1, client("uring"))
		if !strings.Contains(out, "PASS uring") || fastLines(out) != 0 || !strings.Contains(out, "tcp (io_uring") {
			t.Fatalf("after io_uring_setup, the connection must stay on TCP:\n%s", out)
		}
	})
	// A conntrack DESTROY is a downgrade (DOWN conntrack-gone): the
	// connection goes on over TCP, as the kernel and the firewall let it.
	t.Run("revoke", func(t *testing.T) {
		cmd := client("revoke")
		stdin, r, stderr := e.startAt(t, 1, cmd, "blocked\n")
		defer cmd.Process.Kill()
		e.hostCmd("conntrack", "-D", "-p", "tcp", "--dport", "7700")
		eventually(t, 5*time.Second, "the library's DOWN", func() bool { return strings.Contains(stderr.String(), ": down (conntrack-gone)") })
		fmt.Fprintln(stdin, "go")
		line, _ := r.ReadString('\n')
		cmd.Wait()
		if line != "PASS revoke\n" {
			t.Fatalf("after conntrack -D: %q\n%s", line, stderr.String())
		}
	})
	// Blocked calls. sigsend, sndtimeo and shutwr fill a ring first, so
	// they use the small rings of port 7701, and a second connection lets
	// the server read; closewake connects again after the close. fast is
	// how many connections take the fast path (-1: at least one).
	for _, tc := range []struct {
		test, port string
		fast       int
	}{
		{"waiteintr", "7700", 1}, {"eintr", "7700", 1}, {"restart", "7700", 1}, {"rcvtimeo", "7700", 1},
		{"sigsend", "7701", 2}, {"sndtimeo", "7701", 2}, {"shutwr", "7701", 2},
		{"threads", "7700", 1}, {"closewake", "7700", 2}, {"forkloop", "7700", -1},
	} {
		t.Run(tc.test, func(t *testing.T) {
			out := e.runT(t, 1, clientAt(tc.port, tc.test))
			n := fastLines(out)
			if !strings.Contains(out, "PASS "+tc.test) || (tc.fast >= 0 && n != tc.fast) || n < 1 {
				t.Fatalf("%s (%d connections on the fast path, want %d):\n%s", tc.test, n, tc.fast, out)
			}
			if tc.fast < 0 {
				t.Logf("%s: %d connections on the fast path, %d on TCP", tc.test, n, strings.Count(out, ": tcp ("))
			}
		})
	}
	// Fork models (ctest/edge_fork.c; docs/preload.md, Rules: fork). An
	// accept-then-fork server forks inside the open delay: both processes
	// hold the connection, and the child that serves it takes the fast
	// path once the parent closed its copy (at once, or after KEEP_MS
	// while the child serves on TCP). A parent that wrote on it too, and a
	// child that execs /bin/cat on it (inetd), leave it on TCP. Pre-fork
	// workers accepting on their parent's listener each get the fast
	// path, and so do workers with SO_REUSEPORT listeners of their own
	// (each closes a second one, which must not unregister the first). A
	// fork while a connection streams on the rings leaves it there.
	serveMode := func(args []string, env ...string) *outLog {
		srv := exec.Command(shuntRun, append([]string{"-v", edge, args[0], g2}, args[1:]...)...)
		srv.Env = append(append(os.Environ(), "SHUNT_CONTROL="+e.control(e.rig.Guests[1]), "SHUNT_PRELOAD="+lib, fixedDelay), env...)
		return e.startLog(2, srv)
	}
	forkOut := serveMode([]string{"forkserver", "7702"})
	preOut := serveMode([]string{"prefork", "7703"})
	reuseOut := serveMode([]string{"reuseport", "7704"})
	// Without the open delay the server's OPEN is out before the fork:
	// the parent tells hostd (CLOSE), and the client stays on TCP.
	toldOut := serveMode([]string{"forkserver", "7705"}, "SHUNT_OPEN_DELAY_MS=0")
	// A CGI-style server: posix_spawn /bin/cat on the connection, and keep
	// the server's copy open until cat exits.
	spawnOut := serveMode([]string{"spawnserver", "7706"})
	keepOut := serveMode([]string{"forkserver", "7707", "keep"})
	pioOut := serveMode([]string{"forkserver", "7708", "parentio"})
	inetdOut := serveMode([]string{"forkserver", "7709", "inetd"})
	// The same through system(), which glibc runs without any hook a
	// preload library sees: the library's own system() lets it go.
	systemOut := serveMode([]string{"systemserver", "7710"})
	for _, p := range []int{7702, 7703, 7704, 7705, 7706, 7707, 7708, 7709, 7710} {
		e.waitListening(2, p)
	}
	// forkconnect, forkdup and forkstorm fork in the library's windows
	// (ctest/edge_fork.c): a connect under way (a second connect() must
	// OPEN nothing, in either process), a dup'd fd in epoll inside the open
	// delay, and forks from one thread while others connect, accept,
	// echo (OPEN out, READY coming) and close connecting sockets. fast is
	// how many connections take the fast path (-1: at least one; -2: any
	// number, the test's timing decides).
	for _, tc := range []struct {
		name, test, port string
		fast             int
		srv              *outLog // the server's output, shown on failure
		srvWant          string  // a line the server must print this many more times
		srvCount         int
	}{
		{"afork", "afork", "7702", 1, forkOut, ": shunt (slot ", 1},
		{"aforkkeep", "aforkkeep", "7707", 1, keepOut, ": shunt (slot ", 1},
		{"aforkp", "aforkp", "7708", 0, pioOut, "tcp (fork: another process used the connection too)", 1},
		{"afork-told", "afork", "7705", 0, toldOut, ", hostd told)", 1},
		{"inetd", "inetd", "7709", 0, inetdOut, ": tcp (exec: ", 1},
		{"prefork", "prefork", "7703", 2, preOut, ": shunt (slot ", 2},
		{"reuseport", "reuseport", "7704", 2, reuseOut, ": shunt (slot ", 2},
		{"forkring", "forkring", "7700", 1, srvOut, "", 0},
		{"forkconnect", "forkconnect", "7700", 0, srvOut, "", 0},
		{"forkdup", "forkdup", "7700", -2, srvOut, "", 0},
		{"forkstorm", "forkstorm", "7700", -1, srvOut, "", 0},
		{"spawnkeep", "spawnkeep", "7706", 0, spawnOut, ": tcp (spawn: ", 1},
		{"systemkeep", "systemkeep", "7710", 0, systemOut, ": tcp (spawn: ", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, _ := tc.srv.count(tc.srvWant)
			out := e.runT(t, 1, clientAt(tc.port, tc.test))
			n := fastLines(out)
			if !strings.Contains(out, "PASS "+tc.test) || (tc.fast >= 0 && n != tc.fast) || (tc.fast == -1 && n < 1) {
				t.Fatalf("%s (%d connections on the fast path, want %d):\n%s\nserver:\n%s", tc.test, n, tc.fast, out, tc.srv.String())
			}
			switch tc.test {
			case "forkring":
				if strings.Contains(out, "tcp (fork") || strings.Contains(out, "left the rings") {
					t.Fatalf("a fork moved the connection off the rings:\n%s", out)
				}
			case "forkconnect":
				if strings.Contains(out, ": open (request ") || !strings.Contains(out, "tcp (fork: the connect was under way)") {
					t.Fatalf("a socket whose connect was under way at the fork must be the kernel's in both processes (no OPEN):\n%s", out)
				}
			case "forkdup":
				// The child exits without touching it: the
				// connection stays the library's, not the kernel's.
				if strings.Contains(out, "tcp (fork") {
					t.Fatalf("a fork inside the open delay let the connection go:\n%s", out)
				}
			case "forkstorm":
				t.Logf("%s: %d connections on the fast path, %d let go at a fork", tc.test, n, strings.Count(out, "tcp (fork"))
			}
			if tc.srvWant == "" {
				return
			}
			// The server's -v lines come through a pipe: wait for them.
			if !tc.srv.waitCount(tc.srvWant, before+tc.srvCount, 5*time.Second) {
				got, _ := tc.srv.count(tc.srvWant)
				t.Fatalf("the server printed %q %d more times, want %d:\n%s\nclient:\n%s", tc.srvWant, got-before, tc.srvCount,
					tc.srv.String(), out)
			}
			if tc.test == "aforkkeep" && !strings.Contains(tc.srv.String(), "another process holds the connection too since a fork") {
				t.Fatalf("the child did not wait while the parent held its copy:\n%s", tc.srv.String())
			}
		})
	}
	t.Run("hostd-absent", func(t *testing.T) {
		cmd := client("plain")
		cmd.Env = append(cmd.Env, "SHUNT_CONTROL=/nonexistent/shunt.sock")
		out := e.runT(t, 1, cmd)
		if !strings.Contains(out, "PASS plain") || !strings.Contains(out, "tcp (no-hostd)") {
			t.Fatalf("without hostd:\n%s", out)
		}
	})
}
