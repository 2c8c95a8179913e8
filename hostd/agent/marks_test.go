//go:build linux

package agent

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/hostd/virt"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestLibvirtGuestMarkFollowsTap: hostd marks a libvirt domain's
// connections by its tap with the domain's own id; when the domain comes
// back on another tap (restarted or migrated here), the id follows it, and
// the domain that then gets its old tap gets its own id. A domain whose
// metadata claims another guest's address is refused, with both named,
// and gets no rule. Close removes hostd's table.
func TestLibvirtGuestMarkFollowsTap(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New("agmark", 3)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatal(err)
	}
	defer r.Destroy()
	dir := t.TempDir()
	region := fmt.Sprintf("/dev/shm/shunt-agmark-%d", os.Getpid())
	defer os.Remove(region)
	cfg, err := config.Parse("hostd.hcl", []byte(fmt.Sprintf(`admin_socket = %q
metrics_address = ""
conntrack_netns = %q
state_dir = %q
region_dir = %q
trust_group "t" {
  region = %q
  region_size = "4MiB"
  slots = 16
}
`, filepath.Join(dir, "admin.sock"), r.HostNSPath(), filepath.Join(dir, "state"), filepath.Join(dir, "regions"), region)))
	if err != nil {
		t.Fatal(err)
	}
	a, err := Start(hclog.NewNullLogger(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ct, err := ctrack.Dial(r.HostNSPath())
	if err != nil {
		t.Fatal(err)
	}
	defer ct.Close()
	reg := (*registry)(a)
	g1, g2, g3 := r.Guests[0], r.Guests[1], r.Guests[2]
	dom := func(name string, id uint32, tap string, addrs ...netip.Addr) virt.Domain {
		return virt.Domain{Name: name, ID: id, Shmem: []string{filepath.Base(region)}, Tap: tap, Addresses: addrs,
			Controls: []string{filepath.Join(dir, fmt.Sprintf("%s-%d.sock", name, time.Now().UnixNano()))}}
	}
	entries := func() string {
		var out []string
		for _, e := range a.marks.Entries() {
			out = append(out, fmt.Sprintf("%s:%s:%d", e.Guest, e.Ifname, e.ID))
		}
		return strings.Join(out, " ")
	}
	ln := g2.Listen(t)
	f := a.marks.Field()

	vm1 := dom("vm1", 101, g1.HostIf)
	if err := reg.Register(vm1); err != nil {
		t.Fatal(err)
	}
	if got, want := entries(), "vm1:"+g1.HostIf+":101"; got != want {
		t.Fatalf("rules %q, want %q", got, want)
	}
	if id := f.ID(markOf(t, ct, g1, ln)); id != 101 {
		t.Fatalf("vm1's connection carries id %d, want 101", id)
	}

	// vm1 restarts on another tap: the watcher releases the old
	// description and registers the new one.
	reg.Unregister(vm1)
	if err := reg.Register(dom("vm1", 101, g3.HostIf)); err != nil {
		t.Fatal(err)
	}
	if err := reg.Register(dom("vm2", 102, g1.HostIf)); err != nil {
		t.Fatal(err)
	}
	if got, want := entries(), "vm2:"+g1.HostIf+":102 vm1:"+g3.HostIf+":101"; got != want {
		t.Fatalf("rules %q, want %q", got, want)
	}
	if id := f.ID(markOf(t, ct, g3, ln)); id != 101 {
		t.Fatalf("vm1's connection from its new tap carries id %d, want 101", id)
	}
	if id := f.ID(markOf(t, ct, g1, ln)); id != 102 {
		t.Fatalf("vm2's connection from vm1's old tap carries id %d, want vm2's 102", id)
	}
	a.vmu.Lock()
	got := a.vguests["vm1"].Mark
	a.vmu.Unlock()
	if got != f.Value(101) {
		t.Fatalf("broker guest vm1 has mark %#x, want %#x", got, f.Value(101))
	}

	// A domain whose metadata claims vm2's address.
	err = reg.Register(dom("thief", 103, g2.HostIf, g1.Addr))
	if err == nil || !strings.Contains(err.Error(), "guest thief and guest vm2 both own "+g1.Addr.String()+"/32") {
		t.Fatalf("a domain claiming vm2's address: %v", err)
	}
	if got := entries(); strings.Contains(got, "thief") {
		t.Fatalf("the refused domain kept a rule: %s", got)
	}

	a.Close()
	if out, err := nsrig.Run(r.HostNSPath(), "nft", "list", "tables"); err != nil || strings.Contains(out, mark.Table) {
		t.Fatalf("hostd's table left after Close: %q, %v", out, err)
	}
}

// markOf connects from guest g to to and returns the connection's
// conntrack mark.
func markOf(t *testing.T, ct *ctrack.Netlink, g *nsrig.Guest, to netip.AddrPort) uint32 {
	t.Helper()
	c := g.Dial(t, to)
	defer c.Close()
	e, err := ct.Lookup(ctrack.Tuple{Src: c.LocalAddr().(*net.TCPAddr).AddrPort(), Dst: to})
	if err != nil {
		t.Fatal(err)
	}
	return e.Mark
}
