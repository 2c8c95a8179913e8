package region

import (
	"testing"

	"github.com/shuntnet/shunt/internal/sys"
	"github.com/shuntnet/shunt/shm/ring"
)

// FuzzLoadShadow: whatever a shadow's slot records hold, the pool built
// from them holds only flows whose rings lie inside the heap and overlap
// no other, and its heap map marks exactly their chunks; it then still
// allocates without overlapping them.
func FuzzLoadShadow(f *testing.F) {
	g := Geometry{Size: 1 << 20, Slots: 4}
	l, _ := LayoutFor(g)
	good := make([]byte, g.Slots*SlotSize)
	e := Entry{State: Ready, Gen: 3, OwnerA: 1, OwnerB: 2, RingAB: l.HeapOff, RingBA: l.HeapOff + int64(ring.Size(ring.MinCapacity)), Capacity: ring.MinCapacity}
	EncodeEntry(good, e)
	le32put(good[soState:], uint32(Ready))
	le64put(good[soGen:], 3)
	copy(good[SlotSize:], good[:SlotSize]) // an overlapping copy
	f.Add(good)
	f.Add(make([]byte, g.Slots*SlotSize))
	mem, err := sys.Memfd("fuzz", g.Size)
	if err != nil {
		f.Skip("no memfd:", err)
	}
	defer mem.Close()
	f.Fuzz(func(t *testing.T, b []byte) {
		recs := make([]byte, g.Slots*SlotSize)
		copy(recs, b)
		r, err := CreateFile(mem, g)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		p := &Pool{r: r, slots: make([]Entry, g.Slots)}
		p.chunks = make([]uint64, (p.heapChunks()+63)/64)
		p.load(recs)
		var used []Entry
		for _, s := range p.slots {
			if s.State != Ready && s.State != Revoked {
				continue
			}
			st, en := s.Span()
			if st < l.HeapOff || en > l.HeapOff+l.HeapSize {
				t.Fatalf("adopted %+v outside the heap", s)
			}
			for _, o := range used {
				if os, oe := o.Span(); st < oe && os < en {
					t.Fatalf("adopted %+v overlaps %+v", s, o)
				}
			}
			used = append(used, s)
		}
		if _, heap := p.Usage(); heap != func() (n int64) {
			for _, u := range used {
				n += PairSize(u.Capacity)
			}
			return n
		}() {
			t.Fatalf("heap map %d bytes, adopted flows take other", heap)
		}
		if _, ne, err := p.Alloc(Request{Capacity: ring.MinCapacity}); err == nil {
			for _, o := range used {
				if os, oe := o.Span(); ne.RingAB < oe && os < ne.RingAB+PairSize(ring.MinCapacity) {
					t.Fatalf("new flow %+v overlaps adopted %+v", ne, o)
				}
			}
			for _, o := range used {
				if ne.Gen <= o.Gen {
					t.Fatalf("new generation %d not above adopted %d", ne.Gen, o.Gen)
				}
			}
		}
	})
}

func le32put(b []byte, v uint32) {
	b[0], b[1], b[2], b[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
}
func le64put(b []byte, v uint64) { le32put(b, uint32(v)); le32put(b[4:], uint32(v>>32)) }
