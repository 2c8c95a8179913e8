//go:build linux

package vsockhost_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/vsockhost"
)

// fakeDaemon is shunt-vsockd as the room sees it, for this test's logic.
type fakeDaemon struct{ served bool }

func (f *fakeDaemon) Served(uint32) bool { return f.served }
func (f *fakeDaemon) Stats() []vsockhost.Stat {
	return []vsockhost.Stat{{Guest: "vm1", CID: 3, Connected: f.served, Sessions: 1, RxBytes: 42}}
}

// TestDaemonSpec: a device shunt-vsockd serves (Spec.Daemon) counts as
// served only as the daemon says (not at all before UseDaemon), its
// counters are the daemon's, and hostd listens next to its socket for
// what the daemon forwards, as for a hybrid vsock.
func TestDaemonSpec(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "vm1.vsock")
	r, err := vsockhost.Start(hclog.NewNullLogger(), []vsockhost.Spec{{Guest: "vm1", ID: 7, CID: 3, Hybrid: sock, Daemon: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Served(7) || !r.Has(7) || r.Device(7) != nil {
		t.Fatalf("before UseDaemon: served %v has %v device %v: want not served, a device of the daemon's", r.Served(7), r.Has(7), r.Device(7))
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Fatalf("hostd made the daemon's device socket: %v", err)
	}
	f := &fakeDaemon{}
	r.UseDaemon(f)
	if r.Served(7) {
		t.Fatal("served while the daemon says not")
	}
	f.served = true
	if !r.Served(7) {
		t.Fatal("not served while the daemon says so")
	}
	st := r.Stats()
	if len(st) != 1 || !st[0].Daemon || !st[0].Connected || st[0].RxBytes != 42 || st[0].Guest != "vm1" {
		t.Fatalf("stats %+v: want the daemon's, marked", st)
	}
	l, err := r.ListenControl(7)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if fi, err := os.Stat(sock + "_1021"); err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("hostd's listener for the daemon at %s_1021: %v %v", sock, fi, err)
	}
}
