package agent

import (
	"strings"
	"sync"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
)

// TestMigrateCommands: migrate-out and migrate-in name a guest that hostd
// knows; a guest without connections migrates out at once (nothing held);
// only a configured guest is re-pointed to a new control socket or tap.
func TestMigrateCommands(t *testing.T) {
	grp := &broker.Group{Name: "t"}
	vm1 := &broker.Guest{Name: "vm1", ID: 1, Group: grp, Source: "config"}
	lv := &broker.Guest{Name: "dom", ID: 2, Group: grp, Source: "libvirt"}
	a := testAgent(t, []*broker.Guest{vm1, lv}, []config.Guest{{Name: "vm1", ID: 1, Group: "t", Control: "/run/vm1.sock", Ports: 1}})
	for _, tc := range []struct {
		name string
		req  admin.Request
		err  string // "" for none
	}{
		{"no guest", admin.Request{Cmd: admin.CmdMigrateOut}, "name the guest"},
		{"unknown guest", admin.Request{Cmd: admin.CmdMigrateOut, Guest: "vm9"}, "no guest named"},
		{"out", admin.Request{Cmd: admin.CmdMigrateOut, Guest: "vm1"}, ""},
		{"in", admin.Request{Cmd: admin.CmdMigrateIn, Guest: "vm1"}, ""},
		{"libvirt re-pointed", admin.Request{Cmd: admin.CmdMigrateIn, Guest: "dom", Interface: "tap9"}, "only configured guests"},
		{"in without a server", admin.Request{Cmd: admin.CmdMigrateIn, Guest: "vm1", Control: "/run/vm1m.sock"}, "not running"},
		{"qmp without one configured", admin.Request{Cmd: admin.CmdMigrateIn, Guest: "vm1", QMP: "/run/vm1m.qmp"}, "no qmp socket"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := a.handle(tc.req)
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("%+v: %v", tc.req, err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("%+v: got %v, want an error with %q", tc.req, err, tc.err)
			case err == nil:
				if rep := out.(admin.MigrateReply); rep.Guest != tc.req.Guest || rep.Moved != 0 || rep.Held != 0 {
					t.Fatalf("%+v: reply %+v, want guest %s, nothing moved or held", tc.req, rep, tc.req.Guest)
				}
			}
		})
	}
}

// TestMigrateInQMP: migrate-in's QMP socket replaces the guest's for
// hostd's later plugs and unplugs (a pair-region VM's destination QEMU);
// other guests keep theirs.
func TestMigrateInQMP(t *testing.T) {
	grp := &broker.Group{Name: "t"}
	vm1 := &broker.Guest{Name: "vm1", ID: 1, Group: grp, Source: "config", SharedRegion: true, PairVM: true}
	vm2 := &broker.Guest{Name: "vm2", ID: 2, Group: grp, Source: "config", SharedRegion: true, PairVM: true}
	a := testAgent(t, []*broker.Guest{vm1, vm2}, []config.Guest{
		{Name: "vm1", ID: 1, Group: "t", Control: "/run/vm1.sock", Ports: 1, QMP: "/run/vm1.qmp"},
		{Name: "vm2", ID: 2, Group: "t", Control: "/run/vm2.sock", Ports: 1, QMP: "/run/vm2.qmp"},
	})
	a.hot = &qmpHotplug{log: hclog.NewNullLogger(), socks: map[uint32]string{1: "/run/vm1.qmp", 2: "/run/vm2.qmp"}, locks: map[uint32]*sync.Mutex{}}
	out, err := a.handle(admin.Request{Cmd: admin.CmdMigrateOut, Guest: "vm1"})
	if err != nil {
		t.Fatal(err)
	}
	if rep := out.(admin.MigrateReply); rep.Unplugged != 0 || rep.Plugged != 0 {
		t.Fatalf("migrate-out of a VM without pair regions: %+v, want none unplugged or left", rep)
	}
	if _, err := a.handle(admin.Request{Cmd: admin.CmdMigrateIn, Guest: "vm1", QMP: "/run/vm1m.qmp"}); err != nil {
		t.Fatal(err)
	}
	if got := a.hot.socks; got[1] != "/run/vm1m.qmp" || got[2] != "/run/vm2.qmp" {
		t.Fatalf("QMP sockets after migrate-in: %v, want vm1's the destination's, vm2's unchanged", got)
	}
}
