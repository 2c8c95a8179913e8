//go:build linux

package vsock_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/nsexec"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost/vhostuser"
	"github.com/shuntnet/shunt/vhost/vsock"
)

// vsockModules are the guest's modules, in load order (virtio itself is
// loaded by the harness's init).
var vsockModules = []string{"net/vmw_vsock/vsock.ko", "net/vmw_vsock/vmw_vsock_virtio_transport_common.ko", "net/vmw_vsock/vmw_vsock_virtio_transport.ko"}

// rig is one TCG guest whose vhost-user-vsock device this process serves.
type rig struct {
	t    testing.TB
	ctx  context.Context // the test's, ended early if QEMU exits
	dir  string
	dev  *vsock.Device
	v    *vm.VM
	qout lockedBuffer

	mu   sync.Mutex
	sess *net.UnixConn // the front-end connection being served
	n    int           // front-end connections accepted
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// boot builds the guest program and initramfs, serves the device on a
// Unix socket (every front-end connection in turn) and starts QEMU with
// chardev options chardevOpts, the guest running phases (see
// guest/main.go). It returns once the guest's init runs.
func boot(t testing.TB, ctx context.Context, chardevOpts string, phases ...string) *rig {
	return bootNet(t, ctx, chardevOpts, "", phases...)
}

// bootNet is boot with, for a non-empty netns (a path), a virtio-net NIC
// too: QEMU runs in that namespace, its tap vtap0 gets 10.0.0.1/24 there,
// the guest 10.0.0.2.
func bootNet(t testing.TB, ctx context.Context, chardevOpts, netns string, phases ...string) *rig {
	return bootWith(t, ctx, bootOpts{chardev: chardevOpts, netns: netns, serve: (*rig).serveOwn}, phases...)
}

// bootOpts say how bootWith starts the guest.
type bootOpts struct {
	chardev string // more options of the vsock chardev
	netns   string // a path: a virtio-net NIC on a tap vtap0 there
	// addr and gw are the guest's address (/24) and its gateway, the tap's
	// host side; "": 10.0.0.2 and 10.0.0.1.
	addr, gw string
	// serve makes and serves the device on the socket sock (serveOwn:
	// this process's loop; TestVsockStretch: hostd's room), or nil: a
	// hostd serves sock already.
	serve func(r *rig, sock string)
	sock  string   // the vsock socket; "": vhost.sock in the rig's directory
	qemu  []string // more QEMU arguments (a control port)
	tap   string   // the tap's name in netns; "": vtap0
	// noWait returns once QEMU started, not once the guest's init runs
	// (rig.ready waits): two VMs boot at once.
	noWait bool
	// files go into the initramfs at their own absolute paths (the C
	// side's programs: TestVsockPreload); with them the guest gets the
	// host's /usr over 9p, where their libraries are.
	files []string
}

// bootWith is bootNet with the options of o.
func bootWith(t testing.TB, ctx context.Context, o bootOpts, phases ...string) *rig {
	chardevOpts, netns := o.chardev, o.netns
	if o.addr == "" {
		o.addr, o.gw = "10.0.0.2", "10.0.0.1"
	}
	if o.tap == "" {
		o.tap = "vtap0"
	}
	testenv.NeedTool(t, "qemu-system-x86_64", "qemu-system-x86")
	testenv.NeedTool(t, "busybox", "busybox-static")
	r := &rig{t: t, dir: t.TempDir()}
	kernel, err := vm.FindKernel(filepath.Join(os.TempDir(), "shunt-vm-cache"))
	if err != nil {
		testenv.Missing(t, err.Error(), "apt-get install linux-image-amd64 xz-utils")
	}
	guest := filepath.Join(r.dir, "guest")
	build := exec.Command("go", "build", "-o", guest, "./guest")
	build.Env = append(os.Environ(), "CGO_ENABLED=0") // static: the initramfs has no libc
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the guest program: %v\n%s", err, out)
	}
	var args []string
	for _, m := range vsockModules {
		args = append(args, filepath.Join(kernel.Modules, "kernel", m))
	}
	initrd := filepath.Join(r.dir, "initrd")
	if len(o.files) > 0 {
		o.qemu = append(o.qemu, "-virtfs", "local,path=/usr,mount_tag=hostusr,security_model=none,readonly=on")
	}
	if err := vm.BuildInitramfsFiles(initrd, kernel, guest, append(append([]string{}, args...), o.files...)...); err != nil {
		t.Fatal(err)
	}
	args = append(args, phases...)
	sock := o.sock
	if sock == "" {
		sock = filepath.Join(r.dir, "vhost.sock")
	}
	if o.serve != nil {
		o.serve(r, sock)
	}
	console := filepath.Join(r.dir, "console")
	cmdline := fmt.Sprintf("console=ttyS0 quiet panic=-1 shunt.ip=%s/24 shunt.gw=%s shunt.args=%s", o.addr, o.gw, strings.Join(args, ","))
	qemu := exec.Command("qemu-system-x86_64", "-machine", "pc", "-accel", "tcg", "-m", "256", "-nodefaults", "-no-reboot",
		"-display", "none", "-serial", "file:"+console, "-kernel", kernel.Vmlinux, "-initrd", initrd, "-append", cmdline,
		"-object", "memory-backend-memfd,id=mem,size=256M,share=on", "-numa", "node,memdev=mem",
		"-chardev", "socket,id=vsock0,path="+sock+chardevOpts, "-device", "vhost-user-vsock-pci,chardev=vsock0")
	qemu.Args = append(qemu.Args, o.qemu...)
	qemu.Stdout, qemu.Stderr = &r.qout, &r.qout
	if netns == "" {
		err = qemu.Start()
	} else {
		qemu.Args = append(qemu.Args, "-netdev", "tap,id=n0,ifname="+o.tap+",script=no,downscript=no", "-device", "virtio-net-pci,netdev=n0")
		err = nsexec.In(netns, qemu.Start)
	}
	if err != nil {
		t.Fatal(err)
	}
	if netns != "" {
		ns := filepath.Base(netns)
		for deadline := time.Now().Add(10 * time.Second); exec.Command("ip", "-n", ns, "link", "show", o.tap).Run() != nil; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("no tap %s in %s after 10 s\n%s", o.tap, ns, r.qout.String())
			}
		}
		for _, a := range [][]string{{"addr", "add", o.gw + "/24", "dev", o.tap}, {"link", "set", o.tap, "up"}} {
			if out, err := exec.Command("ip", append([]string{"-n", ns}, a...)...).CombinedOutput(); err != nil {
				t.Fatalf("ip %v: %v %s", a, err, out)
			}
		}
	}
	// Waits end when QEMU does (it exits at start when the back-end
	// fails it), not only at the test's deadline.
	exited := make(chan struct{})
	go func() { qemu.Wait(); close(exited) }()
	t.Cleanup(func() { qemu.Process.Kill(); <-exited })
	var cancel context.CancelFunc
	r.ctx, cancel = context.WithCancel(ctx)
	t.Cleanup(cancel)
	go func() {
		select {
		case <-exited:
			time.Sleep(200 * time.Millisecond) // the console's last lines
			cancel()
		case <-r.ctx.Done():
		}
	}()
	r.v = vm.Follow("vsock", console)
	t.Cleanup(r.v.Stop)
	if !o.noWait {
		r.ready()
	}
	return r
}

// ready waits until the guest's init runs.
func (r *rig) ready() {
	r.t.Helper()
	if _, err := r.v.Wait(r.ctx, "SHUNT-VM READY"); err != nil {
		r.t.Fatalf("%v\n%s", err, r.state())
	}
}

// serveOwn makes the device and serves every front-end connection on
// sock in turn, in this process.
func (r *rig) serveOwn(sock string) {
	t := r.t
	var err error
	if r.dev, err = vsock.New(guestCID, t.Logf); err != nil {
		t.Fatal(err)
	}
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		for {
			c, err := ul.AcceptUnix()
			if err != nil {
				return
			}
			r.mu.Lock()
			r.sess = c
			r.n++
			r.mu.Unlock()
			if err := vhostuser.Serve(c, r.dev, t.Logf); err != nil {
				t.Logf("front-end session ended: %v", err)
			}
		}
	}()
	t.Cleanup(func() {
		ul.Close()
		r.KillSession()
		<-served
	})
}

// KillSession closes the front-end connection being served, as a
// back-end that dies would.
func (r *rig) KillSession() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sess != nil {
		r.sess.Close()
	}
}

// Sessions is how many front-end connections were accepted.
func (r *rig) Sessions() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n
}

// state is what a failure reports: the device's counters, QEMU's output
// and the guest's console.
func (r *rig) state() string {
	console := ""
	if r.v != nil {
		console = r.v.Console()
	}
	if r.dev == nil { // hostd serves the device: its state is hostd's
		return fmt.Sprintf("qemu: %s\nconsole:\n%s", r.qout.String(), console)
	}
	s := r.dev.Stats()
	return fmt.Sprintf("device: conns %d accepted %d dialed %d refused %d resets %d bad %d rx %d tx %d broken %d; front-end sessions %d; qemu: %s\nconsole:\n%s",
		s.Conns.Load(), s.Accepted.Load(), s.Dialed.Load(), s.Refused.Load(), s.Resets.Load(), s.BadPackets.Load(), s.RxBytes.Load(), s.TxBytes.Load(), s.QueueBroken.Load(), r.Sessions(), r.qout.String(), console)
}

// guestLine waits for the guest's result line of a phase and checks it
// against the host's end of the exchange.
func (r *rig) guestLine(ctx context.Context, name string, host result, mode string, port int) {
	r.t.Helper()
	r.guestLineOf(ctx, name, host, fmt.Sprintf("SHUNT-VSOCK %s port=%d ", mode, port))
}

// guestLineOf is guestLine for the line starting with prefix.
func (r *rig) guestLineOf(ctx context.Context, name string, host result, prefix string) {
	r.t.Helper()
	if host.err != nil {
		r.t.Fatalf("%s: host side: %v\n%s", name, host.err, r.state())
	}
	line, err := r.v.WaitAny(ctx, 0, prefix, "SHUNT-VSOCK ERROR")
	if err != nil {
		r.t.Fatalf("%s: %v\n%s", name, err, r.state())
	}
	want := fmt.Sprintf(" sent=%x recv=%x bytes=%d ", host.recv, host.sent, host.want)
	if !strings.HasPrefix(line, prefix) || !strings.Contains(line, want) || host.n != host.want {
		r.t.Fatalf("%s: guest says %q, host got %d bytes: want %q\n%s", name, line, host.n, want, r.state())
	}
	r.t.Logf("%s: %d bytes each way, checksums equal: %s", name, host.want, line)
}

func vsockServeHybrid(r *rig) (*vsock.Hybrid, error) {
	return vsock.ServeHybrid(r.dev, filepath.Join(r.dir, "hv.sock"))
}
