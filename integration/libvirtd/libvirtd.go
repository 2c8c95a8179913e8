//go:build linux

// Package libvirtd runs a private libvirtd for tests: virtlogd first, then
// libvirtd, both children of the test, each in its own mount namespace in
// which the test's directories are bound over /etc/libvirt, /run/libvirt,
// /var/lib/libvirt, /var/cache/libvirt and /var/log/libvirt. So the host's
// libvirt configuration and state are neither read nor touched, QEMU runs
// unprivileged as Debian's default QEMUUser:QEMUGroup (libvirt-qemu:kvm),
// with libvirt's default DAC labelling (dynamic_ownership) but without
// cgroups, namespaces or a MAC driver, and the daemon's socket is an
// ordinary path under the test's directory. Processes are started in a
// given network namespace, so the domains' taps appear there.
package libvirtd

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/internal/nsexec"
)

// What the daemons find in their /etc/libvirt.
const (
	libvirtdConf = `unix_sock_rw_perms = "0700"
auth_unix_ro = "none"
auth_unix_rw = "none"
log_outputs = "3:stderr"
`
	qemuConf = `user = "` + QEMUUser + `"
group = "` + QEMUGroup + `"
security_driver = "none"
cgroup_controllers = [ ]
namespaces = [ ]
`
	virtlogdConf = `log_outputs = "3:stderr"
`
)

// QEMUUser and QEMUGroup are who QEMU runs as: Debian's libvirt default.
const (
	QEMUUser  = "libvirt-qemu"
	QEMUGroup = "kvm"
)

var binds = []struct{ sub, target string }{
	{"etc", "/etc/libvirt"},
	{"run", "/run/libvirt"},
	{"lib", "/var/lib/libvirt"},
	{"cache", "/var/cache/libvirt"},
	{"log", "/var/log/libvirt"},
}

// Daemon is a running private libvirtd. Not safe for concurrent use.
type Daemon struct {
	Dir    string // the daemons' directories and logs
	Socket string // libvirtd's read-write socket
	NetNS  string

	virtlogd, libvirtd *exec.Cmd
	logs               *os.File
}

// Start starts virtlogd and libvirtd under dir, in the network namespace
// at netns, and waits until libvirtd answers. Close stops both and kills
// any QEMU they left.
func Start(dir, netns string) (_ *Daemon, err error) {
	d := &Daemon{Dir: dir, Socket: filepath.Join(dir, "run", "libvirt-sock"), NetNS: netns}
	defer func() {
		if err != nil {
			d.Close()
		}
	}()
	// QEMU (QEMUUser) reaches its files under /var/lib/libvirt and
	// /run/libvirt, and the consoles in dir: traversable, not listable.
	if err := os.Chmod(dir, 0o711); err != nil {
		return nil, err
	}
	for _, b := range binds {
		sub := filepath.Join(dir, b.sub)
		if err := os.MkdirAll(sub, 0o700); err != nil {
			return nil, err
		}
		if b.sub != "etc" {
			if err := os.Chmod(sub, 0o755); err != nil {
				return nil, err
			}
		}
		// The mount points themselves: present once libvirt is installed,
		// except /run/libvirt before libvirtd ever ran (a tmpfs).
		if err := os.MkdirAll(b.target, 0o755); err != nil {
			return nil, fmt.Errorf("mount point %s: %w", b.target, err)
		}
	}
	for name, body := range map[string]string{"libvirtd.conf": libvirtdConf, "qemu.conf": qemuConf, "virtlogd.conf": virtlogdConf} {
		if err := os.WriteFile(filepath.Join(dir, "etc", name), []byte(body), 0o600); err != nil {
			return nil, err
		}
	}
	if d.logs, err = os.Create(filepath.Join(dir, "daemons.log")); err != nil {
		return nil, err
	}
	if d.virtlogd, err = d.start("virtlogd", "-f", "/etc/libvirt/virtlogd.conf"); err != nil {
		return nil, err
	}
	if err := waitSocket(filepath.Join(dir, "run", "virtlogd-sock"), 10*time.Second); err != nil {
		return nil, fmt.Errorf("virtlogd: %w\n%s", err, d.Log())
	}
	if err := d.StartLibvirtd(); err != nil {
		return nil, err
	}
	return d, nil
}

// start runs a daemon in a private mount namespace with the binds, in the
// network namespace.
func (d *Daemon) start(bin string, args ...string) (*exec.Cmd, error) {
	var script strings.Builder
	script.WriteString("set -e\n")
	for _, b := range binds {
		fmt.Fprintf(&script, "mount --bind %q %q\n", filepath.Join(d.Dir, b.sub), b.target)
	}
	script.WriteString(`exec "$@"` + "\n")
	cmd := exec.Command("sh", append([]string{"-c", script.String(), bin, bin}, args...)...)
	cmd.Stdout, cmd.Stderr = d.logs, d.logs
	// Go makes the new mount namespace's mounts private before exec, so
	// the binds stay inside it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	if err := nsexec.In(d.NetNS, cmd.Start); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	return cmd, nil
}

// StartLibvirtd starts libvirtd (again, after StopLibvirtd) and waits
// until it answers on its socket.
func (d *Daemon) StartLibvirtd() error {
	var err error
	if d.libvirtd, err = d.start("libvirtd", "-f", "/etc/libvirt/libvirtd.conf"); err != nil {
		return err
	}
	if err := waitSocket(d.Socket, 20*time.Second); err != nil {
		return fmt.Errorf("libvirtd: %w\n%s", err, d.Log())
	}
	return nil
}

// StopLibvirtd kills libvirtd as a crash would; its domains keep running.
func (d *Daemon) StopLibvirtd() {
	stop(d.libvirtd, syscall.SIGKILL)
	d.libvirtd = nil
	_ = os.Remove(d.Socket)
}

// QEMUPid returns the pid of a running domain's QEMU, from libvirt's pid
// file.
func (d *Daemon) QEMUPid(domain string) (int, error) {
	b, err := os.ReadFile(filepath.Join(d.Dir, "run", "qemu", domain+".pid"))
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// Virsh runs virsh against this libvirtd and returns its output.
func (d *Daemon) Virsh(args ...string) (string, error) {
	out, err := exec.Command("virsh", append([]string{"-c", d.URI()}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("virsh %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// URI is the connection URI for virsh.
func (d *Daemon) URI() string { return "qemu:///system?socket=" + d.Socket }

// Log returns what the daemons printed.
func (d *Daemon) Log() string {
	b, _ := os.ReadFile(filepath.Join(d.Dir, "daemons.log"))
	return string(b)
}

// Close destroys the domains, stops both daemons and kills any QEMU left
// behind (a domain's QEMU outlives libvirtd).
func (d *Daemon) Close() {
	if d.libvirtd != nil {
		if out, err := d.Virsh("list", "--name"); err == nil {
			for _, n := range strings.Fields(out) {
				_, _ = d.Virsh("destroy", n)
			}
		}
		stop(d.libvirtd, syscall.SIGTERM)
	}
	pids, _ := filepath.Glob(filepath.Join(d.Dir, "run", "qemu", "*.pid"))
	for _, p := range pids {
		name := strings.TrimSuffix(filepath.Base(p), ".pid")
		if pid, err := d.QEMUPid(name); err == nil && isQEMU(pid) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	stop(d.virtlogd, syscall.SIGTERM)
	if d.logs != nil {
		d.logs.Close()
	}
}

func isQEMU(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return err == nil && strings.HasPrefix(string(b), "qemu")
}

func stop(c *exec.Cmd, sig syscall.Signal) {
	if c == nil || c.Process == nil {
		return
	}
	_ = c.Process.Signal(sig)
	done := make(chan struct{})
	go func() { _ = c.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = c.Process.Kill()
		<-done
	}
}

// waitSocket waits until path accepts connections.
func waitSocket(path string, bound time.Duration) error {
	for deadline := time.Now().Add(bound); ; {
		if conn, err := net.Dial("unix", path); err == nil {
			conn.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no socket at %s within %s", path, bound)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
