package preflight

import (
	"context"
	"fmt"
	"strings"

	"github.com/shuntnet/shunt/relay"
)

// checkRDMA: with peers configured, the RDMA devices the relay's link
// between hosts could use (docs/rdma.md). Informational: a link is RDMA
// only if hostd is built with -tags rdma and the peer offers it too, and
// TCP is always there.
func checkRDMA(_ context.Context, e *env) {
	if e.cfg.Peering == nil || e.p.RDMA == nil {
		return
	}
	devs, err := e.p.RDMA()
	if err != nil {
		e.ok("RDMA devices not readable (%v): links between hosts use TCP", err)
		return
	}
	var ports []string
	for _, d := range devs {
		for _, p := range d.Ports {
			ports = append(ports, fmt.Sprintf("%s port %d %s %s", d.Name, p.Num, p.LinkLayer, p.State))
		}
	}
	if len(ports) == 0 {
		e.ok("no RDMA device (/sys/class/infiniband): links between hosts use TCP")
		return
	}
	use := "none active: links between hosts use TCP"
	if d, p, g, ok := relay.PickRDMA(devs, ""); ok {
		use = fmt.Sprintf("the RDMA link would use %s port %d gid %d (with a hostd built with -tags rdma, to peers that offer RDMA too)", d, p, g)
	}
	e.ok("RDMA: %s; %s", strings.Join(ports, ", "), use)
}
