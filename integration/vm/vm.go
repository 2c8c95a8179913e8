//go:build linux

package vm

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
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
}

// VM is a running QEMU guest. Wait and Console are safe for concurrent
// use; Stop is for the owner.
type VM struct {
	Name string
	cmd  *exec.Cmd

	mu    sync.Mutex
	lines []string
	cond  *sync.Cond
	done  bool
}

// Boot starts the VM and configures the host side of its tap. The caller
// must Stop it.
func Boot(o Options, start func(*exec.Cmd) error) (*VM, error) {
	att, err := o.Attach.QEMUArgs()
	if err != nil {
		return nil, err
	}
	if o.MemMB == 0 {
		o.MemMB = 256
	}
	cmdline := fmt.Sprintf("console=ttyS0 quiet panic=-1 shunt.ip=%s/24 shunt.gw=%s shunt.args=%s", o.Addr, o.Host, strings.Join(o.Args, ","))
	args := append([]string{"-machine", "pc,accel=tcg", "-m", fmt.Sprint(o.MemMB), "-nodefaults", "-no-reboot",
		"-display", "none", "-serial", "stdio", "-kernel", o.Kernel.Vmlinux, "-initrd", o.Initramfs, "-append", cmdline,
		"-netdev", fmt.Sprintf("tap,id=n0,ifname=%s,script=no,downscript=no", o.Tap), "-device", "virtio-net-pci,netdev=n0"}, att...)
	v := &VM{Name: o.Name, cmd: exec.Command("qemu-system-x86_64", args...)}
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
	if err := hostSide(o); err != nil {
		v.Stop()
		return nil, err
	}
	return v, nil
}

// hostSide gives the tap its host address once QEMU has created it.
func hostSide(o Options) error {
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
	stop := context.AfterFunc(ctx, func() { v.mu.Lock(); v.cond.Broadcast(); v.mu.Unlock() })
	defer stop()
	v.mu.Lock()
	defer v.mu.Unlock()
	for seen := 0; ; {
		for ; seen < len(v.lines); seen++ {
			if strings.HasPrefix(v.lines[seen], prefix) {
				return v.lines[seen], nil
			}
		}
		if v.done || ctx.Err() != nil {
			return "", fmt.Errorf("vm %s: no %q on the console (%v); console:\n%s", v.Name, prefix, ctx.Err(), strings.Join(v.lines, "\n"))
		}
		v.cond.Wait()
	}
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
	if v.cmd.Process != nil {
		v.cmd.Process.Kill()
		v.cmd.Wait()
	}
}
