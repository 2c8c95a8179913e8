package integration

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
)

// Real servers from Debian packages under shunt-run in the namespace rig
// (issue 12): nginx (servers_nginx_test.go), OpenSSH (servers_ssh_test.go),
// socat's accept-then-fork and redis-benchmark's connection per request
// (servers_misc_test.go). The server runs in guest 2 and its clients in
// guest 1, all under shunt-run -v. Each test checks the data, asserts the
// fast path where the design says it is taken, gives every command a
// deadline, and on failure shows both ends: every process's -v lines and
// hostd's flows.

// serverPkgs names the Debian package of each program these tests run
// (scripts/deps.sh test installs them).
var serverPkgs = map[string]string{
	"nginx": "nginx", "sshd": "openssh-server", "ssh": "openssh-client", "scp": "openssh-client",
	"ssh-keygen": "openssh-client", "socat": "socat", "ab": "apache2-utils", "curl": "curl",
	"redis-server": "redis-server", "redis-benchmark": "redis-tools", "redis-cli": "redis-tools",
	"memcached": "memcached", "memcslap": "libmemcached-tools", "python3": "python3",
	"apache2": "apache2", "haproxy": "haproxy", "node": "nodejs", "pgbench": "postgresql-contrib", "psql": "postgresql-client",
}

// toolPath finds a program (sbin directories too: sshd and nginx live
// there, and a test's PATH may lack them); it skips or fails t, as
// testenv.Missing does, when the program is not installed.
func toolPath(t testing.TB, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range []string{"/usr/sbin", "/sbin", "/usr/local/sbin"} {
		if p := filepath.Join(dir, name); isExec(p) {
			return p
		}
	}
	testenv.Missing(t, name+" is not installed", "apt-get install "+serverPkgs[name]+" (or: bash scripts/deps.sh test)")
	return ""
}

func isExec(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0
}

// srvEnv is a server test's world: a two-guest stack, the processes the
// test started (each the root of a process tree: servers fork), and the
// failure report that shows them all with hostd's flows.
type srvEnv struct {
	*env
	t *testing.T

	mu     sync.Mutex
	procs  []*guestProc
	dumped bool
}

// newSrvEnv starts the stack and checks for root, the library and the
// named programs. When the test ends, every process tree it started is
// stopped (by pid) before the stack goes, and a failed test logs every
// process's output and hostd's flows, unless a failure message had them.
func newSrvEnv(t *testing.T, tools ...string) *srvEnv {
	t.Helper()
	testenv.NeedRoot(t)
	needPreload(t)
	for _, name := range tools {
		toolPath(t, name)
	}
	// Each guest has its netns in hostd.hcl: servers that drop privileges
	// (nginx's workers as www-data...) or chroot keep their control
	// channel. The trust group has hostd's default quotas and pair
	// regions (room for 32 connections per guest), as a packaged hostd.
	testenv.NeedTool(t, "nft", "nftables")
	s := &srvEnv{env: startEnv(t, "e", srvStackOptions()), t: t}
	t.Cleanup(func() {
		if t.Failed() && !s.dumped {
			t.Logf("state at the end:\n%s", s.state())
		}
		s.mu.Lock()
		procs := s.procs
		s.mu.Unlock()
		for i := len(procs) - 1; i >= 0; i-- {
			procs[i].stop()
		}
	})
	return s
}

// srvStackOptions: two guests, each with its netns in hostd.hcl, and
// hostd's default quotas and pair regions.
func srvStackOptions() stack.Options {
	return stack.Options{Guests: 2, HostdBin: hostdBin, Netns: true, Group: "  # hostd's default quotas and pair regions\n"}
}

// guestProc is a process started in a guest, perhaps the root of a tree.
type guestProc struct {
	guest int
	cmd   *exec.Cmd
	out   *lockedBuffer
	done  chan struct{} // closed when cmd.Wait returned
	err   error         // cmd.Wait's, once done is closed
}

// command is name (a program a test needs: toolPath) with args for guest
// i: under shunt-run -v when preload, with the guest's control socket and
// the library of this build. env adds variables.
func (s *srvEnv) command(i int, preload bool, env []string, name string, args ...string) *exec.Cmd {
	s.t.Helper()
	return srvCommand(s.t, s.env, i, preload, env, name, args...)
}

func srvCommand(t testing.TB, e *env, i int, preload bool, env []string, name string, args ...string) *exec.Cmd {
	t.Helper()
	path := name
	if !filepath.IsAbs(name) {
		path = toolPath(t, name)
	}
	cmd := exec.Command(path, args...)
	if preload {
		needPreload(t)
		cmd = exec.Command(shuntRun, append([]string{"-v", path}, args...)...)
	}
	cmd.Env = append(os.Environ(), "SHUNT_CONTROL="+e.control(e.rig.Guests[i-1]), "SHUNT_PRELOAD="+preloadLib)
	cmd.Env = append(cmd.Env, env...)
	return cmd
}

// start starts cmd in guest i, its output (stdout unless set, and stderr,
// where the library's -v lines go) in the returned process's out. The
// test's end stops it and its tree.
func (s *srvEnv) start(i int, cmd *exec.Cmd) *guestProc {
	s.t.Helper()
	p, err := startGuestProc(s.env, i, cmd)
	if err != nil {
		s.t.Fatal(err)
	}
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	return p
}

func startGuestProc(e *env, i int, cmd *exec.Cmd) (*guestProc, error) {
	p := &guestProc{guest: i, cmd: cmd, out: &lockedBuffer{}, done: make(chan struct{})}
	if cmd.Stdout == nil { // a test that wants the bytes a client wrote sets its Stdout
		cmd.Stdout = p.out
	}
	cmd.Stderr = p.out
	// A grandchild that outlives its parent (a forked worker) may hold
	// the output pipe: Wait gives up on the copy after this.
	cmd.WaitDelay = 5 * time.Second
	if err := nsrig.Start(e.rig.Guests[i-1].NSPath(), cmd); err != nil {
		return nil, fmt.Errorf("start %s in g%d: %w", cmd.Args, i, err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

// exited reports whether p has ended.
func (p *guestProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop asks p to end (SIGTERM), waits up to 5 s, then kills by
// pid what is left of its tree (workers and forked children outlive a
// killed parent) and what those forked since. A process that has already
// ended is not looked at (its pid may be another's by now). Idempotent.
func (p *guestProc) stop() {
	if p.exited() {
		return
	}
	tree := descendants(p.cmd.Process.Pid)
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
	}
	for _, pid := range tree {
		killTree(pid)
	}
	select { // bounded: WaitDelay ends Wait once the process is gone
	case <-p.done:
	case <-time.After(15 * time.Second):
		fmt.Fprintf(os.Stderr, "servers: %v (pid %d) did not end 15 s after SIGKILL of its tree\n", p.cmd.Args, p.cmd.Process.Pid)
	}
}

// killTree SIGKILLs pid, if it runs, and its descendants until none is
// left (a parent may fork while it is being killed).
func killTree(pid int) {
	for range 20 {
		tree := descendants(pid)
		if len(tree) == 0 {
			return
		}
		killPids(tree)
		time.Sleep(10 * time.Millisecond)
	}
}

func killPids(pids []int) {
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGKILL)
	}
}

// descendants returns pid, if it still runs (and is no zombie), and its
// living descendants, by the parent pids in /proc.
func descendants(pid int) []int {
	children := map[int][]int{}
	alive := map[int]bool{}
	ents, _ := os.ReadDir("/proc")
	for _, de := range ents {
		p, err := strconv.Atoi(de.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + de.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		rest := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(rest) < 2 {
			continue
		}
		ppid, _ := strconv.Atoi(rest[1])
		children[ppid] = append(children[ppid], p)
		alive[p] = rest[0] != "Z"
	}
	var out []int
	for todo := []int{pid}; len(todo) > 0; {
		p := todo[0]
		todo = todo[1:]
		if alive[p] {
			out = append(out, p)
		}
		todo = append(todo, children[p]...)
	}
	return out
}

// run runs cmd in guest i to its end within timeout and returns its
// output. A non-zero exit or the deadline fails the test with the whole
// state: this command's output, every other process's, and hostd's flows
// as they were at that moment.
func (s *srvEnv) run(i int, timeout time.Duration, cmd *exec.Cmd) string {
	s.t.Helper()
	p := s.start(i, cmd)
	select {
	case <-p.done:
		if p.err != nil {
			s.fatalf("%s in g%d: %v", p.cmd.Args, i, p.err)
		}
	case <-time.After(timeout):
		s.fatalf("%s in g%d did not finish within %s", p.cmd.Args, i, timeout)
	}
	return p.out.String()
}

// fatalf fails the test with the message, every process's output and
// hostd's flows.
func (s *srvEnv) fatalf(format string, args ...any) {
	s.t.Helper()
	st := s.state()
	s.dumped = true
	s.t.Fatalf(format+"\n%s", append(args, st)...)
}

// errorf fails the test with the message and goes on; the state (every
// process's output and hostd's flows) is logged when the test ends.
func (s *srvEnv) errorf(format string, args ...any) {
	s.t.Helper()
	s.t.Errorf(format, args...)
}

// state shows every process the test started, with a summary of its
// connections' paths and its last lines (all of them for short outputs),
// and hostd's flows.
func (s *srvEnv) state() string {
	var b strings.Builder
	s.mu.Lock()
	procs := append([]*guestProc(nil), s.procs...)
	s.mu.Unlock()
	for _, p := range procs {
		status := "running"
		if p.exited() {
			status = fmt.Sprintf("exited: %v", p.err)
		}
		out := p.out.String()
		fmt.Fprintf(&b, "==== g%d %s (pid %d, %s): %s\n%s\n", p.guest, strings.Join(p.cmd.Args, " "), p.cmd.Process.Pid, status, pathSummary(out), tailLines(out, 80))
		if !p.exited() {
			b.WriteString(threads(p.cmd.Process.Pid))
		}
	}
	fmt.Fprintf(&b, "==== hostd flows: %s\n", s.flowsJSON())
	return b.String()
}

// threads shows where each thread of pid and its descendants waits: its
// name, the kernel function it sleeps in (wchan) and its system call
// (number and arguments, /proc/PID/task/TID/syscall), for a process that
// hangs.
func threads(pid int) string {
	var b strings.Builder
	for _, p := range descendants(pid) {
		tids, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", p))
		for _, tid := range tids {
			dir := fmt.Sprintf("/proc/%d/task/%s/", p, tid.Name())
			comm, _ := os.ReadFile(dir + "comm")
			wchan, _ := os.ReadFile(dir + "wchan")
			sc, _ := os.ReadFile(dir + "syscall")
			fmt.Fprintf(&b, "  thread %d/%s %s: wchan %s, syscall %s\n", p, tid.Name(), strings.TrimSpace(string(comm)), wchan, strings.TrimSpace(string(sc)))
		}
	}
	return b.String()
}

// tailLines is the last n lines of out.
func tailLines(out string, n int) string {
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) <= n {
		return strings.Join(lines, "\n")
	}
	return fmt.Sprintf("(%d lines before these)\n%s", len(lines)-n, strings.Join(lines[len(lines)-n:], "\n"))
}

var tcpReason = regexp.MustCompile(`: tcp \(([^)]*)\)`)

// pathSummary says, from a process's -v lines, how many connections took
// the rings and how many stayed on TCP, by reason.
func pathSummary(out string) string {
	reasons := map[string]int{}
	for _, m := range tcpReason.FindAllStringSubmatch(out, -1) {
		reasons[m[1]]++
	}
	var rs []string
	for r, n := range reasons {
		rs = append(rs, fmt.Sprintf("%s: %d", r, n))
	}
	sort.Strings(rs)
	return fmt.Sprintf("%d onto the rings (shunt (slot ...) lines), %d tcp lines {%s}, %d down lines",
		fastLines(out), strings.Count(out, ": tcp ("), strings.Join(rs, ", "), strings.Count(out, ": down ("))
}

// ringStats is what a watch saw of hostd's flows.
type ringStats struct {
	onRings   int    // most flows on their rings at once
	ringBytes uint64 // most bytes written to one flow's rings, both ways
}

// watchRings asks hostd for its flows every 10 ms until the returned
// function is called, which returns what it saw.
func (s *srvEnv) watchRings() func() ringStats {
	stop, done := make(chan struct{}), make(chan ringStats)
	go func() {
		var st ringStats
		for {
			var fl []broker.FlowInfo
			if admin.Call(s.Admin, admin.Request{Cmd: "flows"}, &fl) == nil {
				n := 0
				for _, f := range fl {
					if f.Path == "rings" {
						n++
					}
					st.ringBytes = max(st.ringBytes, f.RingsAB+f.RingsBA)
				}
				st.onRings = max(st.onRings, n)
			}
			select {
			case <-stop:
				done <- st
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	return func() ringStats { close(stop); return <-done }
}

var statsLine = regexp.MustCompile(`stats: read (\d+) tcp \+ (\d+) ring = \d+, wrote (\d+) tcp \+ (\d+) ring`)

// ringBytes adds up, over the SHUNT_STATS=1 lines in out, the bytes read
// and written through the rings and over TCP.
func ringBytes(out string) (ring, tcp uint64) {
	for _, m := range statsLine.FindAllStringSubmatch(out, -1) {
		rt, _ := strconv.ParseUint(m[1], 10, 64)
		rr, _ := strconv.ParseUint(m[2], 10, 64)
		wt, _ := strconv.ParseUint(m[3], 10, 64)
		wr, _ := strconv.ParseUint(m[4], 10, 64)
		ring += rr + wr
		tcp += rt + wt
	}
	return ring, tcp
}

// writeRandom writes n seeded pseudo-random bytes to path and returns
// their SHA-256.
func writeRandom(t testing.TB, path string, n int64, seed uint64) string {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), byte(seed >> 24)})
	if _, err := io.Copy(io.MultiWriter(f, h), io.LimitReader(r, n)); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// fileSHA256 is the SHA-256 of the file at path, and its size.
func fileSHA256(t testing.TB, path string) (string, int64) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return hex.EncodeToString(h.Sum(nil)), n
}

// mib is a byte count in MiB, for logs.
func mib(n uint64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
