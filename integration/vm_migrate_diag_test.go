package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/vm"
	"github.com/shuntnet/shunt/vhost/ivshmem"
)

// The tests below isolate QEMU's part of a live migration from Shunt's
// (the guest runs with Shunt disabled: plain TCP, nothing mapped), for
// the flake docs/vm.md describes ("Live migration"): a guest migrated
// after an unplug sometimes dies on the destination. They take a minute
// each: SHUNT_VM_DIAG=1 runs them.
func needDiag(t *testing.T) {
	if os.Getenv("SHUNT_VM_DIAG") != "1" {
		t.Skip("a diagnostic of QEMU's hotplug and migration: SHUNT_VM_DIAG=1 runs it")
	}
}

// TestVMMigrationControlTCP: vm2 without an ivshmem device, migrated 6
// times in a row under a checked TCP stream.
func TestVMMigrationControlTCP(t *testing.T) { migControl(t, false) }

// TestVMMigrationControlDevice: the same with the device unplugged before
// each hop and plugged back after.
func TestVMMigrationControlDevice(t *testing.T) { migControl(t, true) }

func migControl(t *testing.T, withDev bool) {
	needDiag(t)
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const port, secs = 7007, 50
	a1, _ := vmAddr(1)
	srv := v.boot(1, "duplex-server", fmt.Sprint(port), fmt.Sprint(secs))
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	args := []string{"tcp", "duplex-client", fmt.Sprintf("%s:%d", a1, port), fmt.Sprint(secs)}
	o := v.migOpts(2, fmt.Sprintf("shvm%d-2", rigSeq), filepath.Join(v.Dir, "vm2.sock"), "", args...)
	if !withDev {
		o.Attach.Region = ivshmem.Device{}
	}
	cur := v.bootOpts(o)
	mustWait(t, ctx, cur, "SHUNT-VM PATH")
	for hop := range 6 {
		time.Sleep(2 * time.Second) // pacing: the stream runs between hops
		if withDev {
			if _, err := cur.Unplug(ctx, "shunt0"); err != nil {
				t.Fatal(err)
			}
		}
		uri := "unix:" + filepath.Join(v.Dir, fmt.Sprintf("mig%d.sock", hop))
		d := v.migOpts(2, fmt.Sprintf("shvm%d-2%c", rigSeq, 'a'+hop), filepath.Join(v.Dir, fmt.Sprintf("vm2%c.sock", 'a'+hop)), uri, args...)
		d.Attach.Region = ivshmem.Device{}
		next := v.bootOpts(d)
		if _, err := next.QMP(ctx); err != nil {
			t.Fatal(err)
		}
		took, down, err := cur.Migrate(ctx, uri)
		if err != nil {
			t.Fatal(err)
		}
		cur.Stop()
		if err := vm.HostSide(d); err != nil {
			t.Fatalf("hop %d: %v", hop, err)
		}
		if withDev {
			if err := next.Plug(ctx, v.region()); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("hop %d: %v (downtime %v)", hop, took, down)
		cur = next
	}
	vmDuplexDone(t, ctx, srv, cur)
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
