package region_test

import (
	"errors"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/shuntnet/shunt/shm/region"
	"github.com/shuntnet/shunt/shm/ring"
	"github.com/shuntnet/shunt/shm/shmtest"
	"github.com/shuntnet/shunt/shm/wait"
)

var geo = region.Geometry{Size: 4 << 20, Slots: 16}

func req(c int) region.Request {
	return region.Request{
		OwnerA: 1, OwnerB: 2, Capacity: c,
		Src: netip.MustParseAddrPort("10.77.0.2:40000"), Dst: netip.MustParseAddrPort("10.77.0.3:5201"),
		Created: 12345,
	}
}

func TestSizes(t *testing.T) {
	if region.SlotSize != 128 || region.HeaderSize != 4096 || ring.HeaderSize != 1024 {
		t.Fatalf("format sizes changed: slot %d header %d ring header %d", region.SlotSize, region.HeaderSize, ring.HeaderSize)
	}
	l, err := region.LayoutFor(region.Geometry{Size: 64 << 20, Slots: 256})
	if err != nil {
		t.Fatal(err)
	}
	if l.DirOff != 4096 || l.HeapOff != 4096+256*128 || l.HeapSize != 64<<20-l.HeapOff {
		t.Fatalf("layout %+v", l)
	}
}

func TestCreateOpenFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pool")
	r, err := region.Create(path, geo, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	pool := region.NewPool(r, nil)
	slot, e, err := pool.Alloc(req(64 << 10))
	if err != nil {
		t.Fatal(err)
	}
	// A second mapping of the same file (a guest) sees the flow.
	g, err := region.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	got, err := g.Entry(slot)
	if err != nil {
		t.Fatal(err)
	}
	if got != e {
		t.Fatalf("guest sees %+v, hostd wrote %+v", got, e)
	}
	ab, _, err := g.Rings(slot, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	hab, _, _ := r.Rings(slot, e.Gen)
	w, _ := ring.NewWriter(hab, &wait.Policy{})
	rd, _ := ring.NewReader(ab, &wait.Policy{})
	w.Write([]byte("through the file"))
	buf := make([]byte, 32)
	n, err := rd.Read(buf)
	if err != nil || string(buf[:n]) != "through the file" {
		t.Fatalf("read %q, %v", buf[:n], err)
	}
	if _, _, err := g.Rings(slot, e.Gen+1); !errors.Is(err, region.ErrStale) {
		t.Fatalf("Rings with a wrong generation = %v, want ErrStale", err)
	}
}

func TestOpenRejectsNonRegion(t *testing.T) {
	f := shmtest.Memfd(t, 1<<20)
	if _, err := region.OpenFile(f); !errors.Is(err, region.ErrCorrupt) {
		t.Fatalf("OpenFile on zeros = %v, want ErrCorrupt", err)
	}
	small := shmtest.Memfd(t, 4096)
	if _, err := region.OpenFile(small); !errors.Is(err, region.ErrCorrupt) {
		t.Fatalf("OpenFile on a 4 KiB file = %v, want ErrCorrupt", err)
	}
}

func TestAllocReleaseReuse(t *testing.T) {
	r, _ := shmtest.Region(t, geo)
	pool := region.NewPool(r, nil)
	var slots []int
	var gens []uint64
	for {
		s, e, err := pool.Alloc(req(256 << 10))
		if errors.Is(err, region.ErrFull) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		slots, gens = append(slots, s), append(gens, e.Gen)
	}
	if want := int((geo.Size - 4096 - 4096) / region.PairSize(256<<10)); len(slots) != want {
		t.Fatalf("fitted %d flows of 2x256 KiB in 4 MiB, want %d", len(slots), want)
	}
	freed, err := pool.Release(slots[0], gens[0], region.SideA)
	if err != nil || freed {
		t.Fatalf("release by A = %v, %v; want not freed yet", freed, err)
	}
	if freed, err = pool.Release(slots[0], gens[0], region.SideA); err != nil || freed {
		t.Fatalf("second release by A = %v, %v; want not freed", freed, err)
	}
	if freed, err = pool.Release(slots[0], gens[0], region.SideB); err != nil || !freed {
		t.Fatalf("release by B = %v, %v; want freed", freed, err)
	}
	s, e, err := pool.Alloc(req(256 << 10))
	if err != nil {
		t.Fatalf("alloc after free: %v", err)
	}
	if s != slots[0] || e.Gen <= gens[0] {
		t.Fatalf("reuse got slot %d gen %d; want slot %d with gen > %d", s, e.Gen, slots[0], gens[0])
	}
	if _, err := pool.Release(slots[0], gens[0], region.SideA); !errors.Is(err, region.ErrStale) {
		t.Fatalf("release of the old generation = %v, want ErrStale", err)
	}
	if _, _, err := pool.Alloc(req(1000)); err == nil {
		t.Fatal("alloc with a capacity that is not a power of two succeeded")
	}
}

func TestSlotsExhausted(t *testing.T) {
	r, _ := shmtest.Region(t, region.Geometry{Size: 4 << 20, Slots: 2})
	pool := region.NewPool(r, nil)
	for range 2 {
		if _, _, err := pool.Alloc(req(ring.MinCapacity)); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := pool.Alloc(req(ring.MinCapacity)); !errors.Is(err, region.ErrFull) {
		t.Fatalf("third alloc in two slots = %v, want ErrFull", err)
	}
}

func TestRevokeResetsBothRings(t *testing.T) {
	r, _ := shmtest.Region(t, geo)
	pool := region.NewPool(r, nil)
	s, e, _ := pool.Alloc(req(64 << 10))
	if err := pool.Revoke(s, e.Gen, 42); err != nil {
		t.Fatal(err)
	}
	ab, ba, err := r.Rings(s, e.Gen)
	if err != nil {
		t.Fatal(err)
	}
	for _, rg := range []*ring.Ring{ab, ba} {
		if st := rg.Stats(); !st.Reset || st.Reason != 42 {
			t.Fatalf("ring after revoke: %+v", st)
		}
	}
	got, _ := r.Entry(s)
	if got.State != region.Revoked || got.Reason != 42 {
		t.Fatalf("entry after revoke: %+v", got)
	}
	if err := pool.Free(s, e.Gen); err != nil {
		t.Fatal(err)
	}
	if flows, heap := pool.Usage(); flows != 0 || heap != 0 {
		t.Fatalf("usage after free: %d flows, %d bytes", flows, heap)
	}
}

// FuzzHeader: arbitrary header bytes decode to a layout that lies inside the
// mapping, or to ErrCorrupt; a decoded layout re-encodes to the same fields.
func FuzzHeader(f *testing.F) {
	good := make([]byte, region.HeaderSize)
	l, _ := region.LayoutFor(geo)
	region.EncodeHeader(good, l, 3)
	f.Add(good)
	f.Add(make([]byte, 64))
	f.Fuzz(func(t *testing.T, b []byte) {
		hdr := make([]byte, region.HeaderSize)
		copy(hdr, b)
		l, err := region.DecodeHeader(hdr, geo.Size)
		if err != nil {
			if !errors.Is(err, region.ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if l.Size > geo.Size || l.HeapOff+l.HeapSize != l.Size || l.HeapOff < l.DirOff+int64(l.Slots)*region.SlotSize {
			t.Fatalf("layout %+v escapes a %d-byte mapping", l, geo.Size)
		}
		again := make([]byte, region.HeaderSize)
		region.EncodeHeader(again, l, 0)
		l2, err := region.DecodeHeader(again, geo.Size)
		if err != nil || l2 != l {
			t.Fatalf("round trip: %+v, %v; want %+v", l2, err, l)
		}
	})
}

// FuzzEntry: arbitrary slot bytes either fail with ErrCorrupt or describe a
// ring pair inside the heap; valid entries round-trip.
func FuzzEntry(f *testing.F) {
	l, _ := region.LayoutFor(geo)
	slot := make([]byte, region.SlotSize)
	e := region.Entry{State: region.Ready, OwnerA: 1, OwnerB: 2, RingAB: l.HeapOff, RingBA: l.HeapOff + int64(ring.Size(ring.MinCapacity)), Capacity: ring.MinCapacity,
		Src: netip.MustParseAddrPort("10.0.0.1:1"), Dst: netip.MustParseAddrPort("[fd00::1]:2")}
	region.EncodeEntry(slot, e)
	f.Add(slot, uint32(region.Ready))
	f.Add(make([]byte, region.SlotSize), uint32(region.Revoked))
	f.Fuzz(func(t *testing.T, b []byte, state uint32) {
		s := make([]byte, region.SlotSize)
		copy(s, b)
		e, err := region.DecodeEntry(s, region.State(state), 7, l)
		if err != nil {
			if !errors.Is(err, region.ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if e.State != region.Ready && e.State != region.Revoked {
			return
		}
		start, end := e.Span()
		if start < l.HeapOff || end > l.HeapOff+l.HeapSize || e.RingBA+int64(ring.Size(e.Capacity)) > end {
			t.Fatalf("entry %+v escapes the heap [%d, %d)", e, l.HeapOff, l.HeapOff+l.HeapSize)
		}
		again := make([]byte, region.SlotSize)
		region.EncodeEntry(again, e)
		e2, err := region.DecodeEntry(again, e.State, e.Gen, l)
		if err != nil || e2 != e {
			t.Fatalf("round trip: %+v, %v; want %+v", e2, err, e)
		}
	})
}
