package across

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/shuntnet/shunt/internal/fault"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

// orphanRig is a relayed ring pair as a killed hostd's relay left it: the
// guest is side A (it writes ring AB, reads BA), the relay was side B.
type orphanRig struct {
	mem []byte
	m   proto.Msg // the relay side's READY: the layout the shadow gives
}

const orphanCap = 4096

func newOrphanRig(t *testing.T) *orphanRig {
	t.Helper()
	reg, _ := shmtest.Region(t, region.Geometry{Size: 1 << 20, Slots: 4})
	pool := region.NewPool(reg, nil)
	_, e, err := pool.Alloc(region.Request{OwnerA: 1, OwnerB: 2, Capacity: orphanCap})
	if err != nil {
		t.Fatal(err)
	}
	return &orphanRig{mem: reg.Mem(), m: proto.Msg{Type: proto.Ready, Capacity: uint32(e.Capacity),
		RingAB: uint64(e.RingAB), RingBA: uint64(e.RingBA), Side: proto.SideB}}
}

// stream plays a stretch: the guest started its ring at 1000 and wrote
// 300 bytes, of which the relay freed 100 (the peer's ring held them);
// the relay started the guest's read ring at 5000 and wrote 200 bytes.
func (o *orphanRig) stream(t *testing.T) {
	t.Helper()
	p := &wait.Policy{}
	ab, err := ring.Attach(o.mem[o.m.RingAB:o.m.RingAB+uint64(ring.Size(orphanCap))], orphanCap)
	if err != nil {
		t.Fatal(err)
	}
	ba, err := ring.Attach(o.mem[o.m.RingBA:o.m.RingBA+uint64(ring.Size(orphanCap))], orphanCap)
	if err != nil {
		t.Fatal(err)
	}
	rd, _ := ring.NewReader(ab, p) // the relay reads the guest's ring
	rd.Attach()
	w, _ := ring.NewWriter(ab, p) // the guest
	w.Start(1000)
	if _, err := w.Write(make([]byte, 300)); err != nil {
		t.Fatal(err)
	}
	if b, err := rd.TryPeekAt(0, 300); err != nil || len(b) != 300 {
		t.Fatalf("peek: %d bytes, %v", len(b), err)
	}
	if err := rd.Free(100); err != nil {
		t.Fatal(err)
	}
	ow, _ := ring.NewWriter(ba, p) // the relay writes the guest's read ring
	ow.Start(5000)
	if _, err := ow.Write(make([]byte, 200)); err != nil {
		t.Fatal(err)
	}
}

// hdr is the raw header of the guest's read ring (out) or write ring.
func (o *orphanRig) hdr(out bool) []byte {
	off := o.m.RingAB
	if out {
		off = o.m.RingBA
	}
	return o.mem[off : off+ring.HeaderSize]
}

func TestOrphanEnds(t *testing.T) {
	o := newOrphanRig(t)
	got, err := readOrphan(o.mem, o.m)
	if err != nil || got.Out.Started || got.InStarted {
		t.Fatalf("a fresh pair: %+v, %v; want never started", got, err)
	}
	o.stream(t)
	got, err = readOrphan(o.mem, o.m)
	want := orphanEnd{Out: relay.End{Started: true, Start: 5000, X: 5200}, InStarted: true, InStart: 1000, InFreed: 100, InWritten: 300}
	if err != nil || got != want {
		t.Fatalf("readOrphan = %+v, %v; want %+v", got, err, want)
	}
	for at, ok := range map[uint64]bool{1099: false, 1100: true, 1250: true, 1300: true, 1301: false} {
		if got.holds(at) != ok {
			t.Errorf("holds(%d) = %v, want %v", at, !ok, ok)
		}
	}
	if err := leaveOrphan(o.mem, o.m); err != nil {
		t.Fatal(err)
	}
	if fl := binary.LittleEndian.Uint32(o.hdr(true)[ring.OffWFlags:]); fl&ring.FlagLeft == 0 {
		t.Fatalf("the guest's read ring is not marked left (flags %#x)", fl)
	}
	if fl := binary.LittleEndian.Uint32(o.hdr(false)[ring.OffRFlags:]); fl&ring.FlagReaderLeft != 0 {
		t.Fatalf("the guest's write ring was marked reader-left: its writer would leave at its tail and lose the bytes the peer lacks")
	}
}

// TestOrphanHostileRings: whatever a guest wrote into its region's ring
// headers, or a layout that does not fit the mapping, readOrphan returns
// errOrphan or errNoRegion: no panic, no offset from a broken ring.
func TestOrphanHostileRings(t *testing.T) {
	u64 := func(out bool, off int, v uint64) func(*orphanRig) {
		return func(o *orphanRig) { binary.LittleEndian.PutUint64(o.hdr(out)[off:], v) }
	}
	u32 := func(out bool, off int, v uint32) func(*orphanRig) {
		return func(o *orphanRig) { binary.LittleEndian.PutUint32(o.hdr(out)[off:], v) }
	}
	both := func(fs ...func(*orphanRig)) func(*orphanRig) {
		return func(o *orphanRig) {
			for _, f := range fs {
				f(o)
			}
		}
	}
	for _, c := range []struct {
		name string
		mess func(*orphanRig)
		want error
	}{
		{"out magic", u32(true, ring.OffMagic, 0xdead), ring.ErrCorrupt},
		{"in capacity", u64(false, ring.OffCapacity, orphanCap*2), ring.ErrCorrupt},
		{"out tail past head+capacity", u64(true, ring.OffTail, 100+orphanCap+1), errOrphan},
		{"out head past tail", u64(true, ring.OffHead, 201), errOrphan},
		{"out start at MaxStart", u64(true, ring.OffStart, relay.MaxStart), errOrphan},
		{"out tail at MaxStart", both(u64(true, ring.OffTail, relay.MaxStart), u64(true, ring.OffHead, relay.MaxStart-10)), errOrphan},
		{"out bytes without a start", u32(true, ring.OffWFlags, 0), errOrphan},
		{"out reset", u32(true, ring.OffReset, 1), errOrphan},
		{"in head past tail", u64(false, ring.OffHead, 301), errOrphan},
		{"in tail wrapped", u64(false, ring.OffTail, ^uint64(0)), errOrphan},
		{"in start huge", u64(false, ring.OffStart, ^uint64(0)), errOrphan},
		{"layout past the mapping", func(o *orphanRig) { o.m.RingBA = uint64(len(o.mem)) - 100 }, errNoRegion},
		{"layout overflows", func(o *orphanRig) { o.m.RingAB = ^uint64(0) - 10 }, errNoRegion},
		{"capacity not the ring's", func(o *orphanRig) { o.m.Capacity = orphanCap * 2 }, ring.ErrCorrupt},
		{"capacity huge", func(o *orphanRig) { o.m.Capacity = 1 << 31 }, errNoRegion},
		{"no mapping", func(o *orphanRig) { o.mem = nil }, errNoRegion},
	} {
		t.Run(c.name, func(t *testing.T) {
			o := newOrphanRig(t)
			o.stream(t)
			c.mess(o)
			got, err := readOrphan(o.mem, o.m)
			if !errors.Is(err, c.want) {
				t.Fatalf("readOrphan = %+v, %v; want %v", got, err, c.want)
			}
		})
	}
}

// TestOrphanTruncatedRegion: a guest that truncated its region file
// (its pages are gone) faults readOrphan's loads: caught, not a crash.
func TestOrphanTruncatedRegion(t *testing.T) {
	reg, f := shmtest.Region(t, region.Geometry{Size: 1 << 20, Slots: 4})
	pool := region.NewPool(reg, nil)
	_, e, err := pool.Alloc(region.Request{OwnerA: 1, OwnerB: 2, Capacity: orphanCap})
	if err != nil {
		t.Fatal(err)
	}
	m := proto.Msg{Capacity: uint32(e.Capacity), RingAB: uint64(e.RingAB), RingBA: uint64(e.RingBA), Side: proto.SideB}
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	if _, err := readOrphan(reg.Mem(), m); !errors.Is(err, fault.ErrFault) {
		t.Fatalf("readOrphan of a truncated region: %v, want %v", err, fault.ErrFault)
	}
	if err := leaveOrphan(reg.Mem(), m); !errors.Is(err, fault.ErrFault) {
		t.Fatalf("leaveOrphan of a truncated region: %v, want %v", err, fault.ErrFault)
	}
}
