//go:build linux

package vm

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/shuntnet/shunt/vhost"
)

// Options describe one VM.
type Options struct {
	Name       string
	Kernel     Kernel
	Initramfs  string
	HostNS     string     // netns path where QEMU runs and its tap appears
	Tap        string     // tap interface name
	Addr, Host netip.Addr // the VM's address and the host side of its tap (/24)
	Attach     vhost.Attachment
	Args       []string // the agent's arguments
	MemMB      int
	// Resettable keeps QEMU running when the guest reboots (no
	// -no-reboot) and gives it a monitor socket, for Reset.
	Resettable bool
	// ShareUsr gives the guest the host's /usr, read-only over 9p, so
	// host programs (Open MPI) run in it without copying them in.
	ShareUsr bool
	// Migratable gives QEMU a QMP socket (VM.QMP) and the ivshmem
	// device a fixed slot (HotplugAddr), so that the device can be
	// unplugged (VM.Unplug), the VM migrated (VM.Migrate) and the device
	// plugged back (VM.Plug).
	Migratable bool
	// Incoming starts a Migratable VM as a migration's destination
	// (QEMU's -incoming, e.g. "unix:/path"): without the ivshmem device
	// (plug it after the migration) and without configuring the host
	// side of its tap (HostSide, once the source's tap is gone).
	Incoming string
	// QMP is where a Migratable VM's QMP socket goes ("": a fresh
	// temporary path), for a hostd.hcl that names it before QEMU starts
	// (qmp: hostd hot-plugs pair regions through it). A Migratable VM
	// without Attach.Region starts without an ivshmem device.
	QMP string
	// Accel is QEMU's -accel ("": tcg), e.g. "tcg,thread=single".
	Accel string
	// Net, if set, are QEMU arguments that give the guest its eth0 in
	// place of the tap (e.g. a -netdev stream over a Unix socket to
	// another VM, and its -device with a MAC of its own): Tap, HostNS
	// and Host are then unused and Boot configures no host side.
	Net []string
	// CPU is QEMU's -cpu ("": its default), e.g. "max" (which lets the
	// guest's crc32 use PCLMUL: SoftRoCE computes one per packet).
	CPU string
}

func (o Options) cmdline() string {
	return fmt.Sprintf("console=ttyS0 quiet panic=-1 shunt.ip=%s/24 shunt.gw=%s shunt.args=%s", o.Addr, o.Host, strings.Join(o.Args, ","))
}

// DomainXML returns a libvirt domain that boots o like Boot does: TCG,
// direct kernel boot, a tap named o.Tap that libvirt creates, Shunt's
// devices from o.Attach, the console into the file console, and metadata
// (Shunt's, from hostd/virt) in <metadata>.
func DomainXML(o Options, console, metadata string) (string, error) {
	devs, err := o.Attach.LibvirtXML()
	if err != nil {
		return "", err
	}
	if o.MemMB == 0 {
		o.MemMB = 256
	}
	var b strings.Builder
	fmt.Fprintf(&b, "<domain type='qemu'>\n<name>%s</name>\n<memory unit='MiB'>%d</memory>\n<vcpu>1</vcpu>\n", o.Name, o.MemMB)
	fmt.Fprintf(&b, "<metadata>\n%s\n</metadata>\n", metadata)
	fmt.Fprintf(&b, "<os>\n<type arch='x86_64' machine='pc'>hvm</type>\n<kernel>%s</kernel>\n<initrd>%s</initrd>\n<cmdline>%s</cmdline>\n</os>\n", o.Kernel.Vmlinux, o.Initramfs, o.cmdline())
	b.WriteString("<on_reboot>destroy</on_reboot>\n<devices>\n<emulator>/usr/bin/qemu-system-x86_64</emulator>\n")
	fmt.Fprintf(&b, "<interface type='ethernet'>\n<target dev='%s'/>\n<model type='virtio'/>\n</interface>\n", o.Tap)
	fmt.Fprintf(&b, "<serial type='file'>\n<source path='%s'/>\n</serial>\n", console)
	b.WriteString(devs)
	b.WriteString("\n</devices>\n</domain>\n")
	return b.String(), nil
}

// Follow returns a VM whose console is the file at path, written by a QEMU
// that someone else runs (libvirt). Stop stops following; it does not
// touch the QEMU.
func Follow(name, path string) *VM {
	v := &VM{Name: name, stop: make(chan struct{})}
	v.cond = sync.NewCond(&v.mu)
	go v.follow(path)
	return v
}

func (v *VM) follow(path string) {
	var partial []byte
	var off int64
	buf := make([]byte, 64<<10)
	defer func() {
		v.mu.Lock()
		v.done = true
		v.cond.Broadcast()
		v.mu.Unlock()
	}()
	for {
		if f, err := os.Open(path); err == nil {
			for {
				n, _ := f.ReadAt(buf, off)
				if n == 0 {
					break
				}
				off += int64(n)
				partial = append(partial, buf[:n]...)
			}
			f.Close()
			for {
				i := bytes.IndexByte(partial, '\n')
				if i < 0 {
					break
				}
				v.mu.Lock()
				v.lines = append(v.lines, strings.TrimRight(string(partial[:i]), "\r"))
				v.cond.Broadcast()
				v.mu.Unlock()
				partial = partial[i+1:]
			}
		}
		select {
		case <-v.stop:
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// VM is a running QEMU guest. Wait and Console are safe for concurrent
// use; Stop is for the owner.
type VM struct {
	Name    string
	cmd     *exec.Cmd
	stop    chan struct{} // Follow's: closed by Stop
	monitor string        // HMP socket of a Resettable VM
	qmpPath string        // QMP socket of a Migratable VM

	qmpMu    sync.Mutex
	qmp      *QMP              // connected on first use
	plugs    int               // Plug calls, for fresh backend names
	backends map[string]string // device id -> its memory backend, for those Plug added

	mu    sync.Mutex
	lines []string
	cond  *sync.Cond
	done  bool
}

// Boot starts the VM and configures the host side of its tap. The caller
// must Stop it.
func Boot(o Options, start func(*exec.Cmd) error) (*VM, error) {
	var att []string
	var err error
	if o.Attach != (vhost.Attachment{}) { // none: a VM without Shunt's devices (Net's)
		att, err = o.Attach.QEMUArgs()
	}
	if o.Migratable {
		att, err = migratableArgs(o)
	}
	if err != nil {
		return nil, err
	}
	if o.MemMB == 0 {
		o.MemMB = 256
	}
	cmdline := o.cmdline()
	if o.Accel == "" {
		o.Accel = "tcg"
	}
	args := []string{"-machine", "pc", "-accel", o.Accel, "-m", fmt.Sprint(o.MemMB), "-nodefaults"}
	if o.CPU != "" {
		args = append(args, "-cpu", o.CPU)
	}
	var monitor string
	if o.Resettable {
		f, err := os.CreateTemp("", "shunt-mon-*.sock")
		if err != nil {
			return nil, err
		}
		monitor = f.Name()
		f.Close()
		os.Remove(monitor)
		args = append(args, "-monitor", fmt.Sprintf("unix:%s,server=on,wait=off", monitor))
	} else {
		args = append(args, "-no-reboot")
	}
	var qmpPath string
	if o.Migratable {
		if qmpPath = o.QMP; qmpPath == "" {
			if qmpPath, err = tempSocket("shunt-qmp-*.sock"); err != nil {
				return nil, err
			}
		}
		args = append(args, "-qmp", fmt.Sprintf("unix:%s,server=on,wait=off", qmpPath))
		if o.Incoming != "" {
			args = append(args, "-incoming", o.Incoming)
		}
	}
	if o.ShareUsr {
		args = append(args, "-virtfs", "local,path=/usr,mount_tag=hostusr,security_model=none,readonly=on")
	}
	netArgs := []string{"-netdev", fmt.Sprintf("tap,id=n0,ifname=%s,script=no,downscript=no", o.Tap), "-device", "virtio-net-pci,netdev=n0"}
	if o.Net != nil {
		netArgs = o.Net
	}
	args = append(append(append(args, "-display", "none", "-serial", "stdio", "-kernel", o.Kernel.Vmlinux, "-initrd", o.Initramfs, "-append", cmdline),
		netArgs...), att...)
	v := &VM{Name: o.Name, cmd: exec.Command("qemu-system-x86_64", args...), monitor: monitor, qmpPath: qmpPath}
	v.cond = sync.NewCond(&v.mu)
	out, err := v.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	v.cmd.Stderr = v.cmd.Stdout
	if err := start(v.cmd); err != nil {
		return nil, fmt.Errorf("start qemu: %w", err)
	}
	go v.read(out)
	if o.Incoming != "" || o.Net != nil {
		return v, nil
	}
	if err := HostSide(o); err != nil {
		v.Stop()
		return nil, err
	}
	return v, nil
}

// HostSide gives the tap its host address once QEMU (or libvirt) has
// created it.
func HostSide(o Options) error {
	ns, err := netns.GetFromPath(o.HostNS)
	if err != nil {
		return err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return err
	}
	defer h.Close()
	var link netlink.Link
	for deadline := time.Now().Add(10 * time.Second); ; {
		if link, err = h.LinkByName(o.Tap); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("tap %s did not appear: %w", o.Tap, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: o.Host.AsSlice(), Mask: net.CIDRMask(24, 32)}}
	if err := h.AddrAdd(link, addr); err != nil {
		return fmt.Errorf("address on %s: %w", o.Tap, err)
	}
	return h.LinkSetUp(link)
}

func (v *VM) read(r io.Reader) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		v.mu.Lock()
		v.lines = append(v.lines, strings.TrimRight(sc.Text(), "\r"))
		v.cond.Broadcast()
		v.mu.Unlock()
	}
	v.mu.Lock()
	v.done = true
	v.cond.Broadcast()
	v.mu.Unlock()
}

// Wait waits for a console line starting with prefix and returns it.
func (v *VM) Wait(ctx context.Context, prefix string) (string, error) {
	return v.WaitFrom(ctx, 0, prefix)
}

// Lines returns how many console lines the VM printed so far, for WaitFrom.
func (v *VM) Lines() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.lines)
}

// WaitFrom is Wait ignoring the first from lines (those of an earlier
// boot, say).
func (v *VM) WaitFrom(ctx context.Context, from int, prefix string) (string, error) {
	return v.WaitAny(ctx, from, prefix)
}

// WaitAny waits, past the first from lines, for a console line starting
// with any of prefixes (a result or an error line) and returns it.
func (v *VM) WaitAny(ctx context.Context, from int, prefixes ...string) (string, error) {
	stop := context.AfterFunc(ctx, func() { v.mu.Lock(); v.cond.Broadcast(); v.mu.Unlock() })
	defer stop()
	v.mu.Lock()
	defer v.mu.Unlock()
	for seen := from; ; {
		for ; seen < len(v.lines); seen++ {
			for _, p := range prefixes {
				if strings.HasPrefix(v.lines[seen], p) {
					return v.lines[seen], nil
				}
			}
		}
		if v.done || ctx.Err() != nil {
			return "", fmt.Errorf("vm %s: no %q on the console after line %d (%v); console:\n%s", v.Name, prefixes, from, ctx.Err(), strings.Join(v.lines, "\n"))
		}
		v.cond.Wait()
	}
}

// Has reports whether a console line starting with prefix came (after
// the first from lines).
func (v *VM) Has(from int, prefix string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, l := range v.lines[min(from, len(v.lines)):] {
		if strings.HasPrefix(l, prefix) {
			return true
		}
	}
	return false
}

// Reset presses a Resettable VM's reset button: the guest reboots in place,
// in the same QEMU, so its devices' host ends (the control port's socket)
// stay connected.
func (v *VM) Reset() error {
	c, err := net.Dial("unix", v.monitor)
	if err != nil {
		return fmt.Errorf("monitor of %s: %w", v.Name, err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("system_reset\n")); err != nil {
		return err
	}
	// QEMU echoes the command once it has read it; closing earlier could
	// lose it.
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var seen []byte
	buf := make([]byte, 512)
	for !bytes.Contains(seen, []byte("system_reset")) {
		n, err := c.Read(buf)
		if err != nil {
			return fmt.Errorf("monitor of %s: no echo of system_reset: %w", v.Name, err)
		}
		seen = append(seen, buf[:n]...)
	}
	return nil
}

// Console returns what the VM printed so far.
func (v *VM) Console() string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return strings.Join(v.lines, "\n")
}

// Stop kills QEMU (a power-off, as far as the guest's peers can tell) and
// waits for it.
func (v *VM) Stop() {
	if v.stop != nil {
		select {
		case <-v.stop:
		default:
			close(v.stop)
		}
		return
	}
	if v.cmd.Process != nil {
		v.cmd.Process.Kill()
		v.cmd.Wait()
	}
	if v.monitor != "" {
		os.Remove(v.monitor)
	}
	v.qmpMu.Lock()
	if v.qmp != nil {
		v.qmp.Close()
	}
	v.qmpMu.Unlock()
	if v.qmpPath != "" {
		os.Remove(v.qmpPath)
	}
}

// migratableArgs are o.Attach's arguments for a Migratable VM: the ivshmem
// device at HotplugAddr; none on a migration's destination or without
// o.Attach.Region.Path.
func migratableArgs(o Options) ([]string, error) {
	ctl, err := o.Attach.Control.QEMUArgs()
	if err != nil || o.Incoming != "" || o.Attach.Region.Path == "" {
		return ctl, err
	}
	reg, err := hotplugArgs(o.Attach.Region)
	if err != nil {
		return nil, err
	}
	return append(reg, ctl...), nil
}

// tempSocket returns a fresh path for a Unix socket QEMU creates.
func tempSocket(pattern string) (string, error) {
	f, err := os.CreateTemp("", pattern)
	if err != nil {
		return "", err
	}
	path := f.Name()
	f.Close()
	os.Remove(path)
	return path, nil
}
