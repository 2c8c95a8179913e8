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
	"github.com/shuntnet/shunt/hostd/broker"
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

	hostdBin   string
	metrics    string
	extra      string
	groupExtra string
	ran        bool // hostd came up once: the region file is its
	ownRig     bool // Start created the rig: Close destroys it
	guestCfg   map[int]string
	netns      bool
	logs       *os.File
	ownDir     bool
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
	Group    string // attributes of the trust group besides its region (quotas, pair regions); "" = roomy ones
	// GuestConfig holds more lines for guest i's block (1-based), e.g.
	// "ct_mark = 5".
	GuestConfig map[int]string
	// Netns gives each guest its network namespace in hostd.hcl (netns):
	// every process in the guest may then use its control socket,
	// whatever its uid and root directory, and this process (whose main
	// thread is outside every guest) may not: its Clients then serve no
	// guest. For tests of real programs run as packaged.
	Netns bool
	// Setup, if set, runs on the rig after it is created and before hostd
	// starts (more links, addresses, routes).
	Setup func(*nsrig.Rig) error
	Logf  func(string, ...any)
	// Rig, if set, is a rig already created (a host of an nsrig.Fabric):
	// Start uses it instead of making one (Name and Guests are then
	// ignored), and Close leaves it to its owner.
	Rig *nsrig.Rig
}

// Start creates the rig, starts hostd and makes the clients.
func Start(o Options) (_ *Stack, err error) {
	r := o.Rig
	if r == nil {
		if r, err = nsrig.New(o.Name, o.Guests); err != nil {
			return nil, err
		}
	}
	s := &Stack{Rig: r, Dir: o.Dir, hostdBin: o.HostdBin, metrics: o.Metrics, extra: o.Extra, groupExtra: o.Group, guestCfg: o.GuestConfig, netns: o.Netns, ownRig: o.Rig == nil}
	if s.Dir == "" {
		if s.Dir, err = os.MkdirTemp("", "shunt-"+r.Name); err != nil {
			return nil, err
		}
		s.ownDir = true
	}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if s.ownRig {
		if err := r.Create(); err != nil {
			return nil, fmt.Errorf("create rig: %w", err)
		}
	}
	if o.Setup != nil {
		if err := o.Setup(r); err != nil {
			return nil, fmt.Errorf("set the rig up: %w", err)
		}
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

// StateDir is hostd's state directory (its shadows of the regions).
func (s *Stack) StateDir() string { return filepath.Join(s.Dir, "state") }

// RegionDir is where hostd keeps the regions of guest pairs.
func (s *Stack) RegionDir() string { return filepath.Join(s.Dir, "regions") }

// WriteConfig (re)writes hostd's configuration with the given policy body.
func (s *Stack) WriteConfig(policy string) error {
	var b strings.Builder
	// Ownership as by default: hostd marks each guest's connections by
	// its interface (hostd/mark); the rig's firewall stamps no marks.
	fmt.Fprintf(&b, "log_level = \"debug\"\nadmin_socket = %q\nmetrics_address = %q\nconntrack_netns = %q\npairing_timeout = \"1s\"\nreattach_grace = \"3s\"\nrevoke_grace = \"3s\"\n",
		s.Admin, s.metrics, s.Rig.HostNSPath())
	fmt.Fprintf(&b, "state_dir = %q\nregion_dir = %q\n", s.StateDir(), s.RegionDir())
	// Roomy pair regions and quotas: tests hold many flows between two
	// guests. Options.Group replaces them (the hostile tests set their own).
	group := "  pair_region_size = \"64MiB\"\n  pair_slots = 1024\n  guest_ring_bytes = \"256MiB\"\n  guest_flows = 1024\n"
	if s.groupExtra != "" {
		group = s.groupExtra
	}
	fmt.Fprintf(&b, "trust_group \"t\" {\n  region = %q\n  region_size = \"32MiB\"\n  slots = 64\n%s}\n", s.RegionPath(), group)
	for _, g := range s.Rig.Guests {
		ns := ""
		if s.netns {
			ns = fmt.Sprintf("netns = %q", g.NSPath())
		}
		fmt.Fprintf(&b, "guest %q {\n  id = %d\n  group = \"t\"\n  control = %q\n  interface = %q\n  %s\n  %s\n}\n",
			g.Name, g.Index, s.Control(g), g.HostIf, ns, s.guestCfg[g.Index])
	}
	b.WriteString(s.extra)
	fmt.Fprintf(&b, "policy {\n%s\n}\n", policy)
	s.Config = filepath.Join(s.Dir, "hostd.hcl")
	return os.WriteFile(s.Config, []byte(b.String()), 0o600)
}

// SetExtra replaces the configuration's extra text (Options.Extra) for
// the next WriteConfig.
func (s *Stack) SetExtra(extra string) { s.extra = extra }

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
		if exited(cmd.Process.Pid) {
			err := cmd.Wait()
			s.Hostd = nil
			return fmt.Errorf("hostd exited (%v):\n%s", err, s.Log())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("hostd did not come up in 10s:\n%s", s.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.ran = true
	return nil
}

// exited reports whether child pid has exited and waits to be reaped.
func exited(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// pid (comm) state ...: the state follows the last ')'.
	i := strings.LastIndexByte(string(b), ')')
	return i < 0 || i+2 >= len(b) || b[i+2] == 'Z'
}

// StopHostd stops hostd with SIGTERM: it moves every connection to TCP
// (DOWN(shutdown)), waits up to 2 s for the guests to leave the rings, and
// exits; the connections go on over TCP.
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
	var err error
	if s.ownRig {
		err = s.Rig.Destroy()
	}
	if s.ran {
		os.Remove(s.RegionPath()) // hostd's; what was there before it ran is left alone
	}
	if s.logs != nil {
		s.logs.Close()
	}
	if s.ownDir {
		os.RemoveAll(s.Dir)
	}
	return err
}

// SetPolicy rewrites hostd's configuration with the given policy block
// body and reloads it (the admin reload, as `hostd reload`): connections
// on the rings that it forbids move to TCP (DOWN), connections on TCP it
// allows move to the rings. It returns how many moved to TCP.
func (s *Stack) SetPolicy(policy string) (int, error) {
	if err := s.WriteConfig(policy); err != nil {
		return 0, err
	}
	var rep map[string]int
	if err := admin.Call(s.Admin, admin.Request{Cmd: admin.CmdReload}, &rep); err != nil {
		return 0, fmt.Errorf("reload: %w", err)
	}
	return rep["downgraded"], nil
}

// PolicyTCP is a policy block body that keeps every connection on TCP;
// "" (the default policy) puts every allowed one on the rings. With
// SetPolicy, a test flips between them.
const PolicyTCP = `default = "tcp"`

// Conns returns hostd's connection records (`hostd flows`): per paired
// connection, its guests, tuple, path (rings, leaving, tcp) and reason,
// switch count and byte counters.
func (s *Stack) Conns() ([]broker.FlowInfo, error) {
	var fl []broker.FlowInfo
	if err := admin.Call(s.Admin, admin.Request{Cmd: admin.CmdFlows}, &fl); err != nil {
		return nil, fmt.Errorf("hostd flows: %w", err)
	}
	return fl, nil
}

// ConnOn returns the record of the connection whose active end's local
// port is port (Src ends in ":port"), and whether there is one.
func (s *Stack) ConnOn(port int) (broker.FlowInfo, bool, error) {
	fl, err := s.Conns()
	if err != nil {
		return broker.FlowInfo{}, false, err
	}
	for _, f := range fl {
		if strings.HasSuffix(f.Src, fmt.Sprintf(":%d", port)) || strings.HasSuffix(f.Dst, fmt.Sprintf(":%d", port)) {
			return f, true, nil
		}
	}
	return broker.FlowInfo{}, false, nil
}

// Downgrade moves a connection to TCP by its name in Conns (the record's
// or its ring pair's), as `hostd downgrade` does; it stays there until
// the next reload.
func (s *Stack) Downgrade(name string) error {
	return admin.Call(s.Admin, admin.Request{Cmd: admin.CmdDowngrade, Flow: name}, nil)
}
