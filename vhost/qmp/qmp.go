package qmp

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

// Client is a QMP connection. Safe for concurrent use (commands are
// serialised); Close ends it, and so does a command whose context ends
// before its reply.
type Client struct {
	c net.Conn

	cmd  sync.Mutex // one command in flight
	reps chan reply

	mu     sync.Mutex
	events []event
	cond   *sync.Cond
	err    error // the reader's end
}

type reply struct {
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

type event struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
}

// Dial connects to QEMU's QMP socket at path (retrying until ctx ends:
// QEMU creates it as it starts) and leaves capabilities negotiation mode.
// The caller closes the Client.
func Dial(ctx context.Context, path string) (*Client, error) {
	var c net.Conn
	for {
		var err error
		var d net.Dialer
		if c, err = d.DialContext(ctx, "unix", path); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("qmp %s: %w", path, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
	q := &Client{c: c, reps: make(chan reply, 1)}
	q.cond = sync.NewCond(&q.mu)
	go q.read()
	if _, err := q.Do(ctx, "qmp_capabilities", nil); err != nil {
		c.Close()
		return nil, fmt.Errorf("qmp %s: %w", path, err)
	}
	return q, nil
}

// read runs until the connection ends; it owns nothing but the reader.
func (q *Client) read() {
	sc := bufio.NewScanner(q.c)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var m struct {
			reply
			event
			QMP json.RawMessage `json:"QMP"`
		}
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			continue
		}
		switch {
		case m.QMP != nil: // the greeting
		case m.Event != "":
			q.mu.Lock()
			q.events = append(q.events, m.event)
			q.cond.Broadcast()
			q.mu.Unlock()
		default:
			q.reps <- m.reply
		}
	}
	q.mu.Lock()
	q.err = errors.Join(errors.New("qmp connection closed"), sc.Err())
	q.cond.Broadcast()
	q.mu.Unlock()
	close(q.reps)
}

// Do runs one command with args (nil for none) and returns its result.
func (q *Client) Do(ctx context.Context, cmd string, args any) (json.RawMessage, error) {
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
func (q *Client) WaitEvent(ctx context.Context, name string, match func(json.RawMessage) bool) (json.RawMessage, error) {
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
func (q *Client) Close() error { return q.c.Close() }

// Plug hot-plugs d as an ivshmem-plain device called d.ID, backed by a
// memory-backend-file called backend on d.Path (share=on), as
// ivshmem.Device.QEMUArgs would have started it, at PCI address addr
// ("" lets QEMU choose a free slot). The pc machine (i440fx) hot-plugs on
// its root bus through ACPI; q35 needs a free hot-plug root port (give
// its id as addr's bus: not done here). The guest's kernel finds the
// device after the call returns. Give each plug a backend name of its
// own: QEMU 7.2 frees an unplugged device's RAM block only later, and
// aborts on a new one registered under the same name meanwhile.
func (q *Client) Plug(ctx context.Context, d ivshmem.Device, backend, addr string) error {
	if _, err := d.QEMUArgs(); err != nil { // checks d
		return err
	}
	if _, err := q.Do(ctx, "object-add", map[string]any{"qom-type": "memory-backend-file", "id": backend,
		"mem-path": d.Path, "size": d.Size, "share": true}); err != nil {
		return err
	}
	dev := map[string]any{"driver": "ivshmem-plain", "id": d.ID, "memdev": backend}
	if addr != "" {
		dev["addr"] = addr
	}
	if _, err := q.Do(ctx, "device_add", dev); err != nil {
		_, _ = q.Do(ctx, "object-del", map[string]any{"id": backend})
		return err
	}
	return nil
}

// Backend returns the id of the memory backend of ivshmem device id (QOM
// property memdev).
func (q *Client) Backend(ctx context.Context, id string) (string, error) {
	r, err := q.Do(ctx, "qom-get", map[string]any{"path": "/machine/peripheral/" + id, "property": "memdev"})
	if err != nil {
		return "", err
	}
	var path string
	if err := json.Unmarshal(r, &path); err != nil {
		return "", fmt.Errorf("qmp qom-get %s memdev: %w", id, err)
	}
	return strings.TrimPrefix(path, "/objects/"), nil
}

// ErrNoDevice means Unplug found no device of that id.
var ErrNoDevice = errors.New("qmp: no such device")

// Unplug hot-unplugs device id (device_del; the guest's eject completes
// it: DEVICE_DELETED) and removes its memory backend (object-del),
// waiting until QEMU has let go of both: QEMU 7.2 sends DEVICE_DELETED
// before it releases the device, so the backend is "in use" for a while,
// and its RAM block stays registered a while longer. backend "" asks QEMU
// which it is. It returns how long the guest took (device_del to
// DEVICE_DELETED). A device that is not there is ErrNoDevice.
func (q *Client) Unplug(ctx context.Context, id, backend string) (time.Duration, error) {
	if backend == "" {
		b, err := q.Backend(ctx, id)
		if err != nil {
			if strings.Contains(err.Error(), "not found") {
				return 0, fmt.Errorf("unplug %s: %w", id, ErrNoDevice)
			}
			return 0, err
		}
		backend = b
	}
	start := time.Now()
	if _, err := q.Do(ctx, "device_del", map[string]any{"id": id}); err != nil {
		if strings.Contains(err.Error(), "not found") {
			return 0, fmt.Errorf("unplug %s: %w", id, ErrNoDevice)
		}
		return 0, err
	}
	if _, err := q.WaitEvent(ctx, "DEVICE_DELETED", func(d json.RawMessage) bool {
		var x struct {
			Device string `json:"device"`
		}
		return json.Unmarshal(d, &x) == nil && x.Device == id
	}); err != nil {
		return 0, fmt.Errorf("unplug %s: %w", id, err)
	}
	took := time.Since(start)
	return took, q.DeleteBackend(ctx, backend)
}

// DeleteBackend removes memory backend id (object-del), retrying while
// QEMU still holds it (a device just unplugged), and waits until its RAM
// block is gone too.
func (q *Client) DeleteBackend(ctx context.Context, backend string) error {
	for {
		_, err := q.Do(ctx, "object-del", map[string]any{"id": backend})
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "in use") {
			return err
		}
		if err := pause(ctx); err != nil {
			return fmt.Errorf("backend %s still in use: %w", backend, err)
		}
	}
	for {
		r, err := q.Do(ctx, "human-monitor-command", map[string]any{"command-line": "info ramblock"})
		if err != nil {
			return err
		}
		if !strings.Contains(string(r), "/"+backend+" ") {
			return nil
		}
		if err := pause(ctx); err != nil {
			return fmt.Errorf("RAM block of %s still registered: %w", backend, err)
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

// Ivshmem is an ivshmem-plain device of a running QEMU: its id, its memory
// backend's id and the file that backs it.
type Ivshmem struct {
	ID, Backend, Path string
}

// Ivshmems lists the QEMU's ivshmem-plain devices that have an id (those
// device_add or -device made), with their backends' files.
func (q *Client) Ivshmems(ctx context.Context) ([]Ivshmem, error) {
	ids, err := q.children(ctx, "/machine/peripheral", "ivshmem-plain")
	if err != nil {
		return nil, err
	}
	var out []Ivshmem
	for _, id := range ids {
		backend, err := q.Backend(ctx, id)
		if err != nil {
			return nil, err
		}
		path, err := q.memPath(ctx, backend)
		if err != nil {
			return nil, err
		}
		out = append(out, Ivshmem{ID: id, Backend: backend, Path: path})
	}
	return out, nil
}

// FileBackends returns the ids of the QEMU's memory-backend-file objects
// on the file at path (with a device or without: one whose unplug was
// interrupted).
func (q *Client) FileBackends(ctx context.Context, path string) ([]string, error) {
	ids, err := q.children(ctx, "/objects", "memory-backend-file")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, id := range ids {
		mp, err := q.memPath(ctx, id)
		if err != nil {
			return nil, err
		}
		if mp == path {
			out = append(out, id)
		}
	}
	return out, nil
}

// children returns the names of the QOM children of path whose type is
// typ.
func (q *Client) children(ctx context.Context, path, typ string) ([]string, error) {
	r, err := q.Do(ctx, "qom-list", map[string]any{"path": path})
	if err != nil {
		return nil, err
	}
	var props []struct {
		Name string `json:"name"`
		Type string `json:"type"`
	}
	if err := json.Unmarshal(r, &props); err != nil {
		return nil, fmt.Errorf("qmp qom-list %s: %w", path, err)
	}
	var out []string
	for _, p := range props {
		if p.Type == "child<"+typ+">" {
			out = append(out, p.Name)
		}
	}
	return out, nil
}

// memPath returns the file of memory backend object id.
func (q *Client) memPath(ctx context.Context, id string) (string, error) {
	r, err := q.Do(ctx, "qom-get", map[string]any{"path": "/objects/" + id, "property": "mem-path"})
	if err != nil {
		return "", err
	}
	var path string
	if err := json.Unmarshal(r, &path); err != nil {
		return "", fmt.Errorf("qmp qom-get %s mem-path: %w", id, err)
	}
	return path, nil
}
