package vsockhost

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/go-hclog"
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/vhost/vhostuser"
	"github.com/shuntnet/shunt/vhost/vsock"
)

// Spec is one VM's device: whose it is, where QEMU connects, its CID;
// or, for a hypervisor that implements vsock itself (Firecracker, Cloud
// Hypervisor), its hybrid vsock socket.
type Spec struct {
	Guest  string // the guest's name, for logs and metrics
	ID     uint32 // the guest's id: the only key the device is handed out by
	Socket string // the vhost-user socket (QEMU -chardev socket,path=)
	CID    uint32
	// Hybrid, instead of Socket and CID, is the hypervisor's hybrid vsock
	// socket (Firecracker's uds_path, Cloud Hypervisor's socket): the
	// guest's connections to the host's port P arrive at the Unix socket
	// Hybrid_P, which hostd listens on (hybrid.go).
	Hybrid string
	// Daemon: the device is shunt-vsockd's (hostd/vsockd), which forwards
	// the guest's connections to the host's port P to Hybrid_P as a
	// hybrid vsock does; Hybrid is then the device's own socket, CID its
	// CID, and whether QEMU is served is the daemon's to say (UseDaemon).
	Daemon bool
	// Frontend, if set, is called when a front-end starts and stops being
	// served (shunt-vsockd tells hostd so). Not for hybrid devices.
	Frontend func(connected bool)
	// Restart, if set, says what brings back a device whose socket
	// failed, for the log ("hostd restarts" if empty).
	Restart string
}

// Daemon is shunt-vsockd as hostd sees it (hostd/vsockd.Client): whether
// a device's QEMU is served now, and the devices' counters.
type Daemon interface {
	Served(guest uint32) bool
	Stats() []Stat
}

// Room serves the devices. Its methods are safe for concurrent use.
type Room struct {
	log    hclog.Logger
	devs   map[uint32]*device // by guest id
	wg     sync.WaitGroup
	daemon atomic.Pointer[Daemon] // set by UseDaemon, for Daemon specs
}

// UseDaemon has the room ask d about the devices of its Daemon specs.
// Until then they count as not served.
func (r *Room) UseDaemon(d Daemon) { r.daemon.Store(&d) }

// device is one VM's vsock device and the socket its QEMU connects to.
type device struct {
	spec Spec
	dev  *vsock.Device
	l    *net.UnixListener
	log  hclog.Logger

	mu     sync.Mutex
	sess   *net.UnixConn // the front-end being served; nil between QEMUs
	closed bool

	serving sync.WaitGroup // serve goroutines

	st            stretches // the flows' stretches on this device (stretch.go)
	stopStretches func()    // set by ServeStretches

	sessions atomic.Uint64 // front-ends served
	refused  atomic.Uint64 // front-ends refused while another was served
}

// Start makes every device and listens on its socket (mode 0600: QEMU
// runs as root; a stale socket at the path is replaced, anything else
// there is an error). On error nothing stays open.
func Start(log hclog.Logger, specs []Spec) (_ *Room, err error) {
	r := &Room{log: log, devs: map[uint32]*device{}}
	defer func() {
		if err != nil {
			r.Close()
		}
	}()
	for _, s := range specs {
		if _, dup := r.devs[s.ID]; dup {
			return nil, fmt.Errorf("guest %s: a second vsock device", s.Guest)
		}
		if s.Hybrid != "" {
			r.devs[s.ID] = &device{spec: s, log: log.With("guest", s.Guest, "hybrid", s.Hybrid)}
			continue
		}
		d := &device{spec: s, log: log.With("guest", s.Guest, "cid", s.CID)}
		lf := func(format string, args ...any) { d.log.Warn(fmt.Sprintf(format, args...)) }
		if d.dev, err = vsock.New(uint64(s.CID), lf); err != nil {
			return nil, fmt.Errorf("guest %s: %w", s.Guest, err)
		}
		if d.l, err = listen(s.Socket); err != nil {
			return nil, fmt.Errorf("guest %s: vsock socket: %w", s.Guest, err)
		}
		r.devs[s.ID] = d
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			d.accept()
		}()
		d.log.Info("serving vhost-user-vsock", "socket", s.Socket)
	}
	return r, nil
}

// listen listens on path, made mode 0600, replacing a stale socket.
func listen(path string) (*net.UnixListener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if st, err := os.Lstat(path); err == nil {
		if st.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%s exists and is not a socket: remove it or choose another path", path)
		}
		_ = os.Remove(path)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(true)
	if err := chmodSocket(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// chmodSocket sets the mode of the socket at path without following a
// symlink: a hybrid socket's directory may be a jail's, writable by the
// hypervisor's user, who could swap the new socket for a link to any
// file between bind and chmod, and have hostd (root) chmod that file.
func chmodSocket(path string, mode uint32) error {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("chmod %s: %w", path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("chmod %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return fmt.Errorf("chmod %s: not a socket any more (replaced after bind)", path)
	}
	// The magic link of an O_PATH descriptor names the inode itself.
	return os.Chmod(fmt.Sprintf("/proc/self/fd/%d", fd), os.FileMode(mode))
}

// accept serves QEMUs in turn: one front-end at a time (a device has one
// set of queues), so a second connection while one is served is closed
// at once. It returns when the listener closes.
func (d *device) accept() {
	for {
		c, err := d.l.AcceptUnix()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				until := d.spec.Restart
				if until == "" {
					until = "hostd restarts"
				}
				d.log.Error("vsock socket failed: no QEMU can connect to the device until "+until, "error", err)
			}
			return
		}
		d.mu.Lock()
		if d.closed || d.sess != nil {
			d.mu.Unlock()
			d.refused.Add(1)
			d.log.Warn("a second vhost-user front-end refused: the device serves one at a time")
			c.Close()
			continue
		}
		d.sess = c
		d.serving.Add(1)
		if d.spec.Frontend != nil {
			d.spec.Frontend(true) // under mu: the calls keep the order of the changes
		}
		d.mu.Unlock()
		d.sessions.Add(1)
		d.log.Info("vhost-user front-end connected")
		go d.serve(c)
	}
}

// serve serves one front-end until it goes (the VM stopped): its vsock
// connections end with vsock.ErrGone, the device waits for the next.
func (d *device) serve(c *net.UnixConn) {
	defer d.serving.Done()
	lf := func(format string, args ...any) { d.log.Warn(fmt.Sprintf(format, args...)) }
	err := vhostuser.Serve(c, d.dev, lf)
	d.mu.Lock()
	d.sess = nil
	if d.spec.Frontend != nil {
		d.spec.Frontend(false)
	}
	d.mu.Unlock()
	if err != nil {
		d.log.Warn("vhost-user front-end ended", "error", err)
		return
	}
	d.log.Info("vhost-user front-end gone")
}

// Device returns the vsock device of the guest with id guest, or nil:
// the only way to a device, so a VM's connections reach only what hostd
// binds to that VM.
func (r *Room) Device(guest uint32) *vsock.Device {
	if r == nil {
		return nil
	}
	if d := r.devs[guest]; d != nil {
		return d.dev
	}
	return nil
}

// Close stops every device: the sockets go, and each VM being served
// loses its vsock device for good (QEMU 7.2 cannot reconnect it; see
// docs/vsock.md, "hostd restarts").
func (r *Room) Close() {
	for _, d := range r.devs {
		d.mu.Lock()
		d.closed = true
		s := d.sess
		d.mu.Unlock()
		if d.l != nil {
			d.l.Close()
		}
		if s != nil {
			s.Close()
		}
	}
	r.wg.Wait()
	for _, d := range r.devs {
		d.st.mu.Lock()
		d.st.closed = true
		stop := d.stopStretches
		d.st.mu.Unlock()
		if stop != nil {
			stop()
		}
		d.serving.Wait()
	}
}

// Stat is one device's state and counters, for `hostd status` and the
// metrics.
type Stat struct {
	Guest       string `json:"guest"`
	CID         uint32 `json:"cid"`
	Socket      string `json:"socket,omitempty"`
	Hybrid      string `json:"hybrid,omitempty"` // a hybrid vsock socket's path (no device of hostd's)
	Daemon      bool   `json:"vsockd,omitempty"` // the device is shunt-vsockd's (its counters since it started)
	Connected   bool   `json:"connected"`        // a front-end (QEMU) is being served
	Sessions    uint64 `json:"sessions"`         // front-ends served since hostd started
	Refused     uint64 `json:"refused_frontends"`
	Conns       int64  `json:"conns"`
	Accepted    uint64 `json:"accepted"`
	Dialed      uint64 `json:"dialed"`
	RefusedConn uint64 `json:"refused_conns"`
	Resets      uint64 `json:"resets"`
	BadPackets  uint64 `json:"bad_packets"`
	RxBytes     uint64 `json:"rx_bytes"`
	TxBytes     uint64 `json:"tx_bytes"`
	QueueBroken uint64 `json:"queue_broken"`
	Stretches   int    `json:"stretches"`         // flows' stretches bridged now
	Bridged     uint64 `json:"stretches_total"`   // stretches bridged since hostd started
	BadHellos   uint64 `json:"stretches_refused"` // streams that named no flow of the VM's
}

// Stats returns every device's Stat, by guest name.
func (r *Room) Stats() []Stat {
	if r == nil {
		return nil
	}
	out := make([]Stat, 0, len(r.devs))
	var remote map[string]Stat // the daemon's devices, by guest name
	for _, d := range r.devs {
		if !d.spec.Daemon {
			continue
		}
		if remote == nil {
			remote = map[string]Stat{}
			if dp := r.daemon.Load(); dp != nil {
				for _, s := range (*dp).Stats() {
					remote[s.Guest] = s
				}
			}
		}
	}
	for _, d := range r.devs {
		d.mu.Lock()
		conn := d.sess != nil
		d.mu.Unlock()
		d.st.mu.Lock()
		open, served, bad := len(d.st.open), d.st.served, d.st.bad
		d.st.mu.Unlock()
		if d.spec.Daemon { // shunt-vsockd's device: its counters the daemon's
			s, ok := remote[d.spec.Guest]
			if !ok {
				s = Stat{Guest: d.spec.Guest, CID: d.spec.CID, Socket: d.spec.Hybrid}
			}
			s.Daemon, s.Stretches, s.Bridged, s.BadHellos = true, open, served, bad
			out = append(out, s)
			continue
		}
		if d.dev == nil { // hybrid: the hypervisor's device, its counters its own
			out = append(out, Stat{Guest: d.spec.Guest, Hybrid: d.spec.Hybrid, Stretches: open, Bridged: served, BadHellos: bad})
			continue
		}
		st := d.dev.Stats()
		out = append(out, Stat{Guest: d.spec.Guest, CID: d.spec.CID, Socket: d.spec.Socket, Connected: conn,
			Sessions: d.sessions.Load(), Refused: d.refused.Load(), Conns: st.Conns.Load(), Accepted: st.Accepted.Load(),
			Dialed: st.Dialed.Load(), RefusedConn: st.Refused.Load(), Resets: st.Resets.Load(), BadPackets: st.BadPackets.Load(),
			RxBytes: st.RxBytes.Load(), TxBytes: st.TxBytes.Load(), QueueBroken: st.QueueBroken.Load(),
			Stretches: open, Bridged: served, BadHellos: bad})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Guest < out[j].Guest })
	return out
}
