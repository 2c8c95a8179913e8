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
// of both directions must match, and hostd's vsock device must have
// carried at least those bytes each way (shunt_vsock_bytes_total), so
// they did not go by TCP.
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
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	v := startVsockVM(t, ctx, fmt.Sprintf("gdial:%d:%d:7", procPort, procLen))
	s, hostd, r, c, fail := v.s, v.hostd, v.r, v.c, v.fail
	booted := v.booted
	ctx = r.ctx
	v.onRings(ctx)
	host := exchange(ctx, c, 107, procLen)
	if gc, ok := c.(interface{ Stats() guestlib.Stats }); ok {
		t.Logf("process guest's connection: %+v", gc.Stats())
	}
	r.guestLineOf(ctx, "VM to process guest over vsock", host, fmt.Sprintf("SHUNT-VSOCK gdial port=%d ", procPort))
	cs := counters(hostd, s.Admin)
	for _, dir := range []string{"rx", "tx"} {
		key := fmt.Sprintf("shunt_vsock_bytes_total{direction=%s,guest=vm}", dir)
		// The VM's first write may go by TCP: its writer moves to its ring
		// once it sees the ring's reader (its bridge) attached, which the
		// bridge's goroutine does just after READY (1 run in 9 here).
		if v := counterValue(cs, key); v < procLen-64<<10 {
			fail("%s = %v: the device carried less than the stream (%d bytes) but one write", key, v, procLen)
		}
	}
	if v := counterValue(cs, "shunt_vsock_bad_packets_total{guest=vm}"); v != 0 {
		fail("the honest guest's driver was refused %v times", v)
	}
	t.Logf("boot %v, whole test %v", booted.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// vsockVM is a rig host with hostd, one process guest listening on
// procPort, and a TCG VM (vhost-user-vsock served by hostd, virtio-serial
// control, no ivshmem) that dialed it with guestlib.
type vsockVM struct {
	t      *testing.T
	s      *stack.Stack
	hostd  string
	r      *rig
	c      net.Conn // the process guest's accepted connection
	booted time.Duration
	// fail fails the test with both ends' state: hostd's connections,
	// counters and debug log, QEMU's output and the VM's console (the
	// guest library's log lines among it).
	fail func(format string, args ...any)
}

// startVsockVM starts hostd on a rig with one process guest and the VM,
// whose program runs phases after learning the process guest's address,
// and returns once the process guest accepted the VM's connection.
func startVsockVM(t *testing.T, ctx context.Context, phases ...string) *vsockVM {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	start := time.Now()
	dir := t.TempDir()
	hostd := filepath.Join(dir, "hostd")
	if out, err := exec.Command("go", "build", "-o", hostd, "../../cmd/hostd").CombinedOutput(); err != nil {
		t.Fatalf("build hostd: %v\n%s", err, out)
	}
	control, vsockSock := filepath.Join(dir, "vm.sock"), filepath.Join(dir, "vm.vsock")
	extra := fmt.Sprintf("guest \"vm\" {\n  id = %d\n  group = \"t\"\n  control = %q\n  addresses = [%q]\n  vsock {\n    socket = %q\n    cid = %d\n  }\n}\n",
		vsockVMID, control, vsockVMAddr, vsockSock, guestCID)
	s, err := stack.Start(stack.Options{Name: fmt.Sprintf("vk%d", os.Getpid()%100000), Guests: 1, HostdBin: hostd, Dir: dir, Extra: extra, Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	v := &vsockVM{t: t, s: s, hostd: hostd}
	state := func() string {
		flows, _ := s.Conns()
		js, _ := json.MarshalIndent(flows, "", "  ")
		return fmt.Sprintf("hostd's connections: %s\nhostd counters:\n%s\nhostd log:\n%s", js, counters(hostd, s.Admin), s.Log())
	}
	v.fail = func(format string, args ...any) {
		t.Helper()
		rs := ""
		if v.r != nil {
			rs = v.r.state()
		}
		t.Fatalf("%s\n%s\n%s", fmt.Sprintf(format, args...), state(), rs)
	}
	l, err := s.Listen(1, procPort)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	ports, err := vserial.Port{ID: "shunt0", Socket: control, Ports: 1}.QEMUArgs()
	if err != nil {
		t.Fatal(err)
	}
	v.r = bootWith(t, ctx, bootOpts{netns: s.Rig.HostNSPath(), addr: vsockVMAddr, gw: vsockVMHost, sock: vsockSock, qemu: ports},
		append([]string{fmt.Sprintf("target:%s:0:0", s.Rig.Guests[0].Addr)}, phases...)...)
	v.booted = time.Since(start)
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
	if line, err := v.r.v.WaitAny(ctx, 0, "SHUNT-VSOCK ONRINGS", "SHUNT-VSOCK ERROR"); err != nil || !strings.HasPrefix(line, "SHUNT-VSOCK ONRINGS") {
		v.fail("the VM's connection did not reach the fast path: %q %v", line, err)
	}
	v.waitPath(ctx, "rings")
}

// waitPath waits until hostd's flows show the connection on path ("rings":
// via vsock).
func (v *vsockVM) waitPath(ctx context.Context, path string) {
	v.t.Helper()
	for {
		fi, ok, err := v.s.ConnOn(procPort)
		if err == nil && ok && fi.Path == path && (path != "rings" || fi.Via == "vsock") {
			v.t.Logf("hostd flows: %s %s -> %s path %s via %s (switches %d)", fi.Name, fi.Src, fi.Dst, fi.Path, fi.Via, fi.Switches)
			return
		}
		if ctx.Err() != nil {
			v.fail("hostd flows never showed the connection on %s: %+v %v %v", path, fi, ok, err)
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
