package preflight

import (
	"context"
	"fmt"
	"strings"
)

// checkVsock: the VMs with a vsock block (hostd/vsockhost): QEMU offers
// vhost-user-vsock-pci, and the operator is told that a hostd restart
// leaves those VMs without vsock until they restart (QEMU 7.2 cannot
// reconnect the device; docs/vsock.md, "hostd restarts"). The socket
// paths are checked with the others (checkSockets).
func checkVsock(ctx context.Context, e *env) {
	var names []string
	for _, g := range e.cfg.Guests {
		if g.Vsock != nil {
			names = append(names, fmt.Sprintf("%s (cid %d)", g.Name, g.Vsock.CID))
		}
	}
	if len(names) == 0 {
		e.ok("no guest with a vsock block: no vhost-user-vsock devices to serve")
		return
	}
	const qemu = "qemu-system-x86_64"
	if _, err := e.p.LookPath(qemu); err != nil {
		e.warn(fmt.Sprintf("%s not found: cannot check that QEMU offers vhost-user-vsock-pci (QEMU 7.0 or later)", qemu), "apt-get install qemu-system-x86, or ignore on a host whose QEMU lives elsewhere")
	} else {
		dctx, cancel := context.WithTimeout(ctx, probeTimeout)
		out, err := e.p.Command(dctx, qemu, "-device", "help")
		cancel()
		switch {
		case err != nil:
			e.warn(fmt.Sprintf("%s -device help: %v", qemu, err), "check the QEMU installation")
		case !strings.Contains(string(out), "vhost-user-vsock-pci"):
			e.problem(fmt.Sprintf("%s has no vhost-user-vsock-pci device: the VMs' vsock blocks cannot be used", qemu), "install QEMU 7.0 or later")
		}
	}
	e.warn(fmt.Sprintf("hostd serves the vsock devices of %s: QEMU cannot reconnect a vhost-user-vsock device, so a hostd restart leaves these VMs without vsock until each VM restarts", strings.Join(names, ", ")),
		"restart hostd only when these VMs can be restarted too (docs/vsock.md, \"hostd restarts\")")
}
