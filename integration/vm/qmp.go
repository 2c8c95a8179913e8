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

// Migrate migrates the VM to the QEMU listening on uri (started with
// Options.Incoming = uri) and waits until the migration completed; the
// source is paused then. It returns how long it took and the downtime
// QEMU reports.
func (v *VM) Migrate(ctx context.Context, uri string) (took, downtime time.Duration, err error) {
	q, err := v.QMP(ctx)
	if err != nil {
		return 0, 0, err
	}
	start := time.Now()
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
			return time.Since(start), time.Duration(st.Downtime) * time.Millisecond, nil
		case "failed", "cancelled":
			return 0, 0, fmt.Errorf("vm %s: migration %s: %s", v.Name, st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return 0, 0, fmt.Errorf("vm %s: migration (%s): %w", v.Name, st.Status, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
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
