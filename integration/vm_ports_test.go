package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/integration/vm"
)

// TestVMPortsShared: three guestlib clients with no settings in one VM
// with two control ports, as three programs would be (cmd/shunt-vm-agent
// port-clients): the first takes the first port; the second finds it busy
// (the guest kernel's EBUSY) and takes the next one; both get the fast
// path. The third finds every port busy: its connection stays on TCP with
// reason control-limit, and its log says so once, although it keeps
// trying. All three streams arrive whole (docs/vm.md, "Discovery").
func TestVMPortsShared(t *testing.T) {
	v := newVMEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a1, _ := vmAddr(1)
	srv := v.boot(1, "accept-many", "7000", "3")
	mustWait(t, ctx, srv, "SHUNT-VM LISTENING")
	cli := v.boot(2, "port-clients", a1.String()+":7000", "3", fmt.Sprint(4<<20))
	want := []struct{ port, path string }{{"/dev/vport", "shunt"}, {"/dev/vport", "shunt"}, {"none", "tcp(control-limit)"}}
	var ports []string
	for i, w := range want {
		l := mustWait(t, ctx, cli, fmt.Sprintf("SHUNT-VM CLIENT %d PORT ", i))
		f := strings.Fields(l) // SHUNT-VM CLIENT i PORT p PATH path
		if len(f) != 7 || !strings.HasPrefix(f[4], w.port) || f[6] != w.path {
			t.Fatalf("client %d: %q, want port %s... and path %s", i, l, w.port, w.path)
		}
		ports = append(ports, f[4])
	}
	if ports[0] == ports[1] {
		t.Fatalf("clients 0 and 1 both took %s", ports[0])
	}
	for _, m := range []*vm.VM{cli, srv} {
		l, err := m.WaitAny(ctx, 0, "SHUNT-VM AGENT-EXIT", "SHUNT-VM ERROR")
		if err != nil || l != "SHUNT-VM AGENT-EXIT 0" {
			t.Fatalf("%s: %q, %v; want AGENT-EXIT 0", m.Name, l, err)
		}
	}
	var sent, recv []string
	busy := 0
	for _, l := range strings.Split(cli.Console(), "\n") {
		if rest, ok := strings.CutPrefix(l, "SHUNT-VM CLIENT "); ok && strings.Contains(rest, " SENT ") {
			sent = append(sent, rest[strings.Index(rest, " SENT ")+len(" SENT "):])
		}
		if strings.HasPrefix(l, "SHUNT-VM LOG2 ") && strings.Contains(l, "in use by another process") {
			busy++
		}
	}
	for _, l := range strings.Split(srv.Console(), "\n") {
		if rest, ok := strings.CutPrefix(l, "SHUNT-VM RECV "); ok {
			recv = append(recv, rest)
		}
	}
	slices.Sort(sent)
	slices.Sort(recv)
	if len(sent) != 3 || !slices.Equal(sent, recv) {
		t.Fatalf("sent %q, received %q: want three equal streams", sent, recv)
	}
	if busy != 1 {
		t.Fatalf("client 2 logged %d lines saying every port is in use, want 1", busy)
	}
	t.Logf("ports %q; streams %q", ports[:2], sent)
}
