package qmp_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shuntnet/shunt/vhost/ivshmem"
	"github.com/shuntnet/shunt/vhost/qmp"
)

// fakeQEMU answers QMP on a Unix socket like QEMU 7.2 does for the
// commands Plug, Unplug and Ivshmems use, keeping devices and backends;
// object-del fails "in use" once after each DEVICE_DELETED, as QEMU's
// deferred release does.
type fakeQEMU struct {
	mu       sync.Mutex
	cmds     []string
	devices  map[string]string // id -> backend
	backends map[string]string // id -> mem-path
	inUse    bool
}

func startFake(t *testing.T) (*fakeQEMU, string) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	f := &fakeQEMU{devices: map[string]string{}, backends: map[string]string{}}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go f.serve(c)
		}
	}()
	return f, path
}

func (f *fakeQEMU) serve(c net.Conn) {
	defer c.Close()
	enc := json.NewEncoder(c)
	enc.Encode(map[string]any{"QMP": map[string]any{"version": map[string]any{}}})
	sc := bufio.NewScanner(c)
	for sc.Scan() {
		var req struct {
			Execute   string         `json:"execute"`
			Arguments map[string]any `json:"arguments"`
		}
		if json.Unmarshal(sc.Bytes(), &req) != nil {
			return
		}
		ret, event, err := f.do(req.Execute, req.Arguments)
		if err != "" {
			enc.Encode(map[string]any{"error": map[string]any{"class": "GenericError", "desc": err}})
			continue
		}
		enc.Encode(map[string]any{"return": ret})
		if event != nil {
			enc.Encode(event)
		}
	}
}

func (f *fakeQEMU) do(cmd string, a map[string]any) (ret any, event any, err string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cmds = append(f.cmds, cmd)
	s := func(k string) string { v, _ := a[k].(string); return v }
	switch cmd {
	case "qmp_capabilities", "human-monitor-command":
		return map[string]any{}, nil, ""
	case "object-add":
		f.backends[s("id")] = s("mem-path")
	case "device_add":
		if _, ok := f.devices[s("id")]; ok {
			return nil, nil, "Duplicate device ID '" + s("id") + "'"
		}
		f.devices[s("id")] = s("memdev")
	case "device_del":
		if _, ok := f.devices[s("id")]; !ok {
			return nil, nil, "Device '" + s("id") + "' not found"
		}
		delete(f.devices, s("id"))
		f.inUse = true
		return map[string]any{}, map[string]any{"event": "DEVICE_DELETED", "data": map[string]any{"device": s("id")}}, ""
	case "object-del":
		if f.inUse {
			f.inUse = false
			return nil, nil, "object '" + s("id") + "' is in use, can not be deleted"
		}
		delete(f.backends, s("id"))
	case "qom-list":
		var out []map[string]string
		if s("path") == "/objects" {
			for id := range f.backends {
				out = append(out, map[string]string{"name": id, "type": "child<memory-backend-file>"})
			}
			return out, nil, ""
		}
		for id := range f.devices {
			out = append(out, map[string]string{"name": id, "type": "child<ivshmem-plain>"})
		}
		out = append(out, map[string]string{"name": "net0", "type": "child<virtio-net-pci>"})
		return out, nil, ""
	case "qom-get":
		p := s("path")
		if id, ok := strings.CutPrefix(p, "/machine/peripheral/"); ok {
			b, ok := f.devices[id]
			if !ok {
				return nil, nil, "Device '" + p + "' not found"
			}
			return "/objects/" + b, nil, ""
		}
		return f.backends[strings.TrimPrefix(p, "/objects/")], nil, ""
	}
	return map[string]any{}, nil, ""
}

// TestPlugListUnplug: a device plugged is listed with its backend's file;
// Unplug waits out DEVICE_DELETED and the backend's "in use", and asks for
// the backend when not told; a device that is not there is ErrNoDevice.
func TestPlugListUnplug(t *testing.T) {
	f, path := startFake(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	q, err := qmp.Dial(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	d := ivshmem.Device{ID: "shunt-p1-x", Path: "/run/shunt/regions/pair-1-2", Size: 16 << 20}
	if err := q.Plug(ctx, d, "mem-shunt-p1-x-1", ""); err != nil {
		t.Fatal(err)
	}
	devs, err := q.Ivshmems(ctx)
	if err != nil || len(devs) != 1 || devs[0] != (qmp.Ivshmem{ID: d.ID, Backend: "mem-shunt-p1-x-1", Path: d.Path}) {
		t.Fatalf("Ivshmems = %+v, %v; want the device plugged", devs, err)
	}
	if _, err := q.Unplug(ctx, d.ID, ""); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	left, cmds := len(f.devices)+len(f.backends), strings.Join(f.cmds, " ")
	f.mu.Unlock()
	if left != 0 {
		t.Fatalf("devices or backends left after Unplug (commands: %s)", cmds)
	}
	if !strings.Contains(cmds, "device_del object-del object-del") {
		t.Fatalf("commands %s: want object-del retried while in use", cmds)
	}
	if _, err := q.Unplug(ctx, d.ID, ""); !errors.Is(err, qmp.ErrNoDevice) {
		t.Fatalf("Unplug of a device not there = %v, want ErrNoDevice", err)
	}
	// A backend left without its device is found by its file.
	if _, err := q.Do(ctx, "object-add", map[string]any{"qom-type": "memory-backend-file", "id": "mem-left", "mem-path": d.Path}); err != nil {
		t.Fatal(err)
	}
	if bs, err := q.FileBackends(ctx, d.Path); err != nil || len(bs) != 1 || bs[0] != "mem-left" {
		t.Fatalf("FileBackends = %v, %v; want [mem-left]", bs, err)
	}
	if err := q.DeleteBackend(ctx, "mem-left"); err != nil {
		t.Fatal(err)
	}
}
