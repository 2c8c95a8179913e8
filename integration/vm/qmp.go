//go:build linux

package vm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/shuntnet/shunt/vhost/ivshmem"
)

// HotplugAddr is the PCI slot of a Migratable VM's ivshmem device, fixed so
// that the device plugged back after a migration is where it was, and the
// other devices' slots do not depend on whether it is there (a migration's
// destination starts without it, and QEMU migrates only between machines
// with the same devices at the same addresses). The pc machine (i440fx)
// hot-plugs on its root bus, through ACPI.
const HotplugAddr = "0x10"

// QMP is a QEMU Machine Protocol client (docs/interop/qmp-spec.rst in
// QEMU): one command at a time, events kept for WaitEvent. Safe for
// concurrent use; Close ends it, and so does a command whose context
// ends before its reply.
type QMP struct {
	c net.Conn

	cmd  sync.Mutex // one command in flight
	reps chan qmpReply

	mu     sync.Mutex
	events []qmpEvent
	cond   *sync.Cond
	err    error // the reader's end
}

type qmpReply struct {
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

type qmpEvent struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
}

// DialQMP connects to QEMU's QMP socket at path (retrying until ctx ends:
// QEMU creates it as it starts) and leaves capabilities negotiation mode.
func DialQMP(ctx context.Context, path string) (*QMP, error) {
	var c net.Conn
	for {
		var err error
		if c, err = net.Dial("unix", path); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("qmp %s: %w", path, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
	q := &QMP{c: c, reps: make(chan qmpReply, 1)}
	q.cond = sync.NewCond(&q.mu)
	go q.read()
	if _, err := q.Do(ctx, "qmp_capabilities", nil); err != nil {
		c.Close()
		return nil, err
	}
	return q, nil
}

func (q *QMP) read() {
	sc := bufio.NewScanner(q.c)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var m struct {
			qmpReply
			qmpEvent
			QMP json.RawMessage `json:"QMP"`
		}
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			continue
		}
		switch {
		case m.QMP != nil: // the greeting
		case m.Event != "":
			q.mu.Lock()
			q.events = append(q.events, m.qmpEvent)
			q.cond.Broadcast()
			q.mu.Unlock()
		default:
			q.reps <- m.qmpReply
		}
	}
	q.mu.Lock()
	q.err = errors.Join(errors.New("qmp connection closed"), sc.Err())
	q.cond.Broadcast()
	q.mu.Unlock()
	close(q.reps)
}

// Do runs one command with args (nil for none) and returns its result.
func (q *QMP) Do(ctx context.Context, cmd string, args any) (json.RawMessage, error) {
	q.cmd.Lock()
	defer q.cmd.Unlock()
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if _, err := q.c.Write(append(b, '\n')); err != nil {
		return nil, fmt.Errorf("qmp %s: %w", cmd, err)
	}
	select {
	case r, ok := <-q.reps:
		switch {
		case !ok:
			return nil, fmt.Errorf("qmp %s: connection closed", cmd)
		case r.Error != nil:
			return nil, fmt.Errorf("qmp %s: %s: %s", cmd, r.Error.Class, r.Error.Desc)
		}
		return r.Return, nil
	case <-ctx.Done():
		q.c.Close() // a late reply would answer the next command
		return nil, fmt.Errorf("qmp %s: %w", cmd, ctx.Err())
	}
}

// WaitEvent waits for an event called name whose data match accepts (nil
// accepts any), among all events since the connection started, and
// returns its data.
func (q *QMP) WaitEvent(ctx context.Context, name string, match func(json.RawMessage) bool) (json.RawMessage, error) {
	stop := context.AfterFunc(ctx, func() { q.mu.Lock(); q.cond.Broadcast(); q.mu.Unlock() })
	defer stop()
	q.mu.Lock()
	defer q.mu.Unlock()
	for seen := 0; ; {
		for ; seen < len(q.events); seen++ {
			if e := q.events[seen]; e.Event == name && (match == nil || match(e.Data)) {
				return e.Data, nil
			}
		}
		if q.err != nil {
			return nil, fmt.Errorf("qmp: waiting for %s: %w", name, q.err)
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("qmp: waiting for %s: %w", name, ctx.Err())
		}
		q.cond.Wait()
	}
}

// Close closes the connection.
func (q *QMP) Close() error { return q.c.Close() }

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
// (object-del), waiting until QEMU has let go of both. It returns how long
// the guest took (to DEVICE_DELETED).
func (v *VM) Unplug(ctx context.Context, id string) (time.Duration, error) {
	q, err := v.QMP(ctx)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if _, err := q.Do(ctx, "device_del", map[string]any{"id": id}); err != nil {
		return 0, err
	}
	if _, err := q.WaitEvent(ctx, "DEVICE_DELETED", func(d json.RawMessage) bool {
		var x struct {
			Device string `json:"device"`
		}
		return json.Unmarshal(d, &x) == nil && x.Device == id
	}); err != nil {
		return 0, fmt.Errorf("vm %s: unplug %s: %w", v.Name, id, err)
	}
	took := time.Since(start)
	v.qmpMu.Lock()
	backend := v.backends[id]
	delete(v.backends, id)
	v.qmpMu.Unlock()
	if backend == "" {
		backend = "mem-" + id // as ivshmem.Device.QEMUArgs named it at boot
	}
	// DEVICE_DELETED comes before QEMU lets go of the device (RCU): its
	// backend is "in use" for a while, and its RAM block stays registered
	// a while longer. Wait for both, so that a migration or a plug that
	// follows sees a machine without them.
	for {
		_, err := q.Do(ctx, "object-del", map[string]any{"id": backend})
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "in use") {
			return took, err
		}
		if err := pause(ctx); err != nil {
			return took, fmt.Errorf("vm %s: backend %s still in use: %w", v.Name, backend, err)
		}
	}
	for {
		r, err := q.Do(ctx, "human-monitor-command", map[string]any{"command-line": "info ramblock"})
		if err != nil {
			return took, err
		}
		if !strings.Contains(string(r), "/"+backend+" ") {
			return took, nil
		}
		if err := pause(ctx); err != nil {
			return took, fmt.Errorf("vm %s: RAM block of %s still registered: %w", v.Name, backend, err)
		}
	}
}

// pause waits 20 ms, or until ctx ends.
func pause(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(20 * time.Millisecond):
		return nil
	}
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
	if _, err := q.Do(ctx, "object-add", map[string]any{"qom-type": "memory-backend-file", "id": backend,
		"mem-path": d.Path, "size": d.Size, "share": true}); err != nil {
		return err
	}
	if _, err = q.Do(ctx, "device_add", map[string]any{"driver": "ivshmem-plain", "id": d.ID, "memdev": backend, "addr": HotplugAddr}); err != nil {
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
