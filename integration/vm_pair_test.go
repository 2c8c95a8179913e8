package integration

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/internal/testenv"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// newPairVMEnv is newVMEnv for n VMs of a trust group with pair regions
// for VMs (vm_regions = "pair"): each VM's QEMU has a QMP socket
// (dir/vmN.qmp, named in hostd.hcl), through which hostd plugs each VM
// pair's region into both VMs, and no ivshmem device at boot. Pair
// regions go 1 s after their last flow (pair_region_linger).
func newPairVMEnv(t testing.TB, n int) *vmEnv { return newPairVMEnvLinger(t, n, "1s") }

// newPairVMEnvLinger is newPairVMEnv with pair_region_linger = linger.
func newPairVMEnvLinger(t testing.TB, n int, linger string) *vmEnv {
	dir, k, agent, initrd := vmImages(t)
	conf := fmt.Sprintf("pair_region_linger = %q\n", linger)
	for i := 1; i <= n; i++ {
		a, _ := vmAddr(i)
		conf += fmt.Sprintf("guest \"vm%d\" {\n  id = %d\n  group = \"t\"\n  control = %q\n  control_ports = %d\n  addresses = [%q]\n  shared_region = true\n  qmp = %q\n}\n",
			i, 100+i, filepath.Join(dir, fmt.Sprintf("vm%d.sock", i)), vmPorts, a, filepath.Join(dir, fmt.Sprintf("vm%d.qmp", i)))
	}
	group := "  vm_regions = \"pair\"\n  pair_region_size = \"16MiB\"\n  pair_slots = 64\n  guest_ring_bytes = \"64MiB\"\n  guest_flows = 64\n"
	return &vmEnv{env: startVMStack(t, dir, conf, group), tb: t, kernel: k, initrd: initrd, agent: agent}
}

// bootPairVM boots VM i of a newPairVMEnv: its control ports and its QMP
// socket, no ivshmem device.
func (v *vmEnv) bootPairVM(i int, args ...string) *vm.VM {
	v.tb.Helper()
	a, h := vmAddr(i)
	return v.bootOpts(vm.Options{
		Name: fmt.Sprintf("vm%d", i), Kernel: v.kernel, Initramfs: v.initrd, HostNS: v.rig.HostNSPath(),
		Tap: fmt.Sprintf("shvm%d-%d", rigSeq, i), Addr: a, Host: h, Args: args,
		Migratable: true, QMP: filepath.Join(v.Dir, fmt.Sprintf("vm%d.qmp", i)),
		Attach: vhost.Attachment{Control: vserial.Port{ID: "shunt0", Socket: filepath.Join(v.Dir, fmt.Sprintf("vm%d.sock", i)), Ports: vmPorts}},
	})
}

// barsRE parses the agent's BARS lines: the VM's ivshmem devices by the
// region id and pair their headers name, and guestlib's mapped regions.
var barsRE = regexp.MustCompile(`^SHUNT-VM BARS (\d+) \[([^\]]*)\] REGIONS \[([^\]]*)\]$`)

// bars is one BARS line: the pairs ("101-102") of the VM's devices, and
// the region ids guestlib has mapped.
type bars struct {
	pairs   []string
	regions string
}

// allBars returns every BARS line m's agent said, in order.
func allBars(m *vm.VM) []bars {
	var out []bars
	for _, l := range strings.Split(m.Console(), "\n") {
		x := barsRE.FindStringSubmatch(l)
		if x == nil {
			continue
		}
		var b bars
		for _, d := range strings.Fields(x[2]) {
			_, pair, _ := strings.Cut(d, ":")
			b.pairs = append(b.pairs, pair)
		}
		slices.Sort(b.pairs)
		b.regions = x[3]
		out = append(out, b)
	}
	return out
}

// waitBars waits until m's devices are the pairs want (sorted), and
// guestlib has as many regions mapped; it returns when that was seen.
func waitBars(t *testing.T, ctx context.Context, m *vm.VM, what string, want ...string) time.Time {
	t.Helper()
	for {
		if bs := allBars(m); len(bs) > 0 {
			last := bs[len(bs)-1]
			if slices.Equal(last.pairs, want) && len(strings.Fields(last.regions)) == len(want) {
				return time.Now()
			}
		}
		if ctx.Err() != nil {
			t.Fatalf("%s: %s: want devices of pairs %v, mapped; BARS lines: %+v", m.Name, what, want, allBars(m))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// hostdLines returns hostd's log lines that contain s.
func (v *vmEnv) hostdLines(s string) []string {
	var out []string
	for _, l := range strings.Split(v.Log(), "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return out
}

// duplexResult parses a "tag SENT n crc RECV m crc" line of m.
func duplexResult(t *testing.T, ctx context.Context, m *vm.VM, tag string) [4]int64 {
	t.Helper()
	line, err := m.WaitAny(ctx, 0, "SHUNT-VM "+tag+" ", "SHUNT-VM ERROR")
	if err != nil {
		t.Fatal(err)
	}
	var r [4]int64
	if _, err := fmt.Sscanf(line, "SHUNT-VM "+tag+" SENT %d %d RECV %d %d", &r[0], &r[1], &r[2], &r[3]); err != nil {
		t.Fatalf("%s: %s", m.Name, line)
	}
	return r
}

// crosswise checks that what each end of a duplex stream sent is what
// the other received, bytes and checksums, and that the rings carried
// some.
func crosswise(t *testing.T, what string, x, y [4]int64) {
	t.Helper()
	if x[0] != y[2] || x[1] != y[3] || y[0] != x[2] || y[1] != x[3] || x[0] == 0 || y[0] == 0 {
		t.Fatalf("%s: one end sent %d bytes (crc %d) and received %d (crc %d); the other sent %d (crc %d) and received %d (crc %d): they must match crosswise",
			what, x[0], x[1], x[2], x[3], y[0], y[1], y[2], y[3])
	}
	t.Logf("%s: %d bytes one way, %d the other, checksums equal", what, x[0], y[0])
}

// TestVMPairRegions: three VMs of a trust group with vm_regions = "pair"
// (docs/vm.md, "Pair regions"). vm1 (A) accepts a checked stream each way
// from vm2 (B, 60 s) and from vm3 (C, 8 s, started while A-B runs). Each
// pair's first connection starts on TCP while hostd plugs a region of the
// pair's own into both VMs (QMP object-add + device_add), then moves to
// the rings (READY), and the time from connect to the rings is logged
// (the hotplug's cost). Checked: both connections on the fast path with
// equal checksums; B's PCI devices only ever show the A-B region, C's
// only the A-C one, A's both while both run (so B cannot map A-C's
// region: it is not in B's machine); the A-C region unplugged from A and
// C after its connection closed while A-B's stream still runs; and the
// A-B region unplugged from both after it closed. hostd is killed and
// restarted under A-B (after A-C's unplug): it adopts the A-B region, the
// ends reattach, and it is still unplugged at the end.
func TestVMPairRegions(t *testing.T) {
	v := newPairVMEnv(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	const abSecs, acSecs = 60, 8
	vmA := v.bootPairVM(1, "bars", "duplex-servers", "7001", fmt.Sprint(abSecs), "7002", fmt.Sprint(acSecs), "7003", "3")
	mustWait(t, ctx, vmA, "SHUNT-VM LISTENING")
	waitBars(t, ctx, vmA, "at boot: no ivshmem device")

	// B's second connection (7003, 3 s) comes once the first is on the
	// rings: the pair's region is plugged already, so it shows what a
	// first connection costs without the plug.
	vmB := v.bootPairVM(2, "bars", "timed-client", fmt.Sprintf("%s:7001", a1), fmt.Sprint(abSecs), fmt.Sprintf("%s:7003", a1), "3")
	fastB := mustWait(t, ctx, vmB, "SHUNT-VM FAST 0 ")
	fastB2 := mustWait(t, ctx, vmB, "SHUNT-VM FAST 1 ")
	v.waitRecord(7001, vmFastBound, "A-B on the rings", func(r broker.FlowInfo, ok bool) bool { return ok && r.Path == "rings" && r.Attached == "ab" })
	waitBars(t, ctx, vmB, "A-B plugged", "101-102")
	waitBars(t, ctx, vmA, "A-B plugged", "101-102")
	crosswise(t, "A-B (second connection)", duplexResult(t, ctx, vmA, "DUPLEX-7003"), duplexResult(t, ctx, vmB, "DUPLEX-1"))
	plugAB := v.hostdLines("pair region plugged into its VMs")

	vmC := v.bootPairVM(3, "bars", "timed-client", fmt.Sprintf("%s:7002", a1), fmt.Sprint(acSecs))
	fastC := mustWait(t, ctx, vmC, "SHUNT-VM FAST 0 ")
	v.waitRecord(7002, vmFastBound, "A-C on the rings", func(r broker.FlowInfo, ok bool) bool { return ok && r.Path == "rings" && r.Attached == "ab" })
	waitBars(t, ctx, vmC, "A-C plugged", "101-103")
	waitBars(t, ctx, vmA, "A-C plugged next to A-B", "101-102", "101-103")
	if vmB.Has(0, "SHUNT-VM DUPLEX SENT") {
		t.Fatal("A-B's stream ended before A-C's region was plugged: nothing checked traffic during the plug")
	}

	// A-C ends; its region goes from A and C while A-B streams on.
	crosswise(t, "A-C", duplexResult(t, ctx, vmA, "DUPLEX-7002"), duplexResult(t, ctx, vmC, "DUPLEX"))
	closedAC := time.Now()
	waitBars(t, ctx, vmA, "A-C unplugged from A", "101-102")
	waitBars(t, ctx, vmC, "A-C unplugged from C")
	unpluggedAC := time.Now()
	if vmB.Has(0, "SHUNT-VM DUPLEX SENT") || vmB.Has(0, "SHUNT-VM ERROR") {
		t.Fatalf("A-B's stream ended (or failed) before A-C's region was unplugged:\n%s", vmB.Console())
	}
	if r, ok := v.record(7001); !ok || r.Path != "rings" {
		t.Fatalf("A-B left the rings while A-C's region was unplugged: %+v", r)
	}

	// hostd killed and restarted under A-B: it adopts the pair region
	// (still plugged into both VMs) and its flow; both ends reattach.
	v.killHostd()
	v.startHostd()
	v.waitRecord(7001, 20*time.Second, "A-B reattached to the restarted hostd", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.Attached == "ab" && r.State == "ready"
	})
	if bs := allBars(vmA); !slices.Equal(bs[len(bs)-1].pairs, []string{"101-102"}) {
		t.Fatalf("vm1 (A) devices after the restart: %+v, want only A-B's", bs[len(bs)-1])
	}

	crosswise(t, "A-B", duplexResult(t, ctx, vmA, "DUPLEX-7001"), duplexResult(t, ctx, vmB, "DUPLEX"))
	// The adopted region goes too (found in the VMs by its file).
	waitBars(t, ctx, vmA, "A-B unplugged from A")
	waitBars(t, ctx, vmB, "A-B unplugged from B")

	for _, b := range allBars(vmB) {
		if slices.Contains(b.pairs, "101-103") {
			t.Fatalf("vm2 (B) had A-C's region in its machine: %+v", allBars(vmB))
		}
	}
	for _, b := range allBars(vmC) {
		if slices.Contains(b.pairs, "101-102") {
			t.Fatalf("vm3 (C) had A-B's region in its machine: %+v", allBars(vmC))
		}
	}
	for _, m := range []*vm.VM{vmA, vmB, vmC} {
		if m.Has(0, "SHUNT-VM ERROR") || m.Has(0, "SHUNT-VM READERR") {
			t.Fatalf("%s: the application saw an error:\n%s", m.Name, m.Console())
		}
	}
	// The hotplug's cost on first connect.
	t.Logf("connect to the rings: A-B first (plug included) %s ms, A-B second (region plugged already) %s ms, A-C first (plug included, A busy) %s ms",
		strings.TrimPrefix(fastB, "SHUNT-VM FAST 0 "), strings.TrimPrefix(fastB2, "SHUNT-VM FAST 1 "), strings.TrimPrefix(fastC, "SHUNT-VM FAST 0 "))
	for _, l := range v.hostdLines("pair region plugged into its VMs") {
		t.Logf("hostd: %s", l)
	}
	for _, m := range []*vm.VM{vmA, vmB, vmC} {
		for _, l := range strings.Split(m.Console(), "\n") {
			if strings.Contains(l, "mapped from") {
				t.Logf("%s: %s", m.Name, l)
			}
		}
	}
	for _, l := range v.hostdLines("pair region unplugged") {
		t.Logf("hostd: %s", l)
	}
	t.Logf("A-C's region out of both VMs %v after its stream ended (pair_region_linger 1s included)", unpluggedAC.Sub(closedAC).Round(time.Millisecond))
	if len(plugAB) != 1 {
		t.Fatalf("hostd plugged %d regions for A-B's first connection, want 1: %q", len(plugAB), plugAB)
	}
}

// TestVMGroupRegionFirstConnect is TestVMPairRegions' baseline: the time
// from connect to the rings for a first connection between two VMs of a
// group region (nothing to plug), measured the same way (the agent's
// FAST line), so that the two tests' logs give the hotplug's cost.
func TestVMGroupRegionFirstConnect(t *testing.T) {
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	srv := v.boot(1, "duplex-servers", "7001", "3")
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	cli := v.boot(2, "timed-client", fmt.Sprintf("%s:7001", a1), "3")
	fast := mustWait(t, ctx, cli, "SHUNT-VM FAST 0 ")
	crosswise(t, "vm1-vm2", duplexResult(t, ctx, srv, "DUPLEX-7001"), duplexResult(t, ctx, cli, "DUPLEX"))
	t.Logf("first connect to the rings, group region (no plug): %s ms", strings.TrimPrefix(fast, "SHUNT-VM FAST 0 "))
}

// TestVMPreloadPairRegion: the C library in two VMs of a pair-region
// group. iperf3 under it in each VM: the library finds the device hostd
// plugged for the pair by its region header (the C core's discovery, as
// guestlib's bar.go), and iperf3's connections take the rings.
func TestVMPreloadPairRegion(t *testing.T) {
	testenv.NeedTool(t, "iperf3", "iperf3")
	needPreload(t)
	v := newPairVMEnv(t, 2)
	iperf3, _ := exec.LookPath("iperf3")
	initrd := filepath.Join(t.TempDir(), "initramfs-preload")
	if err := vm.BuildInitramfs(initrd, v.kernel, v.agent, preloadLib, iperf3); err != nil {
		t.Fatal(err)
	}
	v.initrd = initrd
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	srv := v.bootPairVM(1, "run", preloadLib, iperf3, "-s", "-1", "-p", "5201", "--forceflush")
	eventually(t, time.Minute, "vm1's iperf3 listening in hostd", func() bool { return len(v.guest("vm1").Listening) == 1 })
	cli := v.bootPairVM(2, "run", preloadLib, iperf3, "-c", a1.String(), "-p", "5201", "-n", "64M", "-f", "m", "--forceflush")
	for _, m := range []*vm.VM{cli, srv} {
		if line := mustWait(t, ctx, m, "SHUNT-VM EXIT "); line != "SHUNT-VM EXIT 0" {
			t.Fatalf("%s: iperf3 %s\n%s", m.Name, line, m.Console())
		}
	}
	for _, m := range []*vm.VM{cli, srv} {
		c := m.Console()
		if !strings.Contains(c, "mapped from the device plugged for it") || !strings.Contains(c, ": shunt (slot") {
			t.Fatalf("%s: the library did not map the pair's device or no connection took the rings:\n%s", m.Name, c)
		}
		for _, l := range strings.Split(c, "\n") {
			if strings.Contains(l, "mapped from the device") || strings.Contains(l, "receiver") {
				t.Logf("%s: %s", m.Name, l)
			}
		}
	}
	if len(v.hostdLines("pair region plugged into its VMs")) != 1 {
		t.Fatalf("hostd plugged %d pair regions, want 1", len(v.hostdLines("pair region plugged into its VMs")))
	}
}
