//go:build linux

package agent

import (
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// TestRemarkKeepsMarkID: migrate-in's new interface takes over the
// guest's rule in hostd's nftables table with the same mark id (the
// conntrack entries of its connections carry it), and the old interface
// marks nothing any more.
func TestRemarkKeepsMarkID(t *testing.T) {
	testenv.NeedRoot(t)
	testenv.NeedTool(t, "nft", "nftables")
	r, err := nsrig.New("remark", 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Create(); err != nil {
		t.Fatal(err)
	}
	defer r.Destroy()
	m, err := mark.Open(mark.Options{Netns: r.HostNSPath()})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	a := &Agent{log: hclog.NewNullLogger(), marks: m}
	g := &broker.Guest{Name: "vm2", ID: 102}
	if err := a.markGuest(g, "tapold"); err != nil {
		t.Fatal(err)
	}
	if g.Mark == 0 {
		t.Fatal("no mark id")
	}
	if err := a.remark(g, "tapnew"); err != nil {
		t.Fatal(err)
	}
	es := m.Entries()
	if len(es) != 1 || es[0].Ifname != "tapnew" || es[0].Value != g.Mark {
		t.Fatalf("entries %+v: want vm2 on tapnew with mark %#x", es, g.Mark)
	}
}
