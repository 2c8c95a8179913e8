package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
)

var hostdBin, preloadLib, shuntRun string

func TestMain(m *testing.M) {
	if os.Getenv("SHUNT_E2E_CHILD") != "" {
		os.Exit(child())
	}
	dir, err := os.MkdirTemp("", "shunt-e2e-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// Servers that run as their own users (postgres) load the library too.
	os.Chmod(dir, 0o755)
	hostdBin = filepath.Join(dir, "hostd")
	out, err := exec.Command("go", "build", "-o", hostdBin, "../cmd/hostd").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "build hostd: %v\n%s", err, out)
		os.Exit(1)
	}
	// The preload library and shunt-run, for the unmodified-program tests,
	// built with the Makefile's flags (make preload).
	preloadLib = filepath.Join(dir, "libshunt-preload.so")
	shuntRun = filepath.Join(dir, "shunt-run")
	if err := makeC(dir, "preload"); err != nil {
		preloadLib = "" // tests that need it say why
		fmt.Fprintf(os.Stderr, "build libshunt-preload.so: %v\n", err)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// env is one test's world: a stack plus test helpers.
type env struct {
	*stack.Stack
	t   *testing.T
	rig *nsrig.Rig
	lns map[[2]int]*guestlib.Listener // by guest and port
}

var rigSeq int

// newEnv starts a stack of n guests with the given policy block body; it is
// removed when the test ends, and hostd's log is shown if the test failed.
func newEnv(t testing.TB, n int, policy string) *env {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	return startEnv(t, "e", stack.Options{Guests: n, HostdBin: hostdBin, Policy: policy})
}

// startEnv starts a stack with o (named from prefix, in a temporary
// directory, logging to t) for a test, as newEnv says.
func startEnv(t testing.TB, prefix string, o stack.Options) *env {
	t.Helper()
	// A name whose region file is still there (left by a test process
	// that was killed) is skipped: hostd rightly refuses a region it has
	// no record of creating.
	for {
		rigSeq++
		o.Name = fmt.Sprintf("%s%d%d", prefix, os.Getpid()%1000, rigSeq)
		if _, err := os.Stat("/dev/shm/shunt-" + o.Name); err != nil {
			break
		}
	}
	o.Dir = t.TempDir()
	o.Logf = t.Logf
	s, err := stack.Start(o)
	if err != nil {
		t.Fatalf("start stack: %v", err)
	}
	e := &env{Stack: s, rig: s.Rig, lns: map[[2]int]*guestlib.Listener{}}
	if tt, ok := t.(*testing.T); ok {
		e.t = tt
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("hostd log:\n%s", s.Log())
		}
		if err := s.Close(); err != nil {
			t.Errorf("close stack: %v", err)
		}
	})
	return e
}

func (e *env) control(g *nsrig.Guest) string { return e.Control(g) }
func (e *env) writeConfig(policy string) {
	if err := e.WriteConfig(policy); err != nil {
		e.t.Fatal(err)
	}
}
func (e *env) startHostd() {
	if err := e.StartHostd(); err != nil {
		e.t.Fatal(err)
	}
}
func (e *env) killHostd() { e.KillHostd() }

// listen listens on port in guest i (1-based), once per guest and port.
func (e *env) listen(i int, port int) *guestlib.Listener {
	e.t.Helper()
	if l := e.lns[[2]int{i, port}]; l != nil {
		return l
	}
	l, err := e.Listen(i, port)
	if err != nil {
		e.t.Fatalf("listen in g%d: %v", i, err)
	}
	e.t.Cleanup(func() { l.Close() })
	e.lns[[2]int{i, port}] = l
	return l
}

// dial dials addr from guest i through guestlib.
func (e *env) dial(i int, addr string) (*guestlib.Conn, error) {
	return e.Dial(context.Background(), i, addr)
}

// pair dials from guest a to a listener in guest b and returns both ends.
func (e *env) pair(a, b, port int) (client, server *guestlib.Conn) {
	e.t.Helper()
	l := e.listen(b, port)
	acc := make(chan *guestlib.Conn, 1)
	go func() {
		c, err := l.AcceptShunt()
		if err != nil {
			e.t.Errorf("accept: %v", err)
		}
		acc <- c
	}()
	c, err := e.dial(a, fmt.Sprintf("%s:%d", e.rig.Guests[b-1].Addr, port))
	if err != nil {
		e.t.Fatalf("dial: %v", err)
	}
	s := <-acc
	e.t.Cleanup(func() { c.Close(); s.Close() })
	return c, s
}

func (e *env) flows() []broker.FlowInfo {
	e.t.Helper()
	var fl []broker.FlowInfo
	if err := admin.Call(e.Admin, admin.Request{Cmd: "flows"}, &fl); err != nil {
		e.t.Fatalf("hostd flows: %v", err)
	}
	return fl
}

func (e *env) counter(key string) float64 {
	e.t.Helper()
	return hostdCounter(e.t, e, key)
}

// ringsMoved runs fn and returns how many directions hostd moved onto
// the rings meanwhile, by its counter of first switches: a short job can
// be on and off the rings between two polls of hostd's flow list.
func (e *env) ringsMoved(fn func()) int {
	before := e.counter(firstSwitches)
	fn()
	return int(e.counter(firstSwitches) - before)
}

// firstSwitches is hostd's counter of flows' first moves onto the rings.
const firstSwitches = "shunt_switches_total{reason=none,to=rings}"

// eventually polls cond every 10 ms until it holds or the bound passes.
func eventually(t *testing.T, bound time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, bound)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// hostCmd runs a command in the rig's host namespace.
func (e *env) hostCmd(name string, args ...string) string {
	e.t.Helper()
	out, err := nsrig.Run(e.rig.HostNSPath(), name, args...)
	if err != nil {
		e.t.Fatal(err)
	}
	return out
}
