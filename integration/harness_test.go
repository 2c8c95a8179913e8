package integration

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

var hostdBin string

func TestMain(m *testing.M) {
	if os.Getenv("SHUNT_E2E_CHILD") != "" {
		os.Exit(child())
	}
	dir, err := os.MkdirTemp("", "shunt-e2e-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	hostdBin = filepath.Join(dir, "hostd")
	out, err := exec.Command("go", "build", "-o", hostdBin, "../cmd/hostd").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "build hostd: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// env is one test's world: a rig, a hostd, and a guestlib client per guest.
type env struct {
	t       *testing.T
	rig     *nsrig.Rig
	dir     string
	cfg     string
	admin   string
	hostd   *exec.Cmd
	logs    *os.File
	clients []*guestlib.Client
	lns     map[[2]int]*guestlib.Listener // by guest and port
}

var rigSeq int

// newEnv creates a rig of n guests and starts hostd with the given policy
// block body. Everything is removed when the test ends.
func newEnv(t *testing.T, n int, policy string) *env {
	t.Helper()
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	rigSeq++
	r, err := nsrig.New(fmt.Sprintf("e%d%d", os.Getpid()%1000, rigSeq), n)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatalf("create rig: %v", err)
	}
	e := &env{t: t, rig: r, dir: t.TempDir(), lns: map[[2]int]*guestlib.Listener{}}
	t.Cleanup(func() {
		for _, c := range e.clients {
			c.Close()
		}
		e.stopHostd()
		if err := r.Destroy(); err != nil {
			t.Errorf("destroy rig: %v", err)
		}
		os.Remove("/dev/shm/shunt-" + r.Name)
		if t.Failed() && e.logs != nil {
			b, _ := os.ReadFile(e.logs.Name())
			t.Logf("hostd log:\n%s", b)
		}
	})
	e.admin = filepath.Join(e.dir, "admin.sock")
	e.writeConfig(policy)
	e.startHostd()
	for _, g := range r.Guests {
		c, err := guestlib.NewClient(guestlib.Options{Control: e.control(g), Logf: t.Logf})
		if err != nil {
			t.Fatal(err)
		}
		e.clients = append(e.clients, c)
	}
	return e
}

func (e *env) control(g *nsrig.Guest) string { return filepath.Join(e.dir, g.Name+".sock") }

func (e *env) writeConfig(policy string) {
	var b strings.Builder
	fmt.Fprintf(&b, "log_level = \"debug\"\nadmin_socket = %q\nmetrics_address = \"\"\nconntrack_netns = %q\npairing_timeout = \"1s\"\nreattach_grace = \"3s\"\n",
		e.admin, e.rig.HostNSPath())
	fmt.Fprintf(&b, "trust_group \"t\" {\n  region = %q\n  region_size = \"32MiB\"\n  slots = 64\n}\n", "/dev/shm/shunt-"+e.rig.Name)
	for _, g := range e.rig.Guests {
		fmt.Fprintf(&b, "guest %q {\n  id = %d\n  group = \"t\"\n  control = %q\n  interface = %q\n  ct_mark = %d\n}\n",
			g.Name, g.Index, e.control(g), g.HostIf, g.Index)
	}
	fmt.Fprintf(&b, "policy {\n%s\n}\n", policy)
	e.cfg = filepath.Join(e.dir, "hostd.hcl")
	if err := os.WriteFile(e.cfg, []byte(b.String()), 0o600); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) startHostd() {
	e.t.Helper()
	if e.logs == nil {
		f, err := os.Create(filepath.Join(e.dir, "hostd.log"))
		if err != nil {
			e.t.Fatal(err)
		}
		e.logs = f
	}
	cmd := exec.Command(hostdBin, "agent", "-config", e.cfg)
	cmd.Stdout, cmd.Stderr = e.logs, e.logs
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.hostd = cmd
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := admin.Call(e.admin, admin.Request{Cmd: "status"}, nil); err == nil {
			return
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(e.logs.Name())
			e.t.Fatalf("hostd did not come up in 10s:\n%s", b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (e *env) stopHostd() {
	if e.hostd == nil {
		return
	}
	e.hostd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { e.hostd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		e.hostd.Process.Kill()
		<-done
	}
	e.hostd = nil
}

func (e *env) killHostd() {
	e.hostd.Process.Kill()
	e.hostd.Wait()
	e.hostd = nil
}

// listen listens on port in guest i (1-based) through guestlib, once per
// guest and port.
func (e *env) listen(i int, port int) *guestlib.Listener {
	e.t.Helper()
	if l := e.lns[[2]int{i, port}]; l != nil {
		return l
	}
	g := e.rig.Guests[i-1]
	var l *guestlib.Listener
	err := nsrig.In(g.NSPath(), func() error {
		lc := guestlib.ListenConfig{Client: e.clients[i-1]}
		var err error
		l, err = lc.Listen(context.Background(), "tcp4", fmt.Sprintf("%s:%d", g.Addr, port))
		return err
	})
	if err != nil {
		e.t.Fatalf("listen in %s: %v", g.Name, err)
	}
	e.t.Cleanup(func() { l.Close() })
	e.lns[[2]int{i, port}] = l
	return l
}

// dial dials addr from guest i through guestlib.
func (e *env) dial(i int, addr string) (*guestlib.Conn, error) {
	g := e.rig.Guests[i-1]
	var c *guestlib.Conn
	err := nsrig.In(g.NSPath(), func() error {
		d := guestlib.Dialer{Client: e.clients[i-1]}
		var err error
		c, err = d.DialContext(context.Background(), "tcp4", addr)
		return err
	})
	return c, err
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
	if err := admin.Call(e.admin, admin.Request{Cmd: "flows"}, &fl); err != nil {
		e.t.Fatalf("hostd flows: %v", err)
	}
	return fl
}

func (e *env) counter(key string) float64 {
	e.t.Helper()
	var cs map[string]float64
	if err := admin.Call(e.admin, admin.Request{Cmd: "counters"}, &cs); err != nil {
		e.t.Fatalf("hostd counters: %v", err)
	}
	return cs[key]
}

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

var _ = net.ErrClosed
