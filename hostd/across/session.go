package across

import (
	"fmt"
	"os"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
)

// session is the relay's session with the broker for one peer and one
// trust group: the other end of that group's connections to that peer.
// The broker sees a guest of the group that owns no address (Guest.Relay)
// and a session that speaks the guest protocol; its messages come to the
// event loop. The region files it is handed are mapped here: the
// bridges read and write the rings in them.
type session struct {
	r       *Room
	peer    string
	g       *broker.Guest
	conns   map[uint32]*xconn // by its request ids (owned by the event loop)
	nextReq uint32
	regions map[uint32][]byte        // mapped regions by id (owned by the event loop)
	regs    map[uint32]*relay.Region // their registrations on the peer's RDMA link (zerocopy.go; the event loop's)
	gate    *atomic.Bool             // the peer's link is up (shared with its plink)
	kicks   vmKicks                  // the bridges of VM guests, for their KICKs
}

type sessKey struct{ peer, group string }

// session returns the relay session for peer and g's trust group, making
// and registering it with the broker the first time.
func (r *Room) session(peer string, g *broker.Guest) (*session, error) {
	if g.Group == nil {
		return nil, fmt.Errorf("guest %s has no trust group", g.Name)
	}
	k := sessKey{peer, g.Group.Name}
	if s := r.sessions[k]; s != nil {
		return s, nil
	}
	r.nextGID++
	s := &session{r: r, peer: peer, conns: map[uint32]*xconn{}, regions: map[uint32][]byte{}, regs: map[uint32]*relay.Region{}, gate: &r.link(peer).up,
		g: &broker.Guest{Name: "relay/" + peer + "/" + g.Group.Name, ID: broker.RelayIDBase + r.nextGID, Group: g.Group}}
	if err := r.b.AddRelay(s.g, s); err != nil {
		return nil, err
	}
	r.sessions[k] = s
	return s, nil
}

func (s *session) newReq() uint32 {
	s.nextReq++
	if s.nextReq == 0 {
		s.nextReq++
	}
	return s.nextReq
}

// Guest is broker.Session's.
func (s *session) Guest() *broker.Guest { return s.g }

// Relays marks the session as a relay's (broker.Relay).
func (s *session) Relays() {}

// Switching: the relay speaks path switching.
func (s *session) Switching() bool { return true }

// Gate holds upgrades while the peer's relay link is down.
func (s *session) Gate() proto.Reason {
	if !s.gate.Load() {
		return proto.ReasonPeerUnreachable
	}
	return proto.ReasonNone
}

// Send is broker.Session's: called under the broker's lock, it only
// queues the message for the event loop.
// A VM guest's KICK wakes its bridge at once (vmwake.go).
func (s *session) Send(m proto.Msg) {
	if m.Type == proto.Kick {
		s.kicks.kicked(m)
		return
	}
	s.r.post(func() { s.r.fromBroker(s, m) })
}

// regionMem is the mapping of a region of this session's flows: one
// handed to it (a pair region), or, for 0, its trust group's region
// through hostd's own mapping (VMs' connections across hosts).
func (s *session) regionMem(id uint32) []byte {
	if id == 0 {
		if p := s.g.Group.Pool; p != nil {
			return p.Region().Mem()
		}
		return nil
	}
	return s.regions[id]
}

// SendFile is broker.FileSender's: a region for this session's flows. It
// is mapped here at once (the broker may close its file after).
func (s *session) SendFile(m proto.Msg, f *os.File) {
	mem, err := unix.Mmap(int(f.Fd()), 0, int(m.RegionSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		s.r.log.Warn("cannot map a region for the relay", "region", m.RegionID, "error", err)
		mem = nil
	}
	s.r.post(func() {
		if old := s.regions[m.RegionID]; old != nil {
			delete(s.regions, m.RegionID)
			s.unmap(m.RegionID, old) // its registration first
		}
		if mem != nil {
			s.regions[m.RegionID] = mem
			s.r.register(s, m.RegionID)
		}
	})
}

// fromBroker handles one of the broker's messages to a relay session.
func (r *Room) fromBroker(s *session, m proto.Msg) {
	switch m.Type {
	case proto.Ready:
		if x := s.conns[m.ReqID]; x != nil {
			r.ready(x, m)
		} else {
			r.leaveUnknown(s, m)
		}
	case proto.Down, proto.Revoke:
		if x := s.conns[m.ReqID]; x != nil {
			r.down(x, m.Reason)
		}
	case proto.Close: // the guest end is done (broker: endDoneLocked)
		if x := s.conns[m.ReqID]; x != nil {
			x.closing = true
			r.maybeClose(x)
		}
	case proto.Unregion:
		if mem := s.regions[m.RegionID]; mem != nil {
			delete(s.regions, m.RegionID)
			s.unmap(m.RegionID, mem) // its registration first
		}
	}
}

// leaveUnknown answers a READY for a request the room forgot: it leaves
// the ring pair at once, so the broker frees it.
func (r *Room) leaveUnknown(s *session, m proto.Msg) {
	r.b.Left(s, proto.Msg{Type: proto.Left, ReqID: m.ReqID, RegionID: m.RegionID, Slot: m.Slot, Gen: m.Gen, Side: m.Side})
}
