//go:build linux

package vsockd

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
)

// logBuf is a logger whose output a test reads.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) { l.mu.Lock(); defer l.mu.Unlock(); return l.b.Write(p) }
func (l *logBuf) String() string              { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }
func (l *logBuf) logger() hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{Output: l, Level: hclog.Debug})
}

// until polls cond for up to 30 s (a way out, not a timing claim).
func until(t *testing.T, what string, log *logBuf, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30 s; log:\n%s", what, log.String())
		}
	}
}

func listen(t *testing.T) (*Daemon, string, *logBuf) {
	t.Helper()
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	path := filepath.Join(t.TempDir(), "vsockd.sock")
	log := &logBuf{}
	d, err := Listen(log.logger(), path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	return d, path, log
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return c
}

// TestMaxDevices: hostd names maxDevices devices (no QEMU: each a real
// socket, room and forwarder) and asks for their counters: every list
// of them streams whole, the connection is never dropped, and a second
// hostd lists them all again at its connect. Before, the list was
// queued at once into the 1024 messages a controller's queue held, and
// any hostd with more than about 1000 devices was dropped at each
// connect, for ever.
func TestMaxDevices(t *testing.T) {
	_, path, log := listen(t)
	dir := t.TempDir()
	devs := make([]Device, maxDevices)
	for i := range devs {
		devs[i] = Device{Guest: fmt.Sprintf("vm%d", i), ID: uint32(i + 1), Socket: filepath.Join(dir, fmt.Sprint(i)), CID: uint32(i + 3)}
	}
	c, err := Start(ctx(t), log.logger(), path, devs)
	if err != nil {
		t.Fatalf("%v; log:\n%.4000s", err, log.String())
	}
	if n := len(c.Stats()); n != maxDevices {
		t.Fatalf("%d stats, want %d", n, maxDevices)
	}
	c.Close()
	c, err = Start(ctx(t), log.logger(), path, devs) // kept: the list is what it waits on
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if n := len(c.Stats()); n != maxDevices {
		t.Fatalf("%d stats after a reconnect, want %d", n, maxDevices)
	}
	if s := log.String(); strings.Contains(s, "dropped") || strings.Contains(s, "lost shunt-vsockd") {
		t.Fatalf("the controller was dropped:\n%.4000s", s)
	}
}

// frontend connects to dev's socket as a QEMU would: the device counts
// its front-end connected from the accept on.
func frontend(t *testing.T, d *Daemon, log *logBuf, dev Device) net.Conn {
	t.Helper()
	q, err := net.Dial("unix", dev.Socket)
	if err != nil {
		t.Fatal(err)
	}
	until(t, "the device sees its QEMU", log, func() bool {
		d.mu.Lock()
		defer d.mu.Unlock()
		for _, s := range d.devs {
			if s.dev.Socket == dev.Socket {
				return s.connected
			}
		}
		return false
	})
	return q
}

func devOf(d *Daemon, id uint32) *served {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.devs[id]
}

// TestRename: a guest renamed, or given another id, in hostd.hcl keeps
// its device, with its QEMU, across hostd's restart (before, the
// rename closed it and the id change was refused, then forgotten); a
// new socket or CID while its QEMU is connected is refused and logged
// by hostd, the device going on; once the QEMU is gone it is made anew.
func TestRename(t *testing.T) {
	d, path, dlog := listen(t)
	dir := t.TempDir()
	vm := Device{Guest: "vm1", ID: 7, Socket: filepath.Join(dir, "vm1.vsock"), CID: 3}
	other := Device{Guest: "other", ID: 8, Socket: filepath.Join(dir, "other.vsock"), CID: 4}
	restart := func(devs ...Device) (*Client, *logBuf) {
		t.Helper()
		log := &logBuf{}
		c, err := Start(ctx(t), log.logger(), path, devs)
		if err != nil {
			t.Fatalf("%v; daemon's log:\n%s", err, dlog.String())
		}
		return c, log
	}
	c, _ := restart(vm, other)
	first := devOf(d, 7)
	q := frontend(t, d, dlog, vm)
	defer q.Close()
	c.Close()

	for _, tc := range []struct {
		name string
		dev  Device
	}{
		{"renamed", Device{Guest: "vm1-new", ID: 7, Socket: vm.Socket, CID: vm.CID}},
		{"new id", Device{Guest: "vm1-new", ID: 9, Socket: vm.Socket, CID: vm.CID}},
	} {
		c, _ = restart(tc.dev, other)
		if s := devOf(d, tc.dev.ID); s != first || !c.Served(tc.dev.ID) {
			t.Fatalf("%s: device %p (first %p), served %v: want the same device, its QEMU served; daemon's log:\n%s", tc.name, s, first, c.Served(tc.dev.ID), dlog.String())
		}
		var names []string
		for _, st := range c.Stats() {
			names = append(names, st.Guest)
		}
		if len(names) != 2 || names[1] != tc.dev.Guest && names[0] != tc.dev.Guest {
			t.Fatalf("%s: stats name %v, want %s among 2", tc.name, names, tc.dev.Guest)
		}
		c.Close()
	}
	if devOf(d, 7) != nil {
		t.Fatal("the device is still under its old id")
	}

	// A new CID while its QEMU is connected: refused, the device goes on.
	moved := Device{Guest: "vm1-new", ID: 9, Socket: vm.Socket, CID: 5}
	c, log := restart(moved, other)
	if s := devOf(d, 9); s != first || s.dev.CID != 3 {
		t.Fatalf("a new cid under a connected QEMU: device %p (first %p): want the same, cid 3", s, first)
	}
	if !strings.Contains(log.String(), "its QEMU is connected") {
		t.Fatalf("hostd's log does not say the change was refused:\n%s", log.String())
	}
	q.Close()
	until(t, "the device sees its QEMU gone", dlog, func() bool { return !c.Served(9) })
	c.Close()
	// The QEMU gone: the change is made.
	c, _ = restart(moved, other)
	defer c.Close()
	if s := devOf(d, 9); s == nil || s == first || s.dev.CID != 5 {
		t.Fatalf("a new cid without a QEMU: device %+v, want a new one with cid 5", s)
	}
}

// TestNewestHello: a hostd that said hello and then hangs (never reads
// again) does not keep the devices from the next: the newest hello
// wins, the old connection hears bye and is closed; a client replaced
// so stops dialing.
func TestNewestHello(t *testing.T) {
	_, path, log := listen(t)
	hung, err := net.Dial("unixpacket", path)
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close()
	if _, err := hung.Write([]byte(`{"op":"hello","version":1}`)); err != nil {
		t.Fatal(err)
	}
	// Its hello answered: it holds the slot, then hangs.
	hung.SetReadDeadline(time.Now().Add(30 * time.Second))
	if n, err := hung.Read(make([]byte, MaxMsg)); err != nil || n == 0 {
		t.Fatalf("the first hello's answer: %v", err)
	}
	c1, err := Start(ctx(t), log.logger(), path, nil)
	if err != nil {
		t.Fatalf("a new hostd after a hung one: %v; log:\n%s", err, log.String())
	}
	defer c1.Close()
	var got []string
	for {
		b := make([]byte, MaxMsg)
		n, err := hung.Read(b)
		if err != nil || n == 0 {
			break
		}
		got = append(got, string(b[:n]))
	}
	if len(got) != 1 || !strings.Contains(got[0], `"op":"bye"`) {
		t.Fatalf("the hung hostd read %q, want a bye, then the end", got)
	}
	c2, err := Start(ctx(t), log.logger(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	until(t, "the first client hears it was replaced", log, func() bool {
		c1.mu.Lock()
		defer c1.mu.Unlock()
		return c1.ousted && c1.conn == nil
	})
	if c2.PID() == 0 {
		t.Fatal("the newest client is not connected")
	}
}

// TestVersions: a hello of a later version (a hostd upgraded past the
// daemon) is answered with the daemon's own; version 0 is refused.
func TestVersions(t *testing.T) {
	_, path, _ := listen(t)
	for _, tc := range []struct {
		hello string
		want  string
	}{
		{`{"op":"hello","version":2}`, fmt.Sprintf(`"version":%d`, Version)},
		{`{"op":"hello","version":0}`, ""},
	} {
		c, err := net.Dial("unixpacket", path)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(tc.hello))
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		b := make([]byte, MaxMsg)
		n, _ := c.Read(b)
		c.Close()
		if got := string(b[:n]); tc.want == "" && n != 0 || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%s: got %q, want %q", tc.hello, got, tc.want)
		}
	}
}
