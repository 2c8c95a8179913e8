package integration

import (
	"cmp"
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/vhost/ivshmem"
)

// The tests below isolate QEMU's part of a live migration from Shunt's
// (the guest runs with Shunt disabled: plain TCP, nothing mapped), for
// the flake docs/vm.md describes ("Migrating paused"): a guest migrated
// live sometimes dies on the destination, with or without the device. They take a
// minute or more each: SHUNT_VM_DIAG=1 runs them, and
//
//	SHUNT_VM_DIAG_MODE   paused (default, as the VM tests migrate), live or
//	                     live-early (vm.Mode)
//	SHUNT_VM_DIAG_HOPS   hops per run (default 6)
//	SHUNT_VM_DIAG_ACCEL  QEMU's -accel (default tcg), e.g. tcg,thread=single
//
// choose what they do. Each hop checks that the guest is alive on the
// destination (it answers a ping from the host within 15 s, and printed
// no kernel oops), again before the next hop, and, with the device, that
// it ejects it then (within 30 s); at the end, both ends of the stream
// must report equal checksums (an oops may kill only the agent). A run
// ends at the first guest lost, and logs a line "DIAG mode=M accel=A
// device=D hops=N lost=L" either way (N: migrations done, L: 1 if the
// run failed: one of them lost the guest), for counting over runs
// (docs/vm.md has the command).
func needDiag(t *testing.T) {
	if os.Getenv("SHUNT_VM_DIAG") != "1" {
		t.Skip("a diagnostic of QEMU's hotplug and migration: SHUNT_VM_DIAG=1 runs it")
	}
}

// TestVMMigrationControlTCP: vm2 without an ivshmem device, migrated
// SHUNT_VM_DIAG_HOPS times in a row under a checked TCP stream.
func TestVMMigrationControlTCP(t *testing.T) { migControl(t, false) }

// TestVMMigrationControlDevice: the same with the device unplugged before
// each hop and plugged back after.
func TestVMMigrationControlDevice(t *testing.T) { migControl(t, true) }

func migControl(t *testing.T, withDev bool) {
	needDiag(t)
	mode, hops, accel := vm.Paused, 6, os.Getenv("SHUNT_VM_DIAG_ACCEL")
	switch m := os.Getenv("SHUNT_VM_DIAG_MODE"); m {
	case "", "paused":
	case "live":
		mode = vm.Live
	case "live-early":
		mode = vm.LiveEarly
	default:
		t.Fatalf("SHUNT_VM_DIAG_MODE=%q: want paused, live or live-early", m)
	}
	if h := os.Getenv("SHUNT_VM_DIAG_HOPS"); h != "" {
		n, err := strconv.Atoi(h)
		if err != nil || n < 1 {
			t.Fatalf("SHUNT_VM_DIAG_HOPS=%q: want a count", h)
		}
		hops = n
	}
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute+time.Duration(hops)*20*time.Second)
	defer cancel()
	const port = 7007
	secs := 6*hops + 20 // the stream outlasts the hops
	a1, _ := vmAddr(1)
	a2, _ := vmAddr(2)
	srv := v.boot(1, "duplex-server", fmt.Sprint(port), fmt.Sprint(secs))
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	args := []string{"tcp", "duplex-client", fmt.Sprintf("%s:%d", a1, port), fmt.Sprint(secs)}
	o := v.migOpts(2, fmt.Sprintf("shvm%d-2", rigSeq), filepath.Join(v.Dir, "vm2.sock"), "", args...)
	o.Accel = accel
	if !withDev {
		o.Attach.Region = ivshmem.Device{}
	}
	cur := v.bootOpts(o)
	mustWait(t, ctx, cur, "SHUNT-VM PATH")
	migrated := 0
	defer func() {
		t.Logf("DIAG mode=%s accel=%s device=%v hops=%d lost=%d", mode, cmp.Or(accel, "tcg"), withDev, migrated, btoi(t.Failed()))
	}()
	for hop := range hops {
		time.Sleep(2 * time.Second) // pacing: the stream runs between hops
		// An oops may come after the last hop's check.
		if err := v.guestAlive(cur, a2, 15*time.Second); err != nil {
			t.Fatalf("before hop %d (%s): the guest is lost: %v; console:\n%s", hop, mode, err, cur.Console())
		}
		if withDev {
			// A guest that died after the last check does not eject.
			uctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			_, err := cur.Unplug(uctx, "shunt0")
			cancel()
			if err != nil {
				t.Fatalf("before hop %d: %v; console:\n%s", hop, err, cur.Console())
			}
		}
		uri := "unix:" + filepath.Join(v.Dir, fmt.Sprintf("mig%d.sock", hop))
		d := v.migOpts(2, fmt.Sprintf("shvm%d-2x%d", rigSeq, hop), filepath.Join(v.Dir, fmt.Sprintf("vm2x%d.sock", hop)), uri, args...)
		d.Attach.Region, d.Accel = ivshmem.Device{}, accel
		next := v.bootOpts(d)
		if _, err := next.QMP(ctx); err != nil {
			t.Fatal(err)
		}
		took, down, err := cur.Migrate(ctx, next, uri, mode)
		if err != nil {
			t.Fatal(err)
		}
		migrated++
		cur.Stop()
		if err := vm.HostSide(d); err != nil {
			t.Fatalf("hop %d: %v", hop, err)
		}
		if withDev {
			if err := next.Plug(ctx, v.region()); err != nil {
				t.Fatal(err)
			}
		}
		cur = next
		if err := v.guestAlive(cur, a2, 15*time.Second); err != nil {
			t.Fatalf("hop %d (%s): the guest is lost on the destination: %v; console:\n%s", hop, mode, err, cur.Console())
		}
		t.Logf("hop %d: %v (downtime %v)", hop, took, down)
	}
	vmDuplexDone(t, ctx, srv, cur)
}

// guestAlive checks that m's guest (at a) runs: it answers a ping from
// the host within bound, and its console shows no kernel oops or panic.
func (v *vmEnv) guestAlive(m *vm.VM, a netip.Addr, bound time.Duration) error {
	for deadline := time.Now().Add(bound); ; {
		for _, bad := range []string{"Kernel panic", "BUG: ", "Oops", "general protection fault", "stack-protector"} {
			if strings.Contains(m.Console(), bad) {
				return fmt.Errorf("%q on its console", bad)
			}
		}
		out, err := nsrig.Run(v.rig.HostNSPath(), "busybox", "ping", "-c", "1", "-W", "1", a.String())
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no answer to ping within %s: %w (%s)", bound, err, out)
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestVMHotplugCyclesDiag: the ivshmem device unplugged and plugged back
// 8 times in a running VM (no migration), under a TCP stream.
func TestVMHotplugCyclesDiag(t *testing.T) {
	needDiag(t)
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const port, secs = 7008, 40
	a1, _ := vmAddr(1)
	srv := v.boot(1, "duplex-server", fmt.Sprint(port), fmt.Sprint(secs))
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	args := []string{"tcp", "duplex-client", fmt.Sprintf("%s:%d", a1, port), fmt.Sprint(secs)}
	cli := v.bootOpts(v.migOpts(2, fmt.Sprintf("shvm%d-2", rigSeq), filepath.Join(v.Dir, "vm2.sock"), "", args...))
	mustWait(t, ctx, cli, "SHUNT-VM PATH")
	for i := range 8 {
		time.Sleep(time.Second) // pacing: the stream runs between cycles
		took, err := cli.Unplug(ctx, "shunt0")
		if err != nil {
			t.Fatal(err)
		}
		if err := cli.Plug(ctx, v.region()); err != nil {
			t.Fatal(err)
		}
		t.Logf("cycle %d: unplug %v", i, took)
	}
	vmDuplexDone(t, ctx, srv, cli)
}
