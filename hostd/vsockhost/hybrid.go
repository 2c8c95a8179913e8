package vsockhost

import (
	"fmt"
	"net"

	"github.com/shuntnet/shunt/internal/proto"
)

// listen listens for the VM's connections to the host's port: on hostd's
// own device, or, for a hybrid vsock (Firecracker, Cloud Hypervisor), on
// the Unix socket Hybrid_<port> that the hypervisor connects to for each
// of the guest's connections to that port (Firecracker's and Cloud
// Hypervisor's guest-initiated connections). Either way only this
// VM reaches it: the device is the VM's alone, and the socket is mode
// 0600 next to the VM's own hybrid socket.
func (d *device) listen(port uint32) (net.Listener, error) {
	if d.dev != nil {
		return d.dev.Listen(port)
	}
	l, err := listen(fmt.Sprintf("%s_%d", d.spec.Hybrid, port))
	if err != nil {
		return nil, fmt.Errorf("guest %s: hybrid vsock port %d: %w", d.spec.Guest, port, err)
	}
	return l, nil
}

// ListenControl listens for the VM's control channel on its vsock (port
// proto.VsockControlPort), for a VM without virtio-serial (Firecracker)
// or whose library finds no port: hostd serves each connection as a
// session of that guest, as it serves the guest's control socket.
func (r *Room) ListenControl(guest uint32) (net.Listener, error) {
	d := r.devs[guest]
	if d == nil {
		return nil, fmt.Errorf("guest %d has no vsock device", guest)
	}
	return d.listen(proto.VsockControlPort)
}

// Served reports whether the guest's vsock device has a front-end now:
// its QEMU being served, or, for a hybrid vsock, always (the hypervisor
// serves its own device, which outlives hostd). False without a device.
func (r *Room) Served(guest uint32) bool {
	if r == nil {
		return false
	}
	d := r.devs[guest]
	if d == nil {
		return false
	}
	if d.spec.Daemon {
		dp := r.daemon.Load()
		return dp != nil && (*dp).Served(guest)
	}
	if d.dev == nil {
		return true // hybrid: the hypervisor serves its own device
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.sess != nil
}

// Has reports whether the guest with id guest has a vsock device (its
// own or its hypervisor's). A nil Room has none.
func (r *Room) Has(guest uint32) bool {
	return r != nil && r.devs[guest] != nil
}
