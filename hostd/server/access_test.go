package server_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/shuntnet/shunt/hostd/server"
)

// TestSocketAccess: a control socket is hostd's user's only (0600), or
// also its endpoint's group's (0660) for an unprivileged QEMU.
func TestSocketAccess(t *testing.T) {
	w := newWorld(t)
	gid := os.Getegid() // a group the test may give a file to
	if gid == 0 {
		gid = 65534 // root may give any
	}
	grouped := filepath.Join(t.TempDir(), "g1-qemu.sock")
	if err := w.srv.Add(server.Endpoint{Guest: w.g1, Path: grouped, Gid: gid}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path string
		mode os.FileMode
		gid  int
	}{
		{w.socks[w.g1], 0o600, -1},
		{grouped, 0o660, gid},
	} {
		fi, err := os.Stat(tc.path)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode().Perm() != tc.mode || tc.gid >= 0 && int(st.Gid) != tc.gid {
			t.Errorf("%s: mode %v, gid %d; want %v, gid %d", filepath.Base(tc.path), fi.Mode().Perm(), st.Gid, tc.mode, tc.gid)
		}
	}
}
