package across

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
)

// TestRingPairBrokenRing: a guest that breaks a ring's header between
// READY and the bridge's start gets an error, not nil rings (before,
// fault.Do's nil overwrote Attach's error, and relay.NewBridge got nil
// rings: a nil dereference, which the fault guard does not catch, ended
// hostd).
func TestRingPairBrokenRing(t *testing.T) {
	reg, _ := shmtest.Region(t, region.Geometry{Size: 1 << 20, Slots: 4})
	_, e, err := region.NewPool(reg, nil).Alloc(region.Request{OwnerA: 1, OwnerB: 2, Capacity: 4096})
	if err != nil {
		t.Fatal(err)
	}
	m := proto.Msg{Capacity: uint32(e.Capacity), RingAB: uint64(e.RingAB), RingBA: uint64(e.RingBA), Side: proto.SideB}
	if in, out, err := ringPair(reg.Mem(), m); err != nil || in == nil || out == nil {
		t.Fatalf("ringPair of a sound pair: %v, %v, %v", in, out, err)
	}
	for _, off := range []int64{e.RingAB, e.RingBA} {
		binary.LittleEndian.PutUint32(reg.Mem()[off+ring.OffMagic:], 0)
		in, out, err := ringPair(reg.Mem(), m)
		if !errors.Is(err, ring.ErrCorrupt) || in != nil || out != nil {
			t.Fatalf("ringPair with the ring at %d broken: %v, %v, %v; want ErrCorrupt and no rings", off, in, out, err)
		}
	}
}
