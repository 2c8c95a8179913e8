package preflight

import (
	"context"
	"fmt"
	"strings"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
)

// checkVsock: the VMs with a vsock block (hostd/vsockhost): QEMU offers
// vhost-user-vsock-pci, and the operator is told that a hostd restart
// leaves those VMs without vsock until they restart (QEMU 7.2 cannot
// reconnect the device; docs/vsock.md, "hostd restarts"). The socket
// paths are checked with the others (checkSockets).
func checkVsock(ctx context.Context, e *env) {
	var names, hybrids []string
	for _, g := range e.cfg.Guests {
		switch {
		case g.Vsock == nil:
		case g.Vsock.Hybrid != "":
			hybrids = append(hybrids, fmt.Sprintf("%s (%s)", g.Name, g.Vsock.Hybrid))
		default:
			names = append(names, fmt.Sprintf("%s (cid %d)", g.Name, g.Vsock.CID))
		}
	}
	if len(hybrids) > 0 {
		// The hypervisor (Firecracker, Cloud Hypervisor) connects to
		// these as the guest connects to the host's ports: hostd serves
		// the control channel and the stretches there, mode 0600.
		e.ok("hybrid vsock (the hypervisor's own device) for %s: hostd listens at <path>_%d (control) and <path>_%d (stretches); the hypervisor must be able to connect to them (root, or the same user)",
			strings.Join(hybrids, ", "), proto.VsockControlPort, relay.VsockPort)
	}
	if len(names) == 0 {
		if len(hybrids) == 0 {
			e.ok("no guest with a vsock block: no vhost-user-vsock devices to serve")
		}
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
	if e.cfg.VsockdSocket != "" {
		checkVsockdPaths(e)
		checkVsockd(ctx, e, names)
		return
	}
	e.warn(fmt.Sprintf("hostd serves the vsock devices of %s: QEMU cannot reconnect a vhost-user-vsock device, so a hostd restart leaves these VMs without vsock until each VM restarts", strings.Join(names, ", ")),
		"set vsockd_socket and run shunt-vsockd (systemctl enable --now shunt-vsockd), or restart hostd only when these VMs can be restarted too (docs/vsock.md, \"hostd restarts\")")
}

// checkVsockd: with vsockd_socket, shunt-vsockd serves the QEMU VMs'
// devices (hostd/vsockd): it must answer on its socket, and it is what
// must not restart under running VMs.
func checkVsockd(ctx context.Context, e *env, names []string) {
	dctx, cancel := context.WithTimeout(ctx, probeTimeout)
	err := e.p.DialPacket(dctx, e.cfg.VsockdSocket)
	cancel()
	if err != nil {
		e.warn(fmt.Sprintf("shunt-vsockd does not answer at %s (%v): the vsock devices of %s are not served until it does (their QEMUs cannot start; hostd keeps their flows on TCP, vsock-down, and dials it every second)",
			e.cfg.VsockdSocket, err, strings.Join(names, ", ")), "systemctl enable --now shunt-vsockd (its -socket must be vsockd_socket)")
		return
	}
	e.ok("shunt-vsockd answers at %s and serves the vsock devices of %s: a hostd restart keeps them; restarting shunt-vsockd itself leaves these VMs without vsock until each restarts",
		e.cfg.VsockdSocket, strings.Join(names, ", "))
}

// vsockdWritable is the one directory shunt-vsockd's unit may write
// (hostd/dist/shunt-vsockd.service: ProtectSystem=strict,
// ReadWritePaths=/run/shunt, no capability).
const vsockdWritable = "/run/shunt"

// checkVsockdPaths: a device socket outside vsockdWritable cannot be
// made by the daemon as its unit ships (the bind fails: read-only file
// system), so that VM's QEMU has no device to connect to.
func checkVsockdPaths(e *env) {
	var out []string
	for _, g := range e.cfg.Guests {
		if g.Vsock != nil && g.Vsock.Hybrid == "" && !strings.HasPrefix(g.Vsock.Socket, vsockdWritable+"/") {
			out = append(out, fmt.Sprintf("%s (%s)", g.Name, g.Vsock.Socket))
		}
	}
	if len(out) == 0 {
		return
	}
	e.warn(fmt.Sprintf("the vsock device sockets of %s are outside %s, the only directory shunt-vsockd.service may write (ProtectSystem=strict): the daemon cannot make them unless its unit is extended",
		strings.Join(out, ", "), vsockdWritable),
		fmt.Sprintf("put the sockets under %s/, or add their directories to the unit by a drop-in: systemctl edit shunt-vsockd, then [Service] ReadWritePaths=%s /your/dir, and systemctl restart shunt-vsockd (costs running VMs their vsock)", vsockdWritable, vsockdWritable))
}
