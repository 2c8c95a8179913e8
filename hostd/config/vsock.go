package config

import (
	"fmt"
	"path/filepath"
)

// Vsock is a VM's vhost-user-vsock device, served by hostd (hostd/vsockhost,
// docs/vsock.md): QEMU's vhost-user-vsock-pci connects to Socket, and the
// guest's context id is CID.
type Vsock struct {
	Socket string // the vhost-user Unix socket hostd listens on (QEMU -chardev socket,path=...)
	CID    uint32 // the guest's context id, 3 to 0xfffffffe, unique on this host
	// Hybrid, instead of Socket and CID, is the hybrid vsock socket of a
	// hypervisor with a vsock device of its own (Firecracker's uds_path,
	// Cloud Hypervisor's --vsock socket): hostd listens at Hybrid_<port>
	// for the guest's connections to the host.
	Hybrid string
}

type vsockBlock struct {
	Socket string `hcl:"socket,optional"`
	CID    int64  `hcl:"cid,optional"`
	Hybrid string `hcl:"hybrid,optional"`
}

// vsockOf checks a guest's vsock block against the guests before it: an
// absolute socket path that is no other guest's control or vsock socket,
// and a CID no other guest has. Process guests (netns) have no vsock
// device.
func vsockOf(b *vsockBlock, g Guest, before []Guest) (*Vsock, error) {
	if b == nil {
		return nil, nil
	}
	if b.Hybrid != "" {
		return hybridOf(b, g, before)
	}
	switch {
	case !filepath.IsAbs(b.Socket):
		return nil, fmt.Errorf("socket %q: want an absolute path (QEMU's -chardev socket,path=)", b.Socket)
	case b.CID < 3 || b.CID > 0xfffffffe:
		return nil, fmt.Errorf("cid %d: want 3 to %d (0-2 are reserved, -1 is VMADDR_CID_ANY)", b.CID, uint32(0xfffffffe))
	case g.Netns != "":
		return nil, fmt.Errorf("a process guest (netns) has no vsock device: remove the block or the netns")
	}
	if b.Socket == g.Control {
		return nil, fmt.Errorf("socket %s is the guest's control socket: give the device a path of its own", b.Socket)
	}
	for _, o := range before {
		if o.Control == b.Socket {
			return nil, fmt.Errorf("socket %s is guest %q's control socket", b.Socket, o.Name)
		}
		if o.Vsock == nil {
			continue
		}
		if o.Vsock.Socket == b.Socket || o.Vsock.Hybrid == b.Socket {
			return nil, fmt.Errorf("socket %s is already guest %q's", b.Socket, o.Name)
		}
		if o.Vsock.CID == uint32(b.CID) {
			return nil, fmt.Errorf("cid %d is already guest %q's: each VM needs a context id of its own", b.CID, o.Name)
		}
	}
	return &Vsock{Socket: b.Socket, CID: uint32(b.CID)}, nil
}

// hybridOf checks a hybrid vsock block: an absolute path, without socket
// or cid (the hypervisor owns the device and its CID), no other guest's
// socket or hybrid path.
func hybridOf(b *vsockBlock, g Guest, before []Guest) (*Vsock, error) {
	switch {
	case b.Socket != "" || b.CID != 0:
		return nil, fmt.Errorf("hybrid %q with socket or cid: give hybrid alone (the hypervisor's device has its own CID)", b.Hybrid)
	case !filepath.IsAbs(b.Hybrid):
		return nil, fmt.Errorf("hybrid %q: want an absolute path (Firecracker's uds_path, Cloud Hypervisor's --vsock socket)", b.Hybrid)
	case g.Netns != "":
		return nil, fmt.Errorf("a process guest (netns) has no vsock device: remove the block or the netns")
	case b.Hybrid == g.Control:
		return nil, fmt.Errorf("hybrid %s is the guest's control socket", b.Hybrid)
	}
	for _, o := range before {
		if o.Control == b.Hybrid || o.Vsock != nil && (o.Vsock.Socket == b.Hybrid || o.Vsock.Hybrid == b.Hybrid) {
			return nil, fmt.Errorf("hybrid %s is already guest %q's", b.Hybrid, o.Name)
		}
	}
	return &Vsock{Hybrid: b.Hybrid}, nil
}

// checkVsockd sets c.VsockdSocket from sock: an absolute path that is no
// other socket of hostd's; with it, each QEMU device's socket leaves room
// for the forwards shunt-vsockd makes next to it (<socket>_1021, _1022).
func (c *Config) checkVsockd(sock string) error {
	if c.VsockdSocket = sock; sock == "" {
		return nil
	}
	if !filepath.IsAbs(sock) || filepath.Clean(sock) != sock {
		return fmt.Errorf("vsockd_socket %q: want a clean absolute path (shunt-vsockd -socket)", sock)
	}
	if sock == c.AdminSocket || sock == c.ContainerSocket {
		return fmt.Errorf("vsockd_socket %s is another socket of hostd's: give it its own path, such as /run/shunt/vsockd.sock", sock)
	}
	for _, g := range c.Guests {
		if g.Control == sock || g.Vsock != nil && (g.Vsock.Socket == sock || g.Vsock.Hybrid == sock) {
			return fmt.Errorf("vsockd_socket %s is guest %q's socket", sock, g.Name)
		}
		if g.Vsock != nil && g.Vsock.Socket != "" && (len(g.Vsock.Socket) > 102 || filepath.Clean(g.Vsock.Socket) != g.Vsock.Socket) {
			return fmt.Errorf("guest %s: vsock socket %s: with vsockd_socket, want a clean path of at most 102 bytes (shunt-vsockd forwards to <socket>_1022)", g.Name, g.Vsock.Socket)
		}
	}
	return nil
}
