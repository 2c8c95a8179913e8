//go:build linux

package mark_test

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"

	"github.com/shuntnet/shunt/hostd/ctrack"
	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestMarksConnections runs the marker in a rig's host namespace against
// real connections: the table appears with one rule per guest in each
// chain; a connection from a guest's interface carries its id in the
// conntrack mark, next to the operator's own bits (set by the rig's
// firewall); the id follows the guest to another interface, and the guest
// that then gets its old interface gets its own id; the keeper puts a
// removed table back; Close removes it.
func TestMarksConnections(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New("mark", 3)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatal(err)
	}
	defer r.Destroy()
	// The operator's rule sets the whole mark, before hostd's chains run.
	if err := r.Firewall("ct state new ct mark set 0x5"); err != nil {
		t.Fatal(err)
	}
	ct, err := ctrack.Dial(r.HostNSPath())
	if err != nil {
		t.Fatal(err)
	}
	defer ct.Close()
	if n, err := mark.Probe(r.HostNSPath()); err != nil || n != -1 {
		t.Fatalf("probe before hostd's table exists: %d, %v; want -1", n, err)
	}
	m, err := mark.Open(mark.Options{Netns: r.HostNSPath(), Resync: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	g1, g2, g3 := r.Guests[0], r.Guests[1], r.Guests[2]
	f := m.Field()

	a, err := m.Add("a", 1, g1.HostIf)
	if err != nil || a.ID != 1 || a.Value != 0x10000 {
		t.Fatalf("add a: %+v, %v; want id 1 (its guest id), mark 0x10000", a, err)
	}
	if _, err := m.Add("intruder", 2, g1.HostIf); err == nil {
		t.Fatal("a second guest on a's interface was accepted")
	}
	checkRules(t, r, []string{"a"})
	if n, err := mark.Probe(r.HostNSPath()); err != nil || n != 1 {
		t.Fatalf("probe with hostd's table: %d, %v; want 1 rule per chain", n, err)
	}
	if out, _ := nsrig.Run(r.HostNSPath(), "nft", "list", "tables"); strings.Contains(out, mark.Table+"_check") {
		t.Fatalf("the probe left its table: %s", out)
	}
	ln := g2.Listen(t)
	if got := connMark(t, ct, g1, ln) &^ f.Proof(); got != 0x10005 {
		t.Fatalf("mark of g1's connection %#x, want 0x10005 (a's id 1 and the operator's 0x5)", got)
	}

	// a moves to g3's interface (it goes and comes back, as a restarted
	// VM does) and keeps its id; b gets g1's old one and its own id.
	if _, err := m.Add("a", 1, g2.HostIf); err == nil {
		t.Fatal("a second rule for guest a was accepted")
	}
	m.Remove("a")
	moved, err := m.Add("a", 1, g3.HostIf)
	if err != nil || moved.ID != a.ID || moved.Ifname != g3.HostIf {
		t.Fatalf("move a: %+v, %v", moved, err)
	}
	b, err := m.Add("b", 1000000, g1.HostIf)
	if err != nil || b.ID == a.ID || b.ID == 0 {
		t.Fatalf("add b on a's old interface: %+v, %v; want its own id", b, err)
	}
	checkRules(t, r, []string{"b", "a"}) // by interface: sh-mark-1, sh-mark-3
	if got := f.ID(connMark(t, ct, g3, ln)); got != a.ID {
		t.Fatalf("g3's connection carries id %d, want a's %d", got, a.ID)
	}
	if got := f.ID(connMark(t, ct, g1, ln)); got != b.ID {
		t.Fatalf("g1's connection carries id %d, want b's %d", got, b.ID)
	}
	m.Remove("b")
	if got := connMark(t, ct, g1, ln) &^ f.Proof(); got != 0x5 {
		t.Fatalf("after b's removal g1's connection has mark %#x, want only the operator's 0x5", got)
	}

	// Someone deletes the table: the keeper puts it back.
	c := nftConn(t, r)
	c.DelTable(&nftables.Table{Name: mark.Table, Family: nftables.TableFamilyINet})
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for m.Reinstalls() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the keeper did not put the deleted table back within 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	checkRules(t, r, []string{"a"})

	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if out, err := nsrig.Run(r.HostNSPath(), "nft", "list", "tables"); err != nil || strings.Contains(out, mark.Table) {
		t.Fatalf("table left after Close: %q, %v", out, err)
	}
}

func nftConn(t *testing.T, r *nsrig.Rig) *nftables.Conn {
	t.Helper()
	ns, err := netns.GetFromPath(r.HostNSPath())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// checkRules: both chains hold one rule per guest, in this order, as nft
// shows them.
func checkRules(t *testing.T, r *nsrig.Rig, guests []string) {
	t.Helper()
	out, err := nsrig.Run(r.HostNSPath(), "nft", "list", "table", "inet", mark.Table)
	if err != nil {
		t.Fatal(err)
	}
	for _, chain := range []string{"forward", "input"} {
		i := strings.Index(out, "chain "+chain)
		if i < 0 {
			t.Fatalf("no chain %s:\n%s", chain, out)
		}
		body := out[i:]
		body = body[:strings.Index(body, "}")]
		if !strings.Contains(body, "hook "+chain+" priority 100;") {
			t.Errorf("chain %s hook:\n%s", chain, body)
		}
		if n := strings.Count(body, "ct mark set"); n != len(guests) {
			t.Fatalf("chain %s has %d mark rules, want %d:\n%s", chain, n, len(guests), out)
		}
		last := 0
		for _, g := range guests {
			j := strings.Index(body, `comment "shunt guest `+g+`"`)
			if j < last {
				t.Fatalf("chain %s: guest %s's rule missing or out of order:\n%s", chain, g, body)
			}
			last = j
		}
	}
}

// connMark connects from guest g to to and returns the conntrack mark of
// the connection.
func connMark(t *testing.T, ct *ctrack.Netlink, g *nsrig.Guest, to netip.AddrPort) uint32 {
	t.Helper()
	c := g.Dial(t, to)
	defer c.Close()
	tu := ctrack.Tuple{Src: c.LocalAddr().(*net.TCPAddr).AddrPort(), Dst: to}
	e, err := ct.Lookup(tu)
	if errors.Is(err, ctrack.ErrNotFound) {
		t.Fatalf("no conntrack entry for %s", tu)
	}
	if err != nil {
		t.Fatal(fmt.Errorf("lookup %s: %w", tu, err))
	}
	return e.Mark
}
