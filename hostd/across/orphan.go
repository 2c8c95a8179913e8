package across

import (
	"errors"
	"fmt"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/wait"
)

// An orphaned stretch is a relayed ring pair whose relay died with its
// hostd (SIGKILL): the guest still holds it, nobody reads the ring it
// writes or writes the ring it reads, and the peer host waits for this
// host's "stop" (where the ring toward the guest ended) to resume its own
// guest. A restarted hostd knows nothing of the stretch but what the
// region holds, which the guest can write: every mark and index read here
// is untrusted, checked against the shadow's ring layout (READY's offsets
// and capacity, never the guest-writable directory), bounded, and read
// under the fault guard (a guest that truncated its region).
//
// adopt.go adopts such stretches and resumes them (docs/crosshost.md,
// "A SIGKILLed hostd").

// orphanEnd is what an orphaned stretch's rings say of its two directions.
type orphanEnd struct {
	// The ring the dead relay wrote (the guest reads): where this host's
	// side of the stretch ended, for the peer's guest to resume at
	// (Started false: it never started, the peer's guest resends all).
	Out relay.End
	// The ring the guest writes: its stretch [InStart, InStart+InWritten),
	// of which the relay freed up to InStart+InFreed (the peer's ring held
	// them). InStarted false: the guest never started it.
	InStarted                   bool
	InStart, InFreed, InWritten uint64
}

// errOrphan: an orphaned stretch's rings break the format's rules; its
// connection cannot resume at a known offset and is reset.
var errOrphan = errors.New("orphaned relayed stretch: its rings are not a valid stretch")

// readOrphan reads the ends of an orphaned stretch in mem (the region's
// mapping) laid out as m says (the shadow's READY for the relay's side:
// RingAB, RingBA, Capacity, Side). It changes nothing.
func readOrphan(mem []byte, m proto.Msg) (orphanEnd, error) {
	in, out, err := ringPair(mem, m)
	if err != nil {
		return orphanEnd{}, err
	}
	var o orphanEnd
	var is, os ring.Stats
	if err := fault.Do(func() { is, os = in.Stats(), out.Stats() }); err != nil {
		return orphanEnd{}, fmt.Errorf("%w: %v", errOrphan, err)
	}
	capacity := uint64(m.Capacity)
	if o.Out.Started, o.Out.Start, o.Out.X, err = relay.RingEnd(os, capacity); err != nil {
		return orphanEnd{}, fmt.Errorf("%w: the ring toward the guest: %v", errOrphan, err)
	}
	if o.InStarted, o.InStart, _, err = relay.RingEnd(is, capacity); err != nil {
		return orphanEnd{}, fmt.Errorf("%w: the guest's ring: %v", errOrphan, err)
	}
	o.InFreed, o.InWritten = is.Read, is.Written
	return o, nil
}

// holds reports whether the guest's write ring still holds the stream
// from offset at on (what the peer's ring did not get): the guest resends
// [at, its end) from it. An offset outside is one the guest's library
// would refuse too (its connection is reset).
func (o orphanEnd) holds(at uint64) bool {
	if !o.InStarted {
		return true // nothing was written to the ring: the offset is ignored
	}
	return at >= o.InStart+o.InFreed && at <= o.InStart+o.InWritten
}

// leaveOrphan marks the ring toward the guest left, as the dead relay's
// bridge would have at its Stop: the guest's reader drains it and reads
// TCP at its end (the offset readOrphan returned).
func leaveOrphan(mem []byte, m proto.Msg) error {
	_, out, err := ringPair(mem, m)
	if err != nil {
		return err
	}
	return fault.Do(func() { out.MarkLeft(&wait.Policy{}) })
}
