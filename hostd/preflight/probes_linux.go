//go:build linux

package preflight

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/witness"
	"github.com/shuntnet/shunt/internal/nsexec"
)

// conntrackProbe dials ctnetlink as hostd does and looks up a tuple: a
// kernel with conntrack built in has no module to find, so only an answer
// shows that it works.
func conntrackProbe(ns string) error {
	ct, err := ctrack.Dial(ns)
	if err != nil {
		return err
	}
	defer ct.Close()
	lo := netip.MustParseAddrPort("127.0.0.1:9")
	if _, err := ct.Lookup(ctrack.Tuple{Src: lo, Dst: lo}); err != nil && !errors.Is(err, ctrack.ErrNotFound) {
		return err
	}
	return nil
}

// sysctlProbe reads /proc/sys; a net.* sysctl is read in the namespace of
// the thread that opens it.
func sysctlProbe(ns, name string) (string, error) {
	path := filepath.Join("/proc/sys", strings.ReplaceAll(name, ".", "/"))
	var b []byte
	read := func() (err error) {
		b, err = os.ReadFile(path)
		return err
	}
	var err error
	if ns == "" {
		err = read()
	} else {
		err = nsexec.In(ns, read)
	}
	return strings.TrimSpace(string(b)), err
}

// witnessProbe loads the witness (its map and program) and asks the kernel
// to attach a trivial program by TCX to an interface that cannot exist:
// ENODEV means TCX is there.
func witnessProbe() error {
	w, err := witness.Load()
	if err != nil {
		return err
	}
	w.Close()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "shunt_probe", Type: ebpf.SchedCLS, License: "Dual BSD/GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()}})
	if err != nil {
		return fmt.Errorf("load a tc program: %w", err)
	}
	defer prog.Close()
	l, err := link.AttachTCX(link.TCXOptions{Interface: math.MaxUint32, Program: prog, Attach: ebpf.AttachTCXIngress})
	switch {
	case err == nil:
		l.Close()
		return nil
	case errors.Is(err, unix.ENODEV):
		return nil
	case errors.Is(err, ebpf.ErrNotSupported):
		return fmt.Errorf("TCX: %w (needs Linux 6.6)", err)
	}
	return fmt.Errorf("TCX: %w", err)
}

func interfaceProbe(ns, name string) error {
	var h *netlink.Handle
	var err error
	if ns == "" {
		h, err = netlink.NewHandle(unix.NETLINK_ROUTE) // not XFRM's too (hostd/agent's netlinkHandle)
	} else {
		var n netns.NsHandle
		if n, err = netns.GetFromPath(ns); err != nil {
			return fmt.Errorf("open netns %s: %w", ns, err)
		}
		defer n.Close()
		h, err = netlink.NewHandleAt(n, unix.NETLINK_ROUTE)
	}
	if err != nil {
		return err
	}
	defer h.Close()
	_, err = h.LinkByName(name)
	return err
}

func statfsProbe(dir string) (FS, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return FS{}, &os.PathError{Op: "stat", Path: dir, Err: err}
	}
	var s unix.Statfs_t
	if err := unix.Statfs(dir, &s); err != nil {
		return FS{}, &os.PathError{Op: "statfs", Path: dir, Err: err}
	}
	return FS{Dev: st.Dev, Avail: int64(s.Bavail) * s.Bsize, Size: int64(s.Blocks) * s.Bsize, Tmpfs: s.Type == unix.TMPFS_MAGIC}, nil
}
