package integration

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// pairMigOpts are the options of VM i of a pair-region environment
// (newPairVMEnvLinger) as a Migratable VM with the given tap, control and
// QMP sockets, and incoming for a migration's destination; as
// bootPairVM's, no ivshmem device at boot.
func (v *vmEnv) pairMigOpts(i int, tap, control, qmp, incoming string, args ...string) vm.Options {
	a, h := vmAddr(i)
	return vm.Options{
		Name: fmt.Sprintf("vm%d", i), Kernel: v.kernel, Initramfs: v.initrd, HostNS: v.rig.HostNSPath(),
		Tap: tap, Addr: a, Host: h, Args: args, Migratable: true, QMP: qmp, Incoming: incoming,
		Attach: vhost.Attachment{Control: vserial.Port{ID: "shunt0", Socket: control, Ports: vmPorts}},
	}
}

// barIDsRE finds the region ids in a BARS line's devices ("ID:A-B").
var barIDsRE = regexp.MustCompile(`(\d+):\d+-\d+`)

// barIDs returns the region ids of m's devices in each BARS line after
// the first from console lines, in order.
func barIDs(m *vm.VM, from int) [][]string {
	var out [][]string
	lines := strings.Split(m.Console(), "\n")
	for _, l := range lines[min(from, len(lines)):] {
		x := barsRE.FindStringSubmatch(l)
		if x == nil {
			continue
		}
		ids := []string{}
		for _, d := range barIDsRE.FindAllStringSubmatch(x[2], -1) {
			ids = append(ids, d[1])
		}
		out = append(out, ids)
	}
	return out
}

// TestVMPairMigration: vm2 of a pair-region group (vm_regions = "pair",
// pair_region_linger 10 min) migrates to a second QEMU on this host (its
// own tap, control and QMP sockets) under a checked stream each way with
// vm1 (docs/vm.md, "Live migration"). hostd migrate-out moves the
// connection to TCP and, once it left the rings, drops the pair's region
// at once (not after its linger): UNREGION to both, the device unplugged
// from both VMs, before it answers. The test unplugs nothing itself. vm2
// migrates (vm.Paused unless SHUNT_TEST_MIGRATION=live), and hostd
// migrate-in gets the destination's control socket and QMP socket. Shown:
// migrate-out's reply counts one region unplugged and none left; neither
// QEMU has an ivshmem device then, and the destination none after its
// arrival; the guests' PCI devices (the agent's BARS lines) never hold the
// old region again, vm1 never both; hostd plugs a fresh region (a new id)
// into vm1 and the destination, and the connection is back on the rings
// in it with both ends attached and bytes on the new rings; equal
// checksums, no error in either VM.
func TestVMPairMigration(t *testing.T) {
	mode := migrationMode(t)
	v := newPairVMEnvLinger(t, 2, "10m")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const port, secs = 7009, 45
	a1, _ := vmAddr(1)
	srv := v.bootPairVM(1, "bars", "duplex-server", fmt.Sprint(port), fmt.Sprint(secs))
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	tap := fmt.Sprintf("shvm%d-2", rigSeq)
	cli := []string{"bars", "duplex-client", fmt.Sprintf("%s:%d", a1, port), fmt.Sprint(secs)}
	src := v.bootOpts(v.pairMigOpts(2, tap, filepath.Join(v.Dir, "vm2.sock"), filepath.Join(v.Dir, "vm2.qmp"), "", cli...))
	v.fastPair(ctx, port, srv, src)
	waitBars(t, ctx, src, "the pair's region plugged into vm2", "101-102")
	waitBars(t, ctx, srv, "the pair's region plugged into vm1", "101-102")
	v.waitRecord(port, 30*time.Second, "ring bytes both ways", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.RingsAB > 0 && r.RingsBA > 0
	})
	before, _ := v.record(port)
	old := barIDs(src, 0)
	oldID := old[len(old)-1][0]

	// 1. hostd moves vm2's connection to TCP and unplugs the pair's
	// region from both VMs.
	var out admin.MigrateReply
	start := time.Now()
	if err := admin.Call(v.Admin, admin.Request{Cmd: admin.CmdMigrateOut, Guest: "vm2"}, &out); err != nil {
		t.Fatal(err)
	}
	tOut := time.Since(start)
	if out.Moved != 1 || out.Held != 0 || out.Unplugged != 1 || out.Plugged != 0 {
		t.Fatalf("migrate-out: %+v; want 1 connection moved, no ring pair held, 1 pair region unplugged, none left", out)
	}
	if r, ok := v.record(port); !ok || r.Path != "tcp" || r.Reason != "migrating" || r.Ring != 0 {
		t.Fatalf("record after migrate-out: %+v (present %v); want on TCP (migrating), its rings freed", r, ok)
	}
	q, err := src.QMP(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if devs, err := q.Ivshmems(ctx); err != nil || len(devs) != 0 {
		t.Fatalf("vm2's QEMU after migrate-out: ivshmem devices %+v (%v); want none: hostd unplugs the pair's region", devs, err)
	}
	waitBars(t, ctx, src, "vm2's guest saw its device go")
	waitBars(t, ctx, srv, "vm1's guest saw its device go")
	if n := len(v.hostdLines("pair region dropped: its guest migrates")); n != 1 {
		t.Fatalf("hostd logged %d pair regions dropped for the migration, want 1", n)
	}

	// 2. the destination (no ivshmem device), 3. the migration.
	uri := "unix:" + filepath.Join(v.Dir, "migrate.sock")
	dtap, dctl, dqmp := tap+"m", filepath.Join(v.Dir, "vm2m.sock"), filepath.Join(v.Dir, "vm2m.qmp")
	dst, tMig, downtime := v.migrateTo(ctx, src, v.pairMigOpts(2, dtap, dctl, dqmp, uri, cli...), mode)
	dq, err := dst.QMP(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if devs, err := dq.Ivshmems(ctx); err != nil || len(devs) != 0 {
		t.Fatalf("the destination after its arrival: ivshmem devices %+v (%v); want none until hostd plugs one", devs, err)
	}
	dst.CloseQMP() // QEMU serves one QMP client: hostd's now
	arrived := dst.Lines()

	// 4. hostd serves the new control socket and plugs through the new
	// QMP socket: a fresh region for the pair, the connection back on the
	// rings in it.
	start = time.Now()
	var in admin.MigrateReply
	if err := admin.Call(v.Admin, admin.Request{Cmd: admin.CmdMigrateIn, Guest: "vm2", Control: dctl, QMP: dqmp}, &in); err != nil {
		t.Fatal(err)
	}
	r := v.waitRecord(port, 60*time.Second, "the record back on the rings, both ends attached", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.Path == "rings" && r.Attached == "ab" && r.Switches > before.Switches
	})
	tBack := time.Since(start)
	waitBars(t, ctx, dst, "a fresh region plugged into the destination", "101-102")
	waitBars(t, ctx, srv, "a fresh region plugged into vm1", "101-102")
	ringsAB, ringsBA := r.RingsAB, r.RingsBA
	v.waitRecord(port, 60*time.Second, "ring bytes both ways after the migration", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.RingsAB > ringsAB && r.RingsBA > ringsBA
	})
	t.Logf("migrate-out %v (hostd: %s, its region unplugged from both VMs included), migration %v (%s, downtime %v), back on the rings %v after migrate-in; record %+v",
		tOut.Round(time.Millisecond), out.Took, tMig.Round(time.Millisecond), mode, downtime, tBack.Round(time.Millisecond), r)

	// The streams end: checksums equal, no error in any of the consoles.
	vmDuplexDone(t, ctx, srv, dst)
	for _, m := range []*vm.VM{srv, src, dst} {
		if m.Has(0, "SHUNT-VM ERROR") || m.Has(0, "SHUNT-VM READERR") {
			t.Fatalf("%s: the application saw an error:\n%s", m.Name, m.Console())
		}
	}
	// The old region never in the destination; the new one is another;
	// vm1 never had both.
	var newID string
	for _, ids := range barIDs(dst, arrived) {
		if slices.Contains(ids, oldID) {
			t.Fatalf("the destination had the old region %s's device: %v", oldID, barIDs(dst, arrived))
		}
		if len(ids) > 0 {
			newID = ids[0]
		}
	}
	if newID == "" || newID == oldID {
		t.Fatalf("the destination's devices %v: want a fresh region, not %s", barIDs(dst, arrived), oldID)
	}
	for _, ids := range barIDs(srv, 0) {
		if len(ids) > 1 {
			t.Fatalf("vm1 had two regions of the pair at once: %v", barIDs(srv, 0))
		}
	}
	t.Logf("the pair's region %s before the migration, %s after", oldID, newID)
}
