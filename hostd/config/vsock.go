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
}

type vsockBlock struct {
	Socket string `hcl:"socket"`
	CID    int64  `hcl:"cid"`
}

// vsockOf checks a guest's vsock block against the guests before it: an
// absolute socket path that is no other guest's control or vsock socket,
// and a CID no other guest has. Process guests (netns) have no vsock
// device.
func vsockOf(b *vsockBlock, g Guest, before []Guest) (*Vsock, error) {
	if b == nil {
		return nil, nil
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
		if o.Vsock.Socket == b.Socket {
			return nil, fmt.Errorf("socket %s is already guest %q's", b.Socket, o.Name)
		}
		if o.Vsock.CID == uint32(b.CID) {
			return nil, fmt.Errorf("cid %d is already guest %q's: each VM needs a context id of its own", b.CID, o.Name)
		}
	}
	return &Vsock{Socket: b.Socket, CID: uint32(b.CID)}, nil
}
