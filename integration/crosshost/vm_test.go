//go:build linux

package crosshost_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/peers"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// VMs across hosts (docs/crosshost.md, "VMs across hosts"): a QEMU (TCG)
// VM on each host of the two-host rig, on a tap in that host's namespace,
// with the host's group region as its ivshmem BAR and a control port to
// its hostd. A connection between them is relayed: each VM's ring pair is
// in its group region, with the relay of its host as the ring peer.

// vmImages is what a VM test needs: a guest kernel, and an initramfs with
// the agent (cmd/shunt-vm-agent), built in dir.
func vmImages(t testing.TB, dir string) (vm.Kernel, string) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "qemu-system-x86_64", "qemu-system-x86")
	testenv.NeedTool(t, "busybox", "busybox-static")
	if imgs, _ := filepath.Glob("/boot/vmlinuz-*"); len(imgs) == 0 {
		testenv.Missing(t, "no guest kernel in /boot", "apt-get install linux-image-amd64")
	}
	kernel, _, initrd, err := vm.Images(dir, "../../cmd/shunt-vm-agent")
	if err != nil {
		t.Fatal(err)
	}
	return kernel, initrd
}

// vmAddr is host k's (0-based) VM address and the host side of its tap:
// inside the prefixes the hosts route to each other (10.77/16, 10.78/16).
func vmAddr(k int) (netip.Addr, netip.Addr) {
	return netip.AddrFrom4([4]byte{10, byte(77 + k), 101, 2}), netip.AddrFrom4([4]byte{10, byte(77 + k), 101, 1})
}

// vmPair is a relay pair with a VM configured on each host (booted by boot).
type vmPair struct {
	*pairEnv
	dir    string
	kernel vm.Kernel
	initrd string
	vms    [2]*vm.VM
}

// newVMPair builds the two hosts with a VM guest "vm" configured on each
// (group t, the group region as its BAR) and waits until the channels
// are up and each host accepted the other's guests, the VM's included.
func newVMPair(t testing.TB) *vmPair {
	dir := t.TempDir()
	kernel, initrd := vmImages(t, dir)
	var extra [2]string
	for k := range 2 {
		a, _ := vmAddr(k)
		extra[k] = fmt.Sprintf("guest \"vm\" {\n  id = 101\n  group = \"t\"\n  control = %q\n  addresses = [%q]\n  shared_region = true\n}\n",
			filepath.Join(dir, fmt.Sprintf("vm%d.sock", k+1)), a)
	}
	e := newPairWith(t, 1, [2][]string{{"10.78.0.0/16"}, {"10.77.0.0/16"}}, [2]bool{true, true}, false, extra)
	v := &vmPair{pairEnv: e, dir: dir, kernel: kernel, initrd: initrd}
	e.within(20*time.Second, "both channels up, both hosts' guests and VMs accepted", func() bool {
		a, b := e.peersOf(0), e.peersOf(1)
		return state(a) == peers.StateUp && state(b) == peers.StateUp && a[0].Announced >= 2 && b[0].Announced >= 2
	})
	return v
}

// boot starts host k's VM with the agent's arguments; it is stopped when
// the test ends, and its console shown if the test failed.
func (v *vmPair) boot(k int, args ...string) *vm.VM {
	v.t.Helper()
	a, h := vmAddr(k)
	m, err := vm.Boot(vm.Options{
		Name: fmt.Sprintf("h%dvm", k+1), Kernel: v.kernel, Initramfs: v.initrd, HostNS: v.f.Hosts[k].HostNSPath(),
		Tap: fmt.Sprintf("shx%d-%d", os.Getpid()%10000, k+1), Addr: a, Host: h, Args: args,
		Attach: vhost.Attachment{
			Region:  ivshmem.Device{ID: "shunt0", Path: v.hosts[k].RegionPath(), Size: 32 << 20},
			Control: vserial.Port{ID: "shunt0", Socket: filepath.Join(v.dir, fmt.Sprintf("vm%d.sock", k+1))},
		},
	}, func(c *exec.Cmd) error { return nsrig.Start(v.f.Hosts[k].HostNSPath(), c) })
	if err != nil {
		v.t.Fatal(err)
	}
	v.vms[k] = m
	v.t.Cleanup(func() {
		if v.t.Failed() {
			v.t.Logf("console of h%d/vm:\n%s", k+1, tail(m.Console(), 60))
		}
		m.Stop()
	})
	return m
}

// wait waits for a console line of host k's VM starting with prefix (or
// an ERROR line, which fails), within d; then fails with both hosts'
// flows and the VMs' consoles.
func (v *vmPair) wait(k int, prefix string, d time.Duration) string {
	v.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	line, err := v.vms[k].WaitAny(ctx, 0, prefix, "SHUNT-VM ERROR")
	if err != nil || !strings.HasPrefix(line, prefix) {
		v.t.Fatalf("h%d/vm: no %q within %s (%v; %q)\n%s", k+1, prefix, d, err, line, v.flows())
	}
	return line
}

// tookRings reports whether host k's VM logged a READY taken (guestlib's
// "shunt: A -> B: rings R/S.G").
func (v *vmPair) tookRings(k int) bool {
	for _, l := range strings.Split(v.vms[k].Console(), "\n") {
		if strings.HasPrefix(l, "SHUNT-VM LOG shunt: ") && strings.Contains(l, ": rings ") {
			return true
		}
	}
	return false
}

// TestAcrossHostsVM: a QEMU (TCG) VM on each of the two hosts streams
// checked data both ways to the other for 30 s (the agent's duplex modes:
// every byte compared at its offset, CRC32 of each direction), and the
// connection goes through both hosts' relays: `hostd flows` shows it on
// the rings "via relay PEER" on both hosts, each relay's ring pair
// carries bytes both ways, both VMs took their rings (READY), and each
// VM received exactly what the other sent. Two VMs (not a VM and a
// namespace guest): the relay's VM end (kicks through hostd, the group
// region) is what the test is for, on both hosts, and two TCG VMs fit
// the budget (about 45 s here).
func TestAcrossHostsVM(t *testing.T) {
	v := newVMPair(t)
	const port, secs = 7300, 30
	a2, _ := vmAddr(1)
	v.boot(1, "duplex-server", fmt.Sprint(port), fmt.Sprint(secs))
	v.wait(1, "SHUNT-VM LISTENING", 90*time.Second)
	v.boot(0, "duplex-client", fmt.Sprintf("%s:%d", a2, port), fmt.Sprint(secs))
	v.wait(0, "SHUNT-VM PATH", 90*time.Second)

	// On the rings through both relays, carrying bytes both ways on each
	// host, while the stream runs.
	deadline := time.Now().Add(secs * time.Second)
	const some = 1 << 20
	for {
		a, okA := v.connOn(0, port)
		b, okB := v.connOn(1, port)
		if okA && okB && a.Path == "rings" && b.Path == "rings" && a.Via == "relay h2" && b.Via == "relay h1" &&
			a.RingsAB > some && a.RingsBA > some && b.RingsAB > some && b.RingsBA > some && v.tookRings(0) && v.tookRings(1) {
			t.Logf("h1: %s %s via %s, rings ab %d ba %d; h2: %s %s via %s, rings ab %d ba %d",
				a.Name, a.Path, a.Via, a.RingsAB, a.RingsBA, b.Name, b.Path, b.Via, b.RingsAB, b.RingsBA)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the VMs' connection is not on both relays carrying %d bytes each way within %s (VMs took rings: %v %v)\n%s",
				some, time.Duration(secs)*time.Second, v.tookRings(0), v.tookRings(1), v.flows())
		}
		time.Sleep(100 * time.Millisecond)
	}

	// Each VM got exactly what the other sent.
	var got [2][4]int64
	for k := range 2 {
		line := v.wait(k, "SHUNT-VM DUPLEX", 90*time.Second)
		if _, err := fmt.Sscanf(line, "SHUNT-VM DUPLEX SENT %d %d RECV %d %d", &got[k][0], &got[k][1], &got[k][2], &got[k][3]); err != nil {
			t.Fatalf("h%d/vm: %q: %v", k+1, line, err)
		}
	}
	if got[0][0] != got[1][2] || got[0][1] != got[1][3] || got[1][0] != got[0][2] || got[1][1] != got[0][3] {
		t.Fatalf("h1/vm sent %d bytes (crc %d) and received %d (crc %d); h2/vm sent %d (crc %d) and received %d (crc %d): they must match crosswise\n%s",
			got[0][0], got[0][1], got[0][2], got[0][3], got[1][0], got[1][1], got[1][2], got[1][3], v.flows())
	}
	t.Logf("h1/vm -> h2/vm %d bytes, h2/vm -> h1/vm %d bytes, checksums equal", got[0][0], got[1][0])
}
