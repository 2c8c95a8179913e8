package preflight

import (
	"context"
	"net"
	"os"
	"os/exec"
	"os/user"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/relay"
)

// Probes are how the checks look at the host, beyond reading files: each
// is a function field so that a test can fake one failure at a time. Files
// and directories (region files, socket directories) are read directly,
// with Lstat. Host returns the real probes.
type Probes struct {
	// Euid is the user the check runs as, whom files are checked against
	// (hostd runs as root).
	Euid func() int
	// Conntrack opens a ctnetlink socket in the network namespace at
	// netns ("": the caller's own) and makes one query on it.
	Conntrack func(netns string) error
	// Sysctl reads a sysctl by its dotted name in netns.
	Sysctl func(netns, name string) (string, error)
	// LookPath finds a program in PATH.
	LookPath func(file string) (string, error)
	// Command runs a program and returns its combined output.
	Command func(ctx context.Context, name string, args ...string) ([]byte, error)
	// Witness loads an eBPF program of the witness's kind and checks that
	// the kernel attaches programs by TCX.
	Witness func() error
	// Nftables installs and deletes, in one batch, a table like hostd's in
	// netns, and returns the rules per chain of hostd's own table there
	// (-1: none).
	Nftables func(netns string) (int, error)
	// Interface reports whether a network interface exists in netns.
	Interface func(netns, name string) error
	// Statfs describes the file system that holds dir.
	Statfs func(dir string) (FS, error)
	// Writable reports whether this process may create files in dir.
	Writable func(dir string) error
	// RDMA lists the host's RDMA devices (relay.RDMADevices).
	RDMA func() ([]relay.RDMADevice, error)
	// LookupGroup looks a group up by name.
	LookupGroup func(name string) error
	// DialUnix connects to a Unix stream socket and hangs up.
	DialUnix func(ctx context.Context, path string) error
	// DialPacket connects to a Unix SOCK_SEQPACKET socket (shunt-vsockd's)
	// and hangs up.
	DialPacket func(ctx context.Context, path string) error
	// Libvirt connects to the libvirtd at socket, opens uri and hangs up.
	Libvirt func(ctx context.Context, socket, uri string) error
	// Listen binds a TCP address and closes the listener again.
	Listen func(addr string) error
}

// FS describes a file system.
type FS struct {
	Dev   uint64 // st_dev, to add up the regions that share a file system
	Avail int64  // bytes free for unprivileged users
	Size  int64  // bytes in all
	Tmpfs bool
}

// Host returns the probes of the real host.
func Host() Probes {
	return Probes{
		Euid:      os.Geteuid,
		Conntrack: conntrackProbe,
		Sysctl:    sysctlProbe,
		LookPath:  exec.LookPath,
		Command: func(ctx context.Context, name string, args ...string) ([]byte, error) {
			return exec.CommandContext(ctx, name, args...).CombinedOutput()
		},
		Witness:     witnessProbe,
		Nftables:    mark.Probe,
		Interface:   interfaceProbe,
		Statfs:      statfsProbe,
		Writable:    func(dir string) error { return unix.Access(dir, unix.W_OK) },
		LookupGroup: func(name string) error { _, err := user.LookupGroup(name); return err },
		RDMA:        func() ([]relay.RDMADevice, error) { return relay.RDMADevices("") },
		DialUnix: func(ctx context.Context, path string) error {
			c, err := (&net.Dialer{}).DialContext(ctx, "unix", path)
			if err == nil {
				c.Close()
			}
			return err
		},
		DialPacket: func(ctx context.Context, path string) error {
			c, err := (&net.Dialer{}).DialContext(ctx, "unixpacket", path)
			if err == nil {
				c.Close()
			}
			return err
		},
		Libvirt: func(ctx context.Context, socket, uri string) error {
			s, err := virt.Dial(socket, uri)(ctx)
			if err == nil {
				s.Close()
			}
			return err
		},
		Listen: func(addr string) error {
			l, err := net.Listen("tcp", addr)
			if err == nil {
				l.Close()
			}
			return err
		},
	}
}

// probeTimeout bounds each probe that waits on another process.
const probeTimeout = 3 * time.Second
