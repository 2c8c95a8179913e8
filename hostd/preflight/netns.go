package preflight

import (
	"context"
	"fmt"
	"os"
)

// checkNetns looks at how each process or container guest's processes
// reach hostd: with netns, every process in that namespace may (its file
// must exist: hostd would not start); without, only root's, so servers
// that drop privileges or chroot stay on TCP (docs/SECURITY.md, "The
// guest is the principal").
func checkNetns(_ context.Context, e *env) {
	for _, g := range e.cfg.Guests {
		switch {
		case g.SharedRegion:
			continue // a VM: its processes use its ports (the udev rule)
		case g.Netns == "":
			e.ok("guest %s: no netns: its control socket is root's (0600), so its processes that drop privileges or chroot stay on TCP; give it netns = \"/run/netns/NAME\" to let every process in it use the fast path", g.Name)
		default:
			if fi, err := os.Stat(g.Netns); err != nil || !fi.Mode().IsRegular() {
				e.problem(fmt.Sprintf("guest %s: netns %s is not a network namespace file (%v): hostd would not start", g.Name, g.Netns, err),
					"create the namespace (ip netns add NAME), or fix netns")
				continue
			}
			e.ok("guest %s: netns %s: every process in it may use its control channel (socket 0666, checked by namespace; the abstract socket shunt/control inside it)", g.Name, g.Netns)
		}
	}
}
