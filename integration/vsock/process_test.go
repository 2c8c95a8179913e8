//go:build linux

package vsock_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/stack"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost/vserial"
	"github.com/shuntnet/shunt/vhost/vsock"
)

// The VM of TestVsockProcessGuest, on a tap in the rig's host namespace.
const (
	vsockVMAddr = "10.77.150.2"
	vsockVMHost = "10.77.150.1"
	vsockVMID   = 50
	procPort    = 7100
	procLen     = 4 << 20
)

// TestVsockProcessGuest: a TCG VM with vhost-user-vsock and no ivshmem
// (its control channel on virtio-serial), served by hostd (the guest's
// vsock block), connects with guestlib to a namespace (process) guest
// through the host's routing, firewall and conntrack. The connection must
// reach the fast path, which for this VM means a vsock stretch bridged by
// hostd to the flow's rings in the pair region the process guest maps;
// `hostd flows` must show it as rings via vsock; then 4 MiB of seeded
// bytes each way at once, with a half-close each way: both ends' SHA-256
// of both directions must match, the rings must have carried at least
// half of it each way, and hostd's vsock device at least what the rings
// carried (shunt_vsock_bytes_total).
//
// It ran opt-in for a while: one run in three, the VM's stream reached the
// process guest short by 32-320 KiB with a clean EOF. The VM's LEFT (its
// reader done while its CloseWrite still waited for the bridge) made
// hostd tell the process guest DOWN(peer-gone), whose reader then left
// its ring once empty while the room's bridge still carried the VM's last
// bytes. hostd now tells the survivor only once the room's bridge carried
// them (hostd/vsockhost TestStretchGoneDrains, hostd/broker
// TestStretchPeerGoneAtRelease).
func TestVsockProcessGuest(t *testing.T) {
	vsockDial(t, vmHow{})
}

// TestVsockControlOverVsock: TestVsockProcessGuest for a VM with no
// virtio-serial port (as under Firecracker) and no control socket in
// hostd's config: the library finds no port, takes its control channel
// over vsock (hostd serves it on the VM's device, port 1021), and its
// flow over a stretch with no option set.
func TestVsockControlOverVsock(t *testing.T) {
	vsockDial(t, vmHow{noPort: true})
}

// TestVsockHybrid: the same VM, its vsock device this test's (standing
// for Firecracker's or Cloud Hypervisor's own device) exposed as a hybrid
// vsock socket, the protocol those hypervisors speak; hostd is configured
// with that socket alone (vsock { hybrid = ... }) and serves the control
// channel and the stretch at <socket>_<port>, where the hybrid face sends
// the guest's connections to the host.
func TestVsockHybrid(t *testing.T) {
	vsockDial(t, vmHow{noPort: true, hybrid: true})
}

// vsockDial runs TestVsockProcessGuest's exchange with the VM set up as
// how says.
func vsockDial(t *testing.T, how vmHow) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	v := startVsockVMHow(t, ctx, how, fmt.Sprintf("gdial:%d:%d:7", procPort, procLen))
	s, hostd, r, c, fail := v.s, v.hostd, v.r, v.c, v.fail
	booted := v.booted
	ctx = r.ctx
	v.onRings(ctx)
	host := exchange(ctx, c, 107, procLen)
	gc, ok := c.(interface{ Stats() guestlib.Stats })
	if !ok {
		fail("the process guest's connection %T is not guestlib's", c)
	}
	st := gc.Stats()
	t.Logf("process guest's connection: %+v", st)
	r.guestLineOf(ctx, "VM to process guest over vsock", host, fmt.Sprintf("SHUNT-VSOCK gdial port=%d ", procPort))
	if how.noPort && !strings.Contains(r.v.Console(), "shunt: control over vsock") {
		fail("the VM's library did not say it took its control channel over vsock")
	}
	// The VM's first writes go by TCP: its writer moves to its ring once
	// hostd's ATTACHED says the process guest's reader attached the
	// flow's ring (attached end to end, docs/vsock.md). So the rings must
	// have carried at least half the stream each way (a whole stream by
	// TCP failed here once, when that ATTACHED was lost), and the device
	// at least what they carried.
	fromVM, toVM := float64(st.RingReceived), float64(st.RingSent)
	if fromVM < procLen/2 || toVM < procLen/2 {
		fail("the rings carried %v bytes from the VM and %v to it: want at least half the stream (%d bytes) each way", fromVM, toVM, procLen)
	}
	if how.hybrid { // the device is this process's
		ds := r.dev.Stats()
		if rx, tx := float64(ds.RxBytes.Load()), float64(ds.TxBytes.Load()); rx < fromVM || tx < toVM || ds.BadPackets.Load() != 0 {
			fail("the hybrid device carried rx %v tx %v bytes (bad packets %d): want at least what the rings carried (%v, %v)", rx, tx, ds.BadPackets.Load(), fromVM, toVM)
		}
		t.Logf("boot %v, whole test %v", booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
		return
	}
	cs := counters(hostd, s.Admin)
	for dir, n := range map[string]float64{"rx": fromVM, "tx": toVM} {
		key := fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=vm}", dir)
		if v := counterValue(cs, key); v < n {
			fail("%s = %v: the device carried less than the rings (%v bytes)", key, v, n)
		}
	}
	if v := counterValue(cs, "shunt_vsock_bad_packets_total{guest=vm}"); v != 0 {
		fail("the honest guest's driver was refused %v times", v)
	}
	t.Logf("boot %v, whole test %v", booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// vmHow is how startVsockVMHow sets the VM up.
type vmHow struct {
	noPort bool // no virtio-serial port and no control socket: control over vsock
	// hybrid: the vsock device is this process's, served to hostd through
	// a hybrid vsock socket (vsock.ServeHybrid), as Firecracker's is.
	hybrid bool
	// vsockd: shunt-vsockd serves the QEMU device (hostd's vsockd_socket),
	// a process of the test's own, killed by its pid at the end.
	vsockd bool
	// files go into the VM's initramfs (bootOpts.files: the C side's
	// programs, TestVsockPreload).
	files []string
	// before, if set, runs once hostd is up and before the VM boots (the
	// process guest's servers, TestVsockPreload); the process guest then
	// has no Go listener, and startVsockVMHow returns once the VM booted.
	before func(v *vsockVM)
}

// vsockVM is a rig host with hostd, one process guest listening on
// procPort, and a TCG VM (vhost-user-vsock served by hostd, virtio-serial
// control, no ivshmem) that dialed it with guestlib.
type vsockVM struct {
	t      testing.TB
	s      *stack.Stack
	hostd  string
	vsockd *vsockdProc // shunt-vsockd, if it serves the device (vmHow.vsockd)
	r      *rig
	c      net.Conn // the process guest's accepted connection
	booted time.Duration
	// fail fails the test with both ends' state: hostd's connections,
	// counters and debug log, QEMU's output and the VM's console (the
	// guest library's log lines among it).
	fail func(format string, args ...any)
	more func() string // more state for fail (the process guest's programs' output)
}

// startVsockVM starts hostd on a rig with one process guest and the VM,
// whose program runs phases after learning the process guest's address,
// and returns once the process guest accepted the VM's connection.
func startVsockVM(t *testing.T, ctx context.Context, phases ...string) *vsockVM {
	return startVsockVMHow(t, ctx, vmHow{}, phases...)
}

// startVsockVMHow is startVsockVM with the VM set up as how says.
func startVsockVMHow(t testing.TB, ctx context.Context, how vmHow, phases ...string) *vsockVM {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	start := time.Now()
	dir := t.TempDir()
	hostd := filepath.Join(dir, "hostd")
	if out, err := exec.Command("go", "build", "-o", hostd, "../../cmd/hostd").CombinedOutput(); err != nil {
		t.Fatalf("build hostd: %v\n%s", err, out)
	}
	control, vsockSock, hybridSock := filepath.Join(dir, "vm.sock"), filepath.Join(dir, "vm.vsock"), filepath.Join(dir, "fc.vsock")
	controlLine := fmt.Sprintf("  control = %q\n", control)
	if how.noPort {
		controlLine = ""
	}
	device := fmt.Sprintf("    socket = %q\n    cid = %d\n", vsockSock, guestCID)
	if how.hybrid {
		device = fmt.Sprintf("    hybrid = %q\n", hybridSock)
	}
	extra := fmt.Sprintf("guest \"vm\" {\n  id = %d\n  group = \"t\"\n%s  addresses = [%q]\n  vsock {\n%s  }\n}\n",
		vsockVMID, controlLine, vsockVMAddr, device)
	var daemon *vsockdProc
	if how.vsockd {
		daemon = startVsockd(t, dir)
		extra = fmt.Sprintf("vsockd_socket = %q\n", daemon.sock) + extra
	}
	s, err := stack.Start(stack.Options{Name: fmt.Sprintf("vk%d", os.Getpid()%100000), Guests: 1, HostdBin: hostd, Dir: dir, Extra: extra, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	v := &vsockVM{t: t, s: s, hostd: hostd, vsockd: daemon}
	state := func() string {
		flows, _ := s.Conns()
		js, _ := json.MarshalIndent(flows, "", "  ")
		d := ""
		if daemon != nil {
			d = "shunt-vsockd's log:\n" + daemon.out.String()
		}
		return fmt.Sprintf("hostd's connections: %s\nhostd counters:\n%s\nhostd log:\n%s\n%s", js, counters(hostd, s.Admin), s.Log(), d)
	}
	v.fail = func(format string, args ...any) {
		t.Helper()
		rs := ""
		if v.r != nil {
			rs = v.r.state()
		}
		more := ""
		if v.more != nil {
			more = v.more()
		}
		t.Fatalf("%s\n%s\n%s\n%s", fmt.Sprintf(format, args...), state(), more, rs)
	}
	accepted := make(chan net.Conn, 1)
	if how.before != nil {
		how.before(v)
	} else {
		l, err := s.Listen(1, procPort)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			if c, err := l.Accept(); err == nil {
				accepted <- c
			}
		}()
	}
	o := bootOpts{netns: s.Rig.HostNSPath(), addr: vsockVMAddr, gw: vsockVMHost, sock: vsockSock, files: how.files}
	if !how.noPort {
		if o.qemu, err = (vserial.Port{ID: "shunt0", Socket: control, Ports: 1}).QEMUArgs(); err != nil {
			t.Fatal(err)
		}
	}
	if how.hybrid { // this process is the hypervisor's vsock device
		o.sock = filepath.Join(dir, "qemu.vsock")
		o.serve = func(r *rig, sock string) {
			r.serveOwn(sock)
			h, err := vsock.ServeHybrid(r.dev, hybridSock)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { h.Close() })
		}
	}
	v.r = bootWith(t, ctx, o, append([]string{fmt.Sprintf("target:%s:0:0", s.Rig.Guests[0].Addr)}, phases...)...)
	v.booted = time.Since(start)
	if how.before != nil {
		return v
	}
	select {
	case v.c = <-accepted:
	case <-v.r.ctx.Done():
		v.fail("the process guest accepted no connection")
	}
	return v
}

// onRings waits until the VM's program says its connection is on the
// fast path and hostd's flows show it on the rings via vsock.
func (v *vsockVM) onRings(ctx context.Context) {
	v.t.Helper()
	saidOnRings(ctx, v.r, v.fail)
	v.waitPath(ctx, "rings")
}

// waitPath waits until hostd's flows show the connection on path ("rings":
// via vsock).
func (v *vsockVM) waitPath(ctx context.Context, path string) {
	v.t.Helper()
	waitConnPath(ctx, v.t, v.s, procPort, path, v.fail)
}

// saidOnRings waits until r's program says its connection is on the fast
// path, failing with fail if it says an error or ctx ends.
func saidOnRings(ctx context.Context, r *rig, fail func(string, ...any)) {
	if line, err := r.v.WaitAny(ctx, 0, "SHUNT-VSOCK ONRINGS", "SHUNT-VSOCK ERROR"); err != nil || !strings.HasPrefix(line, "SHUNT-VSOCK ONRINGS") {
		fail("%s's connection did not reach the fast path: %q %v", r.v.Name, line, err)
	}
}

// waitConnPath waits until hostd's flows (s) show the connection to port
// on path ("rings": via vsock), failing with fail once ctx ends.
func waitConnPath(ctx context.Context, t testing.TB, s *stack.Stack, port int, path string, fail func(string, ...any)) {
	for {
		fi, ok, err := s.ConnOn(port)
		if err == nil && ok && fi.Path == path && (path != "rings" || fi.Via == "vsock") {
			t.Logf("hostd flows: %s %s -> %s path %s via %s (switches %d)", fi.Name, fi.Src, fi.Dst, fi.Path, fi.Via, fi.Switches)
			return
		}
		if ctx.Err() != nil {
			fail("hostd flows never showed the connection on %s: %+v %v %v", path, fi, ok, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// counters is `hostd counters` (one "name value" a line).
func counters(hostd, admin string) string {
	out, err := exec.Command(hostd, "counters", "-admin", admin).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("hostd counters: %v %s", err, out)
	}
	return string(out)
}

// counterValue is key's value in counters' output, or -1.
func counterValue(out, key string) float64 {
	sc := bufio.NewScanner(bytes.NewReader([]byte(out)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == key {
			v, err := strconv.ParseFloat(f[1], 64)
			if err == nil {
				return v
			}
		}
	}
	return -1
}
