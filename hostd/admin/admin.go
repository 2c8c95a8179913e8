package admin

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// The admin commands: what Request.Cmd names, the agent answers, and
// `hostd <command>` sends.
const (
	CmdStatus    = "status"    // a summary (agent.Status)
	CmdGuests    = "guests"    // the guests and their sessions ([]broker.GuestInfo)
	CmdFlows     = "flows"     // the connection records ([]broker.FlowInfo)
	CmdCounters  = "counters"  // Shunt's counters and gauges (map[string]float64)
	CmdReload    = "reload"    // re-read the policy ({"downgraded": n}; "revoked" too, the old name)
	CmdDowngrade = "downgrade" // move Request.Flow to TCP ({"downgraded": name})
	CmdRevoke    = "revoke"    // the old name of CmdDowngrade
	// CmdMigrateOut moves Request.Guest's connections to TCP and keeps
	// them there, and waits until none holds a ring pair (MigrateReply):
	// then its VM's ivshmem device may be unplugged and the VM migrated.
	// A VM with pair regions has them unplugged by hostd, which waits
	// for that too.
	CmdMigrateOut = "migrate-out"
	// CmdMigrateIn ends Request.Guest's migration: hostd serves its new
	// control socket (Request.Control), marks the connections coming in
	// by its new interface (Request.Interface) and plugs its pair regions
	// into the QEMU at its new QMP socket (Request.QMP), each if given,
	// and its connections move to the rings again as its library
	// reconnects (MigrateReply).
	CmdMigrateIn = "migrate-in"
	// CmdPeers lists the peer hosts' hostds ([]peers.Info; docs/crosshost.md).
	CmdPeers = "peers"
)

// Commands lists the admin commands, in the order `hostd help` shows them
// (`hostd guest add|remove|list` sends CmdGuestAdd, CmdGuestRemove and
// CmdGuestList).
var Commands = []string{CmdGuests, CmdFlows, CmdStatus, CmdCounters, CmdReload, CmdDowngrade, CmdRevoke, CmdMigrateOut, CmdMigrateIn, CmdPeers}

// Request is what the CLI sends.
type Request struct {
	Cmd  string `json:"cmd"`            // one of Commands
	Flow string `json:"flow,omitempty"` // for CmdDowngrade: a connection's or its ring pair's name
	// For CmdMigrateOut and CmdMigrateIn: the guest's name; for
	// CmdMigrateIn, optionally its new control socket (the base path, as
	// the configuration's control), its new host-side interface and its
	// new QMP socket (as the configuration's qmp).
	Guest     string `json:"guest,omitempty"`
	Control   string `json:"control,omitempty"`
	Interface string `json:"interface,omitempty"`
	QMP       string `json:"qmp,omitempty"`
	// For CmdGuestAdd: the guest (Guest names the one to remove).
	Spec *GuestSpec `json:"spec,omitempty"`
}

// MigrateReply answers CmdMigrateOut and CmdMigrateIn.
type MigrateReply struct {
	Guest string `json:"guest"`
	Moved int    `json:"moved"`          // connections moved to TCP (out) or to the rings at once (in)
	Held  int    `json:"held"`           // out: ring pairs its connections still hold (0: ready to unplug)
	Took  string `json:"took,omitempty"` // out: how long the connections took to leave the rings (and its pair regions the VMs)
	// out, a VM with pair regions: how many hostd unplugged, and how many
	// are still plugged (0: ready to migrate).
	Unplugged int `json:"unplugged,omitempty"`
	Plugged   int `json:"plugged,omitempty"`
}

// Deadline bounds a request of command cmd: 10 s, and 30 s for
// CmdMigrateOut, which waits for the guest's connections to leave the
// rings and for its pair regions' unplugs (the guests' ACPI ejects).
func Deadline(cmd string) time.Duration {
	if cmd == CmdMigrateOut {
		return 30 * time.Second
	}
	return 10 * time.Second
}

// Reply is what hostd answers: Error, or Data (command-specific JSON).
type Reply struct {
	Error string          `json:"error,omitempty"`
	Data  json.RawMessage `json:"data,omitempty"`
}

// Handler answers one request.
type Handler func(Request) (any, error)

// Server serves the admin socket, one goroutine per request, each bounded
// by its Deadline. Close stops it and waits.
type Server struct {
	l  net.Listener
	h  Handler
	wg sync.WaitGroup
}

// Listen serves h on a Unix socket at path (mode 0600), replacing a stale
// socket there. h may be called from several goroutines at once.
func Listen(path string, h Handler) (*Server, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("admin socket dir: %w", err)
	}
	_ = os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	s := &Server{l: l, h: h}
	s.wg.Add(1)
	go s.serve()
	return s, nil
}

func (s *Server) serve() {
	defer s.wg.Done()
	var delay time.Duration
	for {
		c, err := s.l.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// Out of descriptors (EMFILE, a guest's session flood can
			// cause it): wait and retry, so the admin socket outlives it.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			time.Sleep(delay)
			continue
		}
		delay = 0
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			var req Request
			var rep Reply
			if err := json.NewDecoder(c).Decode(&req); err != nil {
				rep.Error = "bad request: " + err.Error()
			} else {
				_ = c.SetDeadline(time.Now().Add(Deadline(req.Cmd)))
				if data, err := s.h(req); err != nil {
					rep.Error = err.Error()
				} else if rep.Data, err = json.Marshal(data); err != nil {
					rep.Error = err.Error()
				}
			}
			_ = json.NewEncoder(c).Encode(rep)
		}()
	}
}

// Close stops serving and waits for requests in flight.
func (s *Server) Close() {
	s.l.Close()
	s.wg.Wait()
}

// Call sends one request to the admin socket at path and decodes the reply
// data into out.
func Call(path string, req Request, out any) error {
	c, err := net.DialTimeout("unix", path, 5*time.Second)
	if err != nil {
		return fmt.Errorf("reach hostd at %s: %w (is hostd running? see: systemctl status shunt-hostd)", path, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(Deadline(req.Cmd) + 5*time.Second))
	if err := json.NewEncoder(c).Encode(req); err != nil {
		return fmt.Errorf("send to hostd: %w", err)
	}
	var rep Reply
	if err := json.NewDecoder(c).Decode(&rep); err != nil {
		return fmt.Errorf("read hostd's reply: %w", err)
	}
	if rep.Error != "" {
		return errors.New(rep.Error)
	}
	if out != nil {
		return json.Unmarshal(rep.Data, out)
	}
	return nil
}
