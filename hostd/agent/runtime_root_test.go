//go:build linux

package agent

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/server"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestRestoreRuntime: a restarted hostd takes back the run-time guests
// whose spec is sound and whose namespace is still the one they had, and
// drops (with their files) the others: the namespace gone, the path now
// another namespace, a file not named after its guest, not JSON, and
// addresses a configured guest owns now.
func TestRestoreRuntime(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "ip", "iproute2")
	dir := t.TempDir()
	var ns []string
	for i := range 3 {
		name := fmt.Sprintf("rt%d-%d", os.Getpid()%10000, i)
		if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
			t.Fatalf("ip netns add: %v: %s", err, out)
		}
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
		ns = append(ns, "/run/netns/"+name)
	}
	id := func(path string) server.Netns {
		n, err := server.NetnsOf(path)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	gdir := filepath.Join(dir, "guests")
	if err := os.MkdirAll(gdir, 0o700); err != nil {
		t.Fatal(err)
	}
	write := func(file string, p persisted) {
		b, _ := json.Marshal(p)
		if err := os.WriteFile(filepath.Join(gdir, file), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	spec := func(name, netns, addr string) admin.GuestSpec {
		return admin.GuestSpec{Name: name, ID: uint32(len(name)) + 1<<20, Group: "g", Netns: netns, Addresses: []string{addr}}
	}
	write("good.json", persisted{spec("good", ns[0], "10.9.0.1"), id(ns[0])})
	write("gone.json", persisted{spec("gone", "/run/netns/no-such-ns", "10.9.0.2"), id(ns[0])})
	write("other.json", persisted{spec("other", ns[1], "10.9.0.3"), id(ns[2])})                // the path names another namespace now
	write("renamed.json", persisted{spec("not-renamed", ns[2], "10.9.0.4"), id(ns[2])})        // file and name differ
	write("taken.json", persisted{spec("taken", ns[2], "10.9.0.5"), id(ns[2])})                // a configured guest owns it
	if err := os.WriteFile(filepath.Join(gdir, "junk.json"), []byte("{"), 0o600); err != nil { // not JSON
		t.Fatal(err)
	}

	cfgGuest := &broker.Guest{Name: "configured", ID: 1}
	cfgGuest.SetAddrs(broker.Addrs{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.9.0.5/32")}})
	a := &Agent{log: hclog.NewNullLogger(), cfg: &config.Config{Path: "t.hcl", StateDir: dir, ContainerSocket: "/run/x/control.sock"},
		groups: map[string]*broker.Group{"g": {Name: "g"}}, guests: []*broker.Guest{cfgGuest}}
	a.restoreRuntime()

	var names []string
	for _, g := range a.guests {
		names = append(names, g.Name)
	}
	if !slices.Equal(names, []string{"configured", "good"}) {
		t.Errorf("guests after restore: %v, want configured and good", names)
	}
	if r := a.rt.byNS[id(ns[0])]; r == nil || r.spec.Name != "good" {
		t.Errorf("the container socket would not serve good's namespace: %+v", a.rt.byNS)
	}
	left, _ := os.ReadDir(gdir)
	var files []string
	for _, e := range left {
		files = append(files, e.Name())
	}
	if !slices.Equal(files, []string{"good.json"}) {
		t.Errorf("spec files left: %v, want good.json alone", files)
	}
}
