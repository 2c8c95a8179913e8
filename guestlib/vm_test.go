package guestlib

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/shuntnet/shunt/guestlib/guesttest"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// fakeVM is a VM's /sys and /dev as the discovery reads them
// (docs/vm.md, "Discovery"): a control port per path given
// (org.shunt.ctl, org.shunt.ctl.1, ...; /dev/vport1pN links to the path)
// and an ivshmem device whose BAR is the fake hostd's region.
type fakeVM struct{ sysfs, dev, pci string }

func newFakeVM(t *testing.T, h *guesttest.Hostd, ports ...string) fakeVM {
	t.Helper()
	vm := fakeVM{sysfs: t.TempDir(), dev: t.TempDir()}
	mk := func(path, body string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for i, p := range ports {
		entry := fmt.Sprintf("vport1p%d", i+1)
		mk(filepath.Join(vm.sysfs, "class/virtio-ports", entry, "name"), vserial.PortName(i)+"\n")
		if err := os.Symlink(p, filepath.Join(vm.dev, entry)); err != nil {
			t.Fatal(err)
		}
	}
	vm.pci = filepath.Join(vm.sysfs, "bus/pci/devices/0000:00:05.0")
	mk(filepath.Join(vm.pci, "vendor"), "0x1af4\n")
	mk(filepath.Join(vm.pci, "device"), "0x1110\n")
	mk(filepath.Join(vm.pci, "enable"), "0\n")
	if err := os.Symlink(h.Region, filepath.Join(vm.pci, "resource2")); err != nil {
		t.Fatal(err)
	}
	return vm
}

// vmClient is a client made with o (no Control) and neither
// $SHUNT_CONTROL nor $SHUNT_REGION, as a program in vm makes it: there is
// no default socket, so it discovers.
func vmClient(t *testing.T, vm fakeVM, o Options) *Client {
	t.Helper()
	unsetenv(t, "SHUNT_CONTROL", "SHUNT_REGION")
	c, err := NewClient(o)
	if err != nil {
		t.Fatal(err)
	}
	if !c.discover || c.opts.Control != defaultControl {
		t.Fatalf("a client without Control: discover %v, control %s", c.discover, c.opts.Control)
	}
	c.opts.Control = filepath.Join(t.TempDir(), "guest.sock") // the default socket, which a VM does not have
	c.vm = vmRoot{sysfs: vm.sysfs, dev: vm.dev, open: vserial.Open}
	c.loopback = true
	t.Cleanup(func() { c.Close() })
	return c
}

// logLines collects a client's log.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

// count returns how many lines contain s.
func (l *logLines) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n
}

// unsetenv unsets the variables until the test ends.
func unsetenv(t *testing.T, names ...string) {
	for _, n := range names {
		t.Setenv(n, "") // restored at the end
		os.Unsetenv(n)
	}
}

// Which settings turn discovery on: only the absence of both Control
// and $SHUNT_CONTROL (set but empty counts as set, as in the C core).
func TestDiscoverOnlyWithoutControl(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     *string
		control string
		want    bool
	}{
		{"nothing set", nil, "", true},
		{"SHUNT_CONTROL", ptr("/run/x.sock"), "", false},
		{"SHUNT_CONTROL empty", ptr(""), "", false},
		{"Options.Control", nil, "/run/y.sock", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			unsetenv(t, "SHUNT_CONTROL")
			if tc.env != nil {
				os.Setenv("SHUNT_CONTROL", *tc.env)
			}
			o, discover, err := Options{Control: tc.control}.withEnv()
			if err != nil || discover != tc.want || o.Control == "" {
				t.Fatalf("discover = %v, control %q, %v; want %v", discover, o.Control, err, tc.want)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

// A client with no options in a VM finds the control port and the
// ivshmem BAR on its own: it says HELLO on the port, maps the BAR (not
// the host path WELCOME names), wakes peers by KICK and keeps the port
// alive with PINGs.
func TestVMDiscovery(t *testing.T) {
	h := guesttest.Start(t)
	port := h.Port(t)
	vm := newFakeVM(t, h, port)
	var log logLines
	c := vmClient(t, vm, Options{Logf: log.logf})
	done := async(c.ensure)
	s := h.Accept(t)
	s.Expect(t, proto.Hello)
	s.WelcomeVM(t)
	if err := await(t, done, "ensure"); err != nil {
		t.Fatalf("ensure over a discovered port: %v", err)
	}
	c.mu.Lock()
	mapped := c.region != nil
	c.mu.Unlock()
	if !mapped {
		t.Error("the region is not mapped: want the BAR")
	}
	if b, _ := os.ReadFile(filepath.Join(vm.pci, "enable")); string(b) != "1" {
		t.Errorf("ivshmem enable = %q, want 1", b)
	}
	if c.kick.Load() == nil {
		t.Error("kicks are off on a port")
	}
	if want := "control port " + filepath.Join(vm.dev, "vport1p1"); log.count(want) != 1 {
		t.Errorf("log %q: want one %q", log.lines, want)
	}
	s.Expect(t, proto.Ping) // the port's keepalive
}

// The default socket, where it exists, wins over a VM's ports (a process
// guest under shunt-run), and no kicks are used on it.
func TestDefaultSocketBeforePorts(t *testing.T) {
	h := guesttest.Start(t)
	vm := newFakeVM(t, h, "/nonexistent/port") // opening it would fail
	c := vmClient(t, vm, Options{})
	c.opts.Control = h.Control
	done := async(c.ensure)
	h.Greet(t)
	if err := await(t, done, "ensure"); err != nil {
		t.Fatalf("ensure on the default socket: %v", err)
	}
	if c.kick.Load() != nil {
		t.Error("kicks are on over a Unix socket")
	}
}

// Two programs in two VMs, both with no options, get the fast path to
// each other: each took its VM's port and BAR, and bytes move both ways
// on the rings, with readers woken by KICK (relayed by the fake hostd).
func TestVMDiscoveryFastPath(t *testing.T) {
	h := guesttest.Start(t)
	h.Auto(t)
	srv := vmClient(t, newFakeVM(t, h, h.Port(t)), Options{})
	cli := vmClient(t, newFakeVM(t, h, h.Port(t)), Options{})
	l, err := (&ListenConfig{Client: srv}).Listen(context.Background(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	acc := async(func() *Conn {
		s, err := l.AcceptShunt()
		if err != nil {
			t.Errorf("accept: %v", err)
		}
		return s
	})
	c, err := (&Dialer{Client: cli}).DialContext(context.Background(), "tcp4", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s := await(t, acc, "Accept")
	defer s.Close()
	waitFor(t, "the fast path", func() bool { return c.Path().Fast && s.Path().Fast })
	if srv.kick.Load() == nil || cli.kick.Load() == nil {
		t.Fatal("kicks are off on a discovered port")
	}
	// Each way, the reader waiting first.
	for _, dir := range [][2]*Conn{{c, s}, {s, c}} {
		w, r := dir[0], dir[1]
		got := async(func() []byte {
			b := make([]byte, 5)
			if _, err := io.ReadFull(r, b); err != nil {
				t.Errorf("read: %v", err)
			}
			return b
		})
		if _, err := w.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if b := await(t, got, "the read"); string(b) != "hello" {
			t.Fatalf("read %q, want hello", b)
		}
	}
	if !c.Path().Fast || !s.Path().Fast {
		t.Fatalf("paths %s, %s after the exchange: want both on the rings", c.Path(), s.Path())
	}
}

// When other processes hold every port, connections stay on TCP with
// reason control-limit, the log says so once (not once a retry), and
// the client takes a port as soon as one is free.
func TestVMAllPortsBusy(t *testing.T) {
	h := guesttest.Start(t)
	vm := newFakeVM(t, h, h.Port(t), h.Port(t))
	var log logLines
	c := vmClient(t, vm, Options{Logf: log.logf})
	var busy atomic.Bool
	var tries atomic.Int64
	busy.Store(true)
	c.vm.open = func(ports []string) (*os.File, error) {
		tries.Add(1)
		if len(ports) != 2 {
			t.Errorf("ports %v: want both", ports)
		}
		if busy.Load() {
			return nil, fmt.Errorf("%w: %d ports", vserial.ErrAllBusy, len(ports))
		}
		return vserial.Open(ports)
	}
	conn, err := (&Dialer{Client: c}).Dial("tcp4", tcpListener(t).Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if p := conn.WaitPath(ctxWait(t)); p.String() != "tcp(control-limit)" {
		t.Fatalf("path %s with every port busy: want tcp(control-limit)", p)
	}
	waitFor(t, "a few retries", func() bool { return tries.Load() >= 3 })
	if n := log.count("in use by another process"); n != 1 {
		t.Fatalf("log %q: want one line saying every port is in use, got %d", log.lines, n)
	}
	busy.Store(false) // a port is free: the background retry takes it and offers the connection
	s := h.Accept(t)
	s.Expect(t, proto.Hello)
	s.WelcomeVM(t)
	for {
		m := s.Next(t)
		if m.Type == proto.Open {
			if m.ReqID != conn.req {
				t.Fatalf("OPEN %+v, want request %d", m, conn.req)
			}
			break
		}
		if !slices.Contains([]proto.Type{proto.Ping}, m.Type) {
			t.Fatalf("the library sent %s before OPEN", m.Type)
		}
	}
}
