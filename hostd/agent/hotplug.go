package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/qmp"
)

// qmpHotplug plugs VM pair regions into bare QEMUs through each guest's
// QMP socket (hostd.hcl's qmp): the broker's Hotplug. libvirt domains
// would need another implementation (virsh attach-device with <shmem>).
// Safe for concurrent use: one QMP connection per VM at a time (QEMU
// serves one client per socket), made for each call.
type qmpHotplug struct {
	log hclog.Logger

	mu    sync.Mutex
	socks map[uint32]string      // QMP socket by guest id; a migrated VM's changes (setSocket)
	locks map[uint32]*sync.Mutex // one call per VM at a time
}

// setSocket makes g's later plugs and unplugs go to the QMP socket at
// path (a migration's destination QEMU).
func (h *qmpHotplug) setSocket(g *broker.Guest, path string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.socks[g.ID] = path
}

// qmpDialBound bounds reaching a VM's QMP socket: a VM that stopped has
// none (its unplug is then moot).
const qmpDialBound = 3 * time.Second

func (h *qmpHotplug) dial(ctx context.Context, g *broker.Guest) (*qmp.Client, func(), error) {
	h.mu.Lock()
	sock := h.socks[g.ID]
	h.mu.Unlock()
	if sock == "" {
		return nil, nil, fmt.Errorf("guest %s has no qmp socket in hostd.hcl", g.Name)
	}
	if _, err := os.Stat(sock); err != nil {
		return nil, nil, fmt.Errorf("guest %s: qmp socket: %w (is its QEMU running, with -qmp unix:%s,server=on,wait=off?)", g.Name, err, sock)
	}
	h.mu.Lock()
	l := h.locks[g.ID]
	if l == nil {
		l = &sync.Mutex{}
		h.locks[g.ID] = l
	}
	h.mu.Unlock()
	l.Lock()
	dctx, cancel := context.WithTimeout(ctx, qmpDialBound)
	defer cancel()
	q, err := qmp.Dial(dctx, sock)
	if err != nil {
		l.Unlock()
		return nil, nil, fmt.Errorf("guest %s: %w", g.Name, err)
	}
	return q, func() { q.Close(); l.Unlock() }, nil
}

// Plug implements broker.Hotplug: object-add of a memory-backend-file on
// the region's file (share=on) and device_add of an ivshmem-plain device
// r.DeviceID() on it, in a slot QEMU chooses.
func (h *qmpHotplug) Plug(ctx context.Context, g *broker.Guest, r *broker.Region) error {
	q, done, err := h.dial(ctx, g)
	if err != nil {
		return err
	}
	defer done()
	d := ivshmem.Device{ID: r.DeviceID(), Path: r.File.Name(), Size: r.Pool.Region().Layout().Size}
	// A device on this pair's file that is still there is an earlier
	// region's of the pair, left by a hostd that stopped before it
	// unplugged it (its file is gone, and its header may name the id the
	// new one gets): it goes first, so the guest finds only the new one.
	if err := h.unplugPath(ctx, q, g, d.Path); err != nil {
		return err
	}
	// A backend name of its own for each plug, across hostd restarts too
	// (QEMU 7.2 keeps an unplugged backend's RAM block registered a while).
	backend := fmt.Sprintf("mem-%s-%x", d.ID, time.Now().UnixNano())
	start := time.Now()
	if err := q.Plug(ctx, d, backend, ""); err != nil {
		return fmt.Errorf("plug %s into %s: %w", d.ID, g.Name, err)
	}
	h.log.Debug("region plugged", "guest", g.Name, "device", d.ID, "path", d.Path, "size", d.Size, "took", time.Since(start))
	return nil
}

// Unplug implements broker.Hotplug: device_del, the guest's eject, and
// object-del of its backend. A VM without its QMP socket (stopped) or
// without the device is fine.
func (h *qmpHotplug) Unplug(ctx context.Context, g *broker.Guest, r *broker.Region) error {
	q, done, err := h.dial(ctx, g)
	if err != nil {
		h.log.Debug("region not unplugged: its VM's QMP socket is not there (stopped?)", "guest", g.Name, "device", r.DeviceID(), "error", err)
		return nil
	}
	defer done()
	return h.unplugPath(ctx, q, g, r.File.Name())
}

// unplugFile unplugs g's devices backed by the file at path, if its VM
// runs.
func (h *qmpHotplug) unplugFile(ctx context.Context, g *broker.Guest, path string) error {
	q, done, err := h.dial(ctx, g)
	if err != nil {
		return nil // not running: nothing plugged
	}
	defer done()
	return h.unplugPath(ctx, q, g, path)
}

// unplugPath unplugs every ivshmem device of g's VM backed by the file at
// path: the region's device, found by its file rather than its id, so
// that a device an earlier hostd plugged (adopted, or left behind) goes
// too.
func (h *qmpHotplug) unplugPath(ctx context.Context, q *qmp.Client, g *broker.Guest, path string) error {
	devs, err := q.Ivshmems(ctx)
	if err != nil {
		return fmt.Errorf("list the ivshmem devices of %s: %w", g.Name, err)
	}
	for _, d := range devs {
		if d.Path != path {
			continue
		}
		took, err := q.Unplug(ctx, d.ID, d.Backend)
		if errors.Is(err, qmp.ErrNoDevice) {
			continue
		}
		if err != nil {
			return fmt.Errorf("unplug %s from %s: %w", d.ID, g.Name, err)
		}
		h.log.Debug("region unplugged", "guest", g.Name, "device", d.ID, "path", path, "guest_eject", took)
	}
	// A backend whose device is gone but which is still there: an unplug
	// that a stopping hostd cut short.
	backends, err := q.FileBackends(ctx, path)
	if err != nil {
		return fmt.Errorf("list the memory backends of %s: %w", g.Name, err)
	}
	for _, b := range backends {
		if err := q.DeleteBackend(ctx, b); err != nil {
			return fmt.Errorf("remove backend %s from %s: %w", b, g.Name, err)
		}
	}
	return nil
}
