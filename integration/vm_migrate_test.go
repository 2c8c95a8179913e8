package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/vhost"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/vserial"
)

// migOpts are the options of VM i as a Migratable VM: as bootWith's, with
// tap and control socket chosen by the caller (a migration's destination
// has its own), and incoming for a destination.
func (v *vmEnv) migOpts(i int, tap, control, incoming string, args ...string) vm.Options {
	a, h := vmAddr(i)
	return vm.Options{
		Name: fmt.Sprintf("vm%d", i), Kernel: v.kernel, Initramfs: v.initrd, HostNS: v.rig.HostNSPath(),
		Tap: tap, Addr: a, Host: h, Args: args, Migratable: true, Incoming: incoming,
		Attach: vhost.Attachment{
			Region:  v.region(),
			Control: vserial.Port{ID: "shunt0", Socket: control, Ports: vmPorts},
		},
	}
}

// region is the trust group's region as the VMs' ivshmem device.
func (v *vmEnv) region() ivshmem.Device {
	return ivshmem.Device{ID: "shunt0", Path: v.RegionPath(), Size: 32 << 20}
}

// bootOpts boots o (stopped with the test; its console is logged if the
// test fails).
func (v *vmEnv) bootOpts(o vm.Options) *vm.VM {
	v.tb.Helper()
	m, err := vm.Boot(o, func(c *exec.Cmd) error { return nsrig.Start(v.rig.HostNSPath(), c) })
	if err != nil {
		v.tb.Fatal(err)
	}
	v.tb.Cleanup(func() {
		v.failed(o.Name+" ("+o.Tap+")", m)
		m.Stop()
	})
	return m
}

// migrateTo boots the destination d (a QEMU started with -incoming
// d.Incoming), migrates src into it in mode, stops src (its tap goes with
// it) and sets up the destination's host side: the destination, how long
// the migration took, and its downtime.
func (v *vmEnv) migrateTo(ctx context.Context, src *vm.VM, d vm.Options, mode vm.Mode) (*vm.VM, time.Duration, time.Duration) {
	v.tb.Helper()
	dst := v.bootOpts(d)
	if _, err := dst.QMP(ctx); err != nil {
		v.tb.Fatal(err)
	}
	took, downtime, err := src.Migrate(ctx, dst, d.Incoming, mode)
	if err != nil {
		v.tb.Fatal(err)
	}
	src.Stop()
	if err := vm.HostSide(d); err != nil {
		v.tb.Fatal(err)
	}
	return dst, took, downtime
}

// migrationMode is how the VM tests migrate: vm.Paused, or vm.Live with
// SHUNT_TEST_MIGRATION=live (QEMU 7.2 under TCG sometimes loses a guest
// migrated live: docs/vm.md, "Migrating paused").
func migrationMode(t *testing.T) vm.Mode {
	switch m := os.Getenv("SHUNT_TEST_MIGRATION"); m {
	case "", "paused":
		return vm.Paused
	case "live":
		return vm.Live
	default:
		t.Fatalf("SHUNT_TEST_MIGRATION=%q: want paused (the default) or live", m)
		return 0
	}
}

// TestVMLiveMigration: a checked stream each way between vm1 and vm2 on
// the fast path, while vm2 migrates to a second QEMU on this host (its
// own tap and control socket): hostd moves vm2's connection to TCP and
// keeps it there (migrate-out), the ivshmem device is unplugged (QEMU
// refuses to migrate it), vm2 migrates, the device is plugged back, hostd
// serves vm2's new control socket and marks its new tap (migrate-in), and
// the connection returns to the rings. No error in either VM, equal
// checksums, the record back on the rings with both ends attached, and
// bytes on its new rings. The steps' times are logged. (The harness's
// VMs have no interface in hostd.hcl, since their taps appear after
// hostd starts, so hostd marks none of them here; the agent's
// TestRemarkKeepsMarkID covers the mark moving to the new tap.)
//
// vm2 migrates paused (vm.Paused; SHUNT_TEST_MIGRATION=live migrates it
// live): QEMU 7.2 under TCG sometimes loses a guest migrated live,
// with Shunt disabled too (docs/vm.md, "Migrating paused";
// the diagnostics in vm_migrate_diag_test.go).
func TestVMLiveMigration(t *testing.T) {
	mode := migrationMode(t)
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const port, secs = 7006, 60
	a1, _ := vmAddr(1)
	srv := v.boot(1, "duplex-server", fmt.Sprint(port), fmt.Sprint(secs))
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	tap := fmt.Sprintf("shvm%d-2", rigSeq)
	src := v.bootOpts(v.migOpts(2, tap, filepath.Join(v.Dir, "vm2.sock"), "", "duplex-client", fmt.Sprintf("%s:%d", a1, port), fmt.Sprint(secs)))
	v.fastPair(ctx, port, srv, src)
	v.waitRecord(port, 30*time.Second, "ring bytes both ways", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.RingsAB > 0 && r.RingsBA > 0
	})
	before, _ := v.record(port)

	// 1. hostd moves vm2's connections to TCP and waits until they left
	// the rings.
	var out admin.MigrateReply
	start := time.Now()
	if err := admin.Call(v.Admin, admin.Request{Cmd: admin.CmdMigrateOut, Guest: "vm2"}, &out); err != nil {
		t.Fatal(err)
	}
	if out.Moved != 1 || out.Held != 0 {
		t.Fatalf("migrate-out: %+v; want 1 connection moved, no ring pair held", out)
	}
	tOut := time.Since(start)
	v.waitRecord(port, 10*time.Second, "the record on TCP (migrating), its rings freed", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.Path == "tcp" && r.Reason == "migrating" && r.Ring == 0
	})

	// 2. unplug the region, 3. start the destination, 4. migrate.
	start = time.Now()
	tUnplug, err := src.Unplug(ctx, "shunt0")
	tReleased := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	uri := "unix:" + filepath.Join(v.Dir, "migrate.sock")
	dtap, dctl := tap+"m", filepath.Join(v.Dir, "vm2m.sock")
	dst, tMig, downtime := v.migrateTo(ctx, src, v.migOpts(2, dtap, dctl, uri, "duplex-client", fmt.Sprintf("%s:%d", a1, port), fmt.Sprint(secs)), mode)

	// 5. plug the region back, 6. hostd serves the new socket and tap.
	start = time.Now()
	if err := dst.Plug(ctx, v.region()); err != nil {
		t.Fatal(err)
	}
	tPlug := time.Since(start)
	start = time.Now()
	var in admin.MigrateReply
	if err := admin.Call(v.Admin, admin.Request{Cmd: admin.CmdMigrateIn, Guest: "vm2", Control: dctl, Interface: dtap}, &in); err != nil {
		t.Fatal(err)
	}
	r := v.waitRecord(port, 60*time.Second, "the record back on the rings, both ends attached", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.Path == "rings" && r.Attached == "ab" && r.Switches > before.Switches
	})
	tBack := time.Since(start)
	t.Logf("migrate-out %v (hostd: %s), unplug %v (QEMU let go after %v), migration %v (%s, downtime %v), plug %v, back on the rings %v after migrate-in; record %+v",
		tOut.Round(time.Millisecond), out.Took, tUnplug.Round(time.Millisecond), tReleased.Round(time.Millisecond), tMig.Round(time.Millisecond), mode, downtime,
		tPlug.Round(time.Millisecond), tBack.Round(time.Millisecond), r)
	ringsAB, ringsBA := r.RingsAB, r.RingsBA
	v.waitRecord(port, 60*time.Second, "ring bytes both ways after the migration", func(r broker.FlowInfo, ok bool) bool {
		return ok && r.RingsAB > ringsAB && r.RingsBA > ringsBA
	})

	// The streams end: checksums equal, no error in any of the consoles.
	vmDuplexDone(t, ctx, srv, dst)
	for _, m := range []*vm.VM{srv, src, dst} {
		if m.Has(0, "SHUNT-VM ERROR") || m.Has(0, "SHUNT-VM READERR") {
			t.Fatalf("%s: the application saw an error:\n%s", m.Name, m.Console())
		}
	}
	for _, l := range strings.Split(dst.Console(), "\n") {
		if strings.Contains(l, "region 0 mapped again") {
			t.Logf("vm2: %s", l) // the guest noticed its device was plugged back
		}
	}
	if !strings.Contains(srv.Console(), "back to tcp(migrating)") {
		t.Fatalf("vm1: no downgrade (migrating) logged:\n%s", srv.Console())
	}
}
