//go:build linux

// Package stack runs a whole Shunt host for tests, the demo and benchmarks:
// a namespace rig (integration/nsrig), the real hostd binary configured for
// it, and a guestlib client per guest. Close (or a failed Start) removes
// everything: hostd, namespaces, sockets and the region file.
package stack

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/integration/nsrig"
)

// Stack is a running rig with hostd. It is for one test goroutine;
// Listen and Dial may be called concurrently.
type Stack struct {
	Rig     *nsrig.Rig
	Dir     string // config, sockets and hostd.log
	Config  string
	Admin   string
	Hostd   *exec.Cmd // nil while stopped
	Clients []*guestlib.Client

	hostdBin string
	metrics  string
	extra    string
	logs     *os.File
	ownDir   bool
}

// Options describe a stack.
type Options struct {
	Name     string // rig name, 1-8 characters
	Guests   int
	HostdBin string // path of the hostd binary
	Dir      string // "" = a new temporary directory, removed by Close
	Policy   string // body of the policy block
	Metrics  string // hostd's metrics_address; "" = none
	Extra    string // more configuration (guest blocks for VMs)
	Logf     func(string, ...any)
}

// Start creates the rig, starts hostd and makes the clients.
func Start(o Options) (_ *Stack, err error) {
	r, err := nsrig.New(o.Name, o.Guests)
	if err != nil {
		return nil, err
	}
	s := &Stack{Rig: r, Dir: o.Dir, hostdBin: o.HostdBin, metrics: o.Metrics, extra: o.Extra}
	if s.Dir == "" {
		if s.Dir, err = os.MkdirTemp("", "shunt-"+o.Name); err != nil {
			return nil, err
		}
		s.ownDir = true
	}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if err := r.Create(); err != nil {
		return nil, fmt.Errorf("create rig: %w", err)
	}
	s.Admin = filepath.Join(s.Dir, "admin.sock")
	if err := s.WriteConfig(o.Policy); err != nil {
		return nil, err
	}
	if err := s.StartHostd(); err != nil {
		return nil, err
	}
	for _, g := range r.Guests {
		c, err := guestlib.NewClient(guestlib.Options{Control: s.Control(g), Logf: o.Logf})
		if err != nil {
			return nil, err
		}
		s.Clients = append(s.Clients, c)
	}
	return s, nil
}

// Control is a guest's control socket.
func (s *Stack) Control(g *nsrig.Guest) string { return filepath.Join(s.Dir, g.Name+".sock") }

// RegionPath is the trust group's region file.
func (s *Stack) RegionPath() string { return "/dev/shm/shunt-" + s.Rig.Name }

// WriteConfig (re)writes hostd's configuration with the given policy body.
func (s *Stack) WriteConfig(policy string) error {
	var b strings.Builder
	fmt.Fprintf(&b, "log_level = \"debug\"\nadmin_socket = %q\nmetrics_address = %q\nconntrack_netns = %q\npairing_timeout = \"1s\"\nreattach_grace = \"3s\"\nwitness = true\n",
		s.Admin, s.metrics, s.Rig.HostNSPath())
	fmt.Fprintf(&b, "trust_group \"t\" {\n  region = %q\n  region_size = \"32MiB\"\n  slots = 64\n}\n", s.RegionPath())
	for _, g := range s.Rig.Guests {
		fmt.Fprintf(&b, "guest %q {\n  id = %d\n  group = \"t\"\n  control = %q\n  interface = %q\n  ct_mark = %d\n}\n",
			g.Name, g.Index, s.Control(g), g.HostIf, g.Index)
	}
	b.WriteString(s.extra)
	fmt.Fprintf(&b, "policy {\n%s\n}\n", policy)
	s.Config = filepath.Join(s.Dir, "hostd.hcl")
	return os.WriteFile(s.Config, []byte(b.String()), 0o600)
}

// StartHostd starts hostd and waits until its admin socket answers.
func (s *Stack) StartHostd() error {
	if s.logs == nil {
		f, err := os.Create(filepath.Join(s.Dir, "hostd.log"))
		if err != nil {
			return err
		}
		s.logs = f
	}
	cmd := exec.Command(s.hostdBin, "agent", "-config", s.Config)
	cmd.Stdout, cmd.Stderr = s.logs, s.logs
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start hostd: %w", err)
	}
	s.Hostd = cmd
	deadline := time.Now().Add(10 * time.Second)
	for admin.Call(s.Admin, admin.Request{Cmd: "status"}, nil) != nil {
		if time.Now().After(deadline) {
			return fmt.Errorf("hostd did not come up in 10s:\n%s", s.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// StopHostd stops hostd with SIGTERM (flows keep running).
func (s *Stack) StopHostd() {
	if s.Hostd == nil {
		return
	}
	s.Hostd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { s.Hostd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		s.Hostd.Process.Kill()
		<-done
	}
	s.Hostd = nil
}

// KillHostd kills hostd with SIGKILL.
func (s *Stack) KillHostd() {
	if s.Hostd == nil {
		return
	}
	s.Hostd.Process.Kill()
	s.Hostd.Wait()
	s.Hostd = nil
}

// Log returns hostd's log so far.
func (s *Stack) Log() string {
	if s.logs == nil {
		return ""
	}
	b, _ := os.ReadFile(s.logs.Name())
	return string(b)
}

// Listen listens on port in guest i (1-based) through guestlib.
func (s *Stack) Listen(i, port int) (*guestlib.Listener, error) {
	g := s.Rig.Guests[i-1]
	var l *guestlib.Listener
	err := nsrig.In(g.NSPath(), func() error {
		lc := guestlib.ListenConfig{Client: s.Clients[i-1]}
		var err error
		l, err = lc.Listen(context.Background(), "tcp4", fmt.Sprintf("%s:%d", g.Addr, port))
		return err
	})
	return l, err
}

// Dial dials addr from guest i through guestlib.
func (s *Stack) Dial(ctx context.Context, i int, addr string) (*guestlib.Conn, error) {
	var c *guestlib.Conn
	err := nsrig.In(s.Rig.Guests[i-1].NSPath(), func() error {
		d := guestlib.Dialer{Client: s.Clients[i-1]}
		var err error
		c, err = d.DialContext(ctx, "tcp4", addr)
		return err
	})
	return c, err
}

// Close stops hostd and removes the rig, the region file and the directory.
func (s *Stack) Close() error {
	for _, c := range s.Clients {
		c.Close()
	}
	s.StopHostd()
	err := s.Rig.Destroy()
	os.Remove(s.RegionPath())
	if s.logs != nil {
		s.logs.Close()
	}
	if s.ownDir {
		os.RemoveAll(s.Dir)
	}
	return err
}
