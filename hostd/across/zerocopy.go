package across

import (
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/relay"
)

// Zero copy, sending side (docs/rdma.md): each pair region a relay
// session maps is registered on the peer's RDMA link for the local NIC to
// read (no remote access), so the bridges on its rings send their bytes
// by reference and the NIC reads them from the guest's ring. A
// registration is made when the region is mapped (or when an RDMA link
// comes up), and always removed before the region is unmapped or
// replaced: Region.Deregister waits for the writes that gather from it.
// A TCP link, or a link that cannot gather, copies as before. The VM
// groups' region (id 0) is hostd's own mapping, not the relay's: copied.

// registrar is a link that registers guest regions (relay.RDMALink).
type registrar interface {
	relay.Carrier
	Register(mem []byte) (*relay.Region, error)
}

// register registers region id of s on its peer's link, if that link is
// RDMA and the region is not registered on it yet. A registration on an
// earlier link is dropped (its link deregisters it as it finishes).
func (r *Room) register(s *session, id uint32) {
	l := r.links[s.peer]
	if l == nil || l.l == nil {
		return
	}
	rg, ok := l.l.(registrar)
	mem := s.regions[id]
	if !ok || mem == nil {
		return
	}
	if old := s.regs[id]; old != nil {
		if relay.Carrier(old.Link()) == l.l {
			return
		}
		delete(s.regs, id)
		go old.Deregister() // an ended link's: returns once it finished
	}
	reg, err := rg.Register(mem)
	if err != nil {
		r.log.Warn("cannot register a guest region on the RDMA link; its bytes are copied", "peer", s.peer, "region", id, "error", err)
		return
	}
	s.regs[id] = reg
}

// registerAll registers the regions of peer's sessions on its new link.
func (r *Room) registerAll(peer string) {
	for _, s := range r.sessions {
		if s.peer == peer {
			for id := range s.regions {
				r.register(s, id)
			}
		}
	}
}

// region is the registration of region id of s on link lk, or nil.
func (s *session) region(id uint32, lk relay.Carrier) *relay.Region {
	if reg := s.regs[id]; reg != nil && relay.Carrier(reg.Link()) == lk {
		return reg
	}
	return nil
}

// unmap takes region id of s away (mem, its mapping): its registration,
// if any, is removed first (it waits for the writes gathering from it),
// then the mapping, off the event loop.
func (s *session) unmap(id uint32, mem []byte) {
	reg := s.regs[id]
	delete(s.regs, id)
	go func() {
		if reg != nil {
			reg.Deregister()
		}
		_ = munmap(mem)
	}()
}

// munmap unmaps a region (a variable for tests).
var munmap = unix.Munmap
