package across

import (
	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

// ringPair attaches the ring pair a READY names in mem, from the relay
// end's side (m.Side): in is the ring the guest writes, out the one it
// reads. The offsets and capacity are hostd's own record, bounded by mem.
func ringPair(mem []byte, m proto.Msg) (in, out *ring.Ring, err error) {
	if mem == nil || m.Capacity == 0 || m.Capacity > 1<<30 {
		return nil, nil, errNoRegion
	}
	size := uint64(ring.Size(int(m.Capacity)))
	if m.RingAB > uint64(len(mem)) || m.RingBA > uint64(len(mem)) ||
		m.RingAB+size > uint64(len(mem)) || m.RingBA+size > uint64(len(mem)) {
		return nil, nil, errNoRegion
	}
	var aerr error
	if err = fault.Do(func() {
		var ab, ba *ring.Ring
		if ab, aerr = ring.Attach(mem[m.RingAB:m.RingAB+size:m.RingAB+size], int(m.Capacity)); aerr != nil {
			return
		}
		if ba, aerr = ring.Attach(mem[m.RingBA:m.RingBA+size:m.RingBA+size], int(m.Capacity)); aerr != nil {
			return
		}
		// The relay is side m.Side: side A writes ring AB.
		in, out = ba, ab
		if m.Side == proto.SideB {
			in, out = ab, ba
		}
	}); err == nil {
		err = aerr // fault.Do's nil would hide Attach's error
	}
	if err != nil {
		return nil, nil, err
	}
	return in, out, err
}
