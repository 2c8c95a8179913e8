//go:build linux

package vm

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/qmp"
)

// HotplugAddr is the PCI slot of a Migratable VM's ivshmem device, fixed so
// that the device plugged back after a migration is where it was, and the
// other devices' slots do not depend on whether it is there (a migration's
// destination starts without it, and QEMU migrates only between machines
// with the same devices at the same addresses). The pc machine (i440fx)
// hot-plugs on its root bus, through ACPI.
const HotplugAddr = "0x10"

// QMP is a QEMU Machine Protocol client (vhost/qmp, which hostd uses to
// hot-plug pair regions too).
type QMP = qmp.Client

// DialQMP connects to QEMU's QMP socket at path (qmp.Dial).
func DialQMP(ctx context.Context, path string) (*QMP, error) { return qmp.Dial(ctx, path) }

// QMP returns the VM's QMP client (Options.Migratable), connecting on
// first use.
func (v *VM) QMP(ctx context.Context) (*QMP, error) {
	v.qmpMu.Lock()
	defer v.qmpMu.Unlock()
	if v.qmp != nil {
		return v.qmp, nil
	}
	if v.qmpPath == "" {
		return nil, fmt.Errorf("vm %s has no QMP socket (Options.Migratable)", v.Name)
	}
	q, err := DialQMP(ctx, v.qmpPath)
	if err != nil {
		return nil, err
	}
	v.qmp = q
	return q, nil
}

// CloseQMP closes the VM's QMP connection, if any, so that someone else
// (hostd) can use the socket: QEMU serves one QMP client at a time.
func (v *VM) CloseQMP() {
	v.qmpMu.Lock()
	defer v.qmpMu.Unlock()
	if v.qmp != nil {
		v.qmp.Close()
		v.qmp = nil
	}
}

// Unplug hot-unplugs the ivshmem device id (device_del; the guest's ACPI
// eject completes it: DEVICE_DELETED) and removes its memory backend
// (object-del), waiting until QEMU has let go of both (qmp.Client.Unplug).
// It returns how long the guest took (to DEVICE_DELETED).
func (v *VM) Unplug(ctx context.Context, id string) (time.Duration, error) {
	q, err := v.QMP(ctx)
	if err != nil {
		return 0, err
	}
	v.qmpMu.Lock()
	backend := v.backends[id]
	delete(v.backends, id)
	v.qmpMu.Unlock()
	if backend == "" {
		backend = "mem-" + id // as ivshmem.Device.QEMUArgs named it at boot
	}
	took, err := q.Unplug(ctx, id, backend)
	if err != nil {
		return took, fmt.Errorf("vm %s: %w", v.Name, err)
	}
	return took, nil
}

// Plug hot-plugs d as an ivshmem-plain device at HotplugAddr, as
// ivshmem.Device.QEMUArgs would have started it (object-add of a
// memory-backend-file on d.Path, device_add).
func (v *VM) Plug(ctx context.Context, d ivshmem.Device) error {
	q, err := v.QMP(ctx)
	if err != nil {
		return err
	}
	// Each plug gets a backend of its own name: QEMU frees an unplugged
	// device's RAM block only later (RCU), and aborts on a new one
	// registered under the same name meanwhile ("RAMBlock ... already
	// registered").
	v.qmpMu.Lock()
	v.plugs++
	backend := fmt.Sprintf("mem-%s-%d", d.ID, v.plugs)
	v.qmpMu.Unlock()
	if err := q.Plug(ctx, d, backend, HotplugAddr); err != nil {
		return err
	}
	v.qmpMu.Lock()
	if v.backends == nil {
		v.backends = map[string]string{}
	}
	v.backends[d.ID] = backend
	v.qmpMu.Unlock()
	return nil
}

// Mode is how Migrate treats the source's vCPU while QEMU copies its RAM.
type Mode int

const (
	// Paused stops the source (QMP stop) before the copy and continues
	// the destination (cont) once it has everything: no page is dirtied
	// during the copy, so QEMU copies RAM once and tracks no dirty pages.
	// The guest is paused for the whole copy (about a second for 256 MiB
	// under TCG); its TCP connections survive that. The VM tests migrate
	// so: QEMU 7.2 under TCG sometimes loses a guest that ran during the
	// copy (docs/vm.md, "Migrating paused").
	Paused Mode = iota
	// Live is QEMU's default pre-copy: the vCPU runs while RAM is copied,
	// pages it dirties are sent again, and it pauses only for the last
	// round (the downtime QEMU reports).
	Live
	// LiveEarly is Live returning as soon as the source completed,
	// without waiting for the destination to run the guest: how the VM
	// tests migrated before, for the diagnostics (a plug may then reach
	// the destination while it still loads the migration).
	LiveEarly
)

func (m Mode) String() string {
	return [...]string{Paused: "paused", Live: "live", LiveEarly: "live-early"}[m]
}

// Migrate migrates the VM to dst, a QEMU listening on uri (started with
// Options.Incoming = uri), in mode, and waits until dst runs the guest;
// the source is paused then. It returns how long it took and the
// downtime: QEMU's figure for Live, from stop to dst running for Paused.
func (v *VM) Migrate(ctx context.Context, dst *VM, uri string, mode Mode) (took, downtime time.Duration, err error) {
	q, err := v.QMP(ctx)
	if err != nil {
		return 0, 0, err
	}
	dq, err := dst.QMP(ctx)
	if err != nil {
		return 0, 0, err
	}
	start := time.Now()
	if mode == Paused {
		if _, err := q.Do(ctx, "stop", nil); err != nil {
			return 0, 0, fmt.Errorf("vm %s: %w", v.Name, err)
		}
	}
	if _, err := q.Do(ctx, "migrate", map[string]any{"uri": uri}); err != nil {
		return 0, 0, err
	}
	for {
		r, err := q.Do(ctx, "query-migrate", nil)
		if err != nil {
			return 0, 0, err
		}
		var st struct {
			Status    string `json:"status"`
			Downtime  int64  `json:"downtime"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := json.Unmarshal(r, &st); err != nil {
			return 0, 0, err
		}
		switch st.Status {
		case "completed":
			downtime = time.Duration(st.Downtime) * time.Millisecond
			if mode == LiveEarly {
				return time.Since(start), downtime, nil
			}
			if err := dst.resume(ctx, dq, mode); err != nil {
				return 0, 0, err
			}
			if mode == Paused {
				downtime = time.Since(start)
			}
			return time.Since(start), downtime, nil
		case "failed", "cancelled":
			return 0, 0, fmt.Errorf("vm %s: migration %s: %s", v.Name, st.Status, st.ErrorDesc)
		}
		if err := pause(ctx, 50*time.Millisecond); err != nil {
			return 0, 0, fmt.Errorf("vm %s: migration (%s): %w", v.Name, st.Status, err)
		}
	}
}

// resume waits until the destination v of a completed migration has
// loaded it, and continues it if it arrived paused (QEMU gives the
// destination the source's run state: a Paused migration arrives
// paused; a cont while the state still loads would be lost).
func (v *VM) resume(ctx context.Context, q *QMP, mode Mode) error {
	for {
		r, err := q.Do(ctx, "query-status", nil)
		if err != nil {
			return fmt.Errorf("vm %s: %w", v.Name, err)
		}
		var st struct {
			Status string `json:"status"`
		}
		if err := json.Unmarshal(r, &st); err != nil {
			return err
		}
		switch {
		case st.Status == "running":
			return nil
		case st.Status == "paused" && mode == Paused:
			if _, err := q.Do(ctx, "cont", nil); err != nil {
				return fmt.Errorf("vm %s: %w", v.Name, err)
			}
			return nil
		case st.Status != "inmigrate" && st.Status != "paused":
			return fmt.Errorf("vm %s: after the migration its state is %q", v.Name, st.Status)
		}
		if err := pause(ctx, 10*time.Millisecond); err != nil {
			return fmt.Errorf("vm %s: still %s after the migration: %w", v.Name, st.Status, err)
		}
	}
}

// pause waits d, or until ctx ends.
func pause(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// hotplugArgs are d's arguments for a Migratable VM: d.QEMUArgs with the
// device at HotplugAddr.
func hotplugArgs(d ivshmem.Device) ([]string, error) {
	args, err := d.QEMUArgs()
	if err != nil {
		return nil, err
	}
	for i := range args {
		if i > 0 && args[i-1] == "-device" {
			args[i] += ",addr=" + HotplugAddr
		}
	}
	return args, nil
}
