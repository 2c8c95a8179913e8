package region

import (
	"encoding/binary"
	"fmt"
	"os"
)

// A Shadow is hostd's own copy of a region's allocation table, in a file
// that no guest can open (root-only, in a root-only directory): what a
// restarted hostd adopts, instead of the directory that every guest of the
// region can write. Each slot change is written to it (one pwrite of the
// slot's record) before the directory, so it never says less than guests
// saw. It also records which file the region is (device and inode), so
// that hostd adopts only a region file it created itself.
//
// Layout (little-endian):
//
//	0     [8]byte  magic "SHUNTSH\0"
//	8     u32      version (1)
//	12    u32      kind: 1 a trust group's region, 2 a guest pair's
//	16    u32      region id (0 for a group region)
//	20    u32, u32 the pair's guest ids (0 for a group region)
//	28    u32      slots
//	32    u64      region size
//	40    u64, u64 the region file's device and inode
//	56    u64      header generation last written to the region
//	4096  slots x 128 B: one record per slot, in the directory slot's format
//	                     (state and generation included)
//
// A Shadow is not safe for concurrent use; its Pool serialises it.
type Shadow struct {
	f    *os.File
	meta Meta
	geo  Geometry
}

// Kinds of region.
const (
	KindGroup = 1 // a trust group's region (region 0 of its members)
	KindPair  = 2 // the region of one guest pair (process guests)
)

// Meta is what a shadow says about its region besides the slots.
type Meta struct {
	Kind           uint32
	ID             uint32 // the region id guests know it by; 0 for a group region
	GuestA, GuestB uint32 // a pair region's guests
	Dev, Ino       uint64 // the region file's identity
	Generation     uint64 // the header generation hostd last wrote
}

const (
	shadowVersion = 1
	shadowHeader  = 4096
)

var shadowMagic = [8]byte{'S', 'H', 'U', 'N', 'T', 'S', 'H', 0}

func le32(b []byte) uint32 { return binary.LittleEndian.Uint32(b) }
func le64(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }

// newShadow writes a fresh shadow for a region of geometry g into f (empty,
// opened read-write): every slot free.
func newShadow(f *os.File, m Meta, g Geometry) (*Shadow, error) {
	s := &Shadow{f: f, meta: m, geo: g}
	b := make([]byte, shadowHeader)
	s.encodeHeader(b)
	if _, err := f.WriteAt(b, 0); err != nil {
		return nil, fmt.Errorf("write shadow %s: %w", f.Name(), err)
	}
	if err := f.Truncate(int64(shadowHeader + g.Slots*SlotSize)); err != nil { // free records, all zero
		return nil, fmt.Errorf("size shadow %s: %w", f.Name(), err)
	}
	return s, nil
}

func (s *Shadow) encodeHeader(b []byte) {
	le := binary.LittleEndian
	clear(b[:shadowHeader])
	copy(b, shadowMagic[:])
	le.PutUint32(b[8:], shadowVersion)
	le.PutUint32(b[12:], s.meta.Kind)
	le.PutUint32(b[16:], s.meta.ID)
	le.PutUint32(b[20:], s.meta.GuestA)
	le.PutUint32(b[24:], s.meta.GuestB)
	le.PutUint32(b[28:], uint32(s.geo.Slots))
	le.PutUint64(b[32:], uint64(s.geo.Size))
	le.PutUint64(b[40:], s.meta.Dev)
	le.PutUint64(b[48:], s.meta.Ino)
	le.PutUint64(b[56:], s.meta.Generation)
}

// loadShadow reads and checks the shadow in f (its size is size bytes).
func loadShadow(f *os.File, size int64) (*Shadow, error) {
	b := make([]byte, shadowHeader)
	if _, err := f.ReadAt(b, 0); err != nil {
		return nil, fmt.Errorf("read shadow %s: %w", f.Name(), err)
	}
	if [8]byte(b[:8]) != shadowMagic || le32(b[8:]) != shadowVersion {
		return nil, fmt.Errorf("shadow %s: not a Shunt region state file (version %d): %w", f.Name(), le32(b[8:]), ErrCorrupt)
	}
	s := &Shadow{f: f, meta: Meta{Kind: le32(b[12:]), ID: le32(b[16:]), GuestA: le32(b[20:]), GuestB: le32(b[24:]),
		Dev: le64(b[40:]), Ino: le64(b[48:]), Generation: le64(b[56:])}}
	s.geo = Geometry{Size: int64(le64(b[32:])), Slots: int(le32(b[28:]))}
	if le64(b[32:]) > 1<<40 {
		return nil, fmt.Errorf("shadow %s: region size %d: %w", f.Name(), le64(b[32:]), ErrCorrupt)
	}
	if _, err := LayoutFor(s.geo); err != nil {
		return nil, fmt.Errorf("shadow %s: %w: %w", f.Name(), err, ErrCorrupt)
	}
	if s.meta.Kind != KindGroup && s.meta.Kind != KindPair {
		return nil, fmt.Errorf("shadow %s: kind %d: %w", f.Name(), s.meta.Kind, ErrCorrupt)
	}
	if want := int64(shadowHeader + s.geo.Slots*SlotSize); size != want {
		return nil, fmt.Errorf("shadow %s: %d bytes, its header says %d: %w", f.Name(), size, want, ErrCorrupt)
	}
	return s, nil
}

// Name is the shadow file's path.
func (s *Shadow) Name() string { return s.f.Name() }

// Meta returns what the shadow says about its region.
func (s *Shadow) Meta() Meta { return s.meta }

// Geometry returns the region geometry the shadow was made for.
func (s *Shadow) Geometry() Geometry { return s.geo }

// Slots is how many slot records the shadow holds.
func (s *Shadow) Slots() int { return s.geo.Slots }

// SetGeneration records the header generation hostd wrote to the region.
func (s *Shadow) SetGeneration(gen uint64) error {
	s.meta.Generation = gen
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], gen)
	if _, err := s.f.WriteAt(b[:], 56); err != nil {
		return fmt.Errorf("write shadow %s: %w", s.f.Name(), err)
	}
	return nil
}

// put writes slot i's record.
func (s *Shadow) put(i int, e Entry) error {
	var b [SlotSize]byte
	encodeRecord(b[:], e)
	if _, err := s.f.WriteAt(b[:], int64(shadowHeader+i*SlotSize)); err != nil {
		return fmt.Errorf("write shadow %s: %w", s.f.Name(), err)
	}
	return nil
}

// putAll writes every slot's record, in one write.
func (s *Shadow) putAll(es []Entry) error {
	b := make([]byte, len(es)*SlotSize)
	for i, e := range es {
		encodeRecord(b[i*SlotSize:(i+1)*SlotSize], e)
	}
	if _, err := s.f.WriteAt(b, shadowHeader); err != nil {
		return fmt.Errorf("write shadow %s: %w", s.f.Name(), err)
	}
	return nil
}

// encodeRecord writes e, state and generation included, into the
// SlotSize bytes of b.
func encodeRecord(b []byte, e Entry) {
	clear(b[:SlotSize])
	binary.LittleEndian.PutUint32(b[soState:], uint32(e.State))
	binary.LittleEndian.PutUint64(b[soGen:], e.Gen)
	if e.State != Free {
		EncodeEntry(b, e)
	}
}

// records reads all slot records.
func (s *Shadow) records() ([]byte, error) {
	b := make([]byte, s.geo.Slots*SlotSize)
	if _, err := s.f.ReadAt(b, shadowHeader); err != nil {
		return nil, fmt.Errorf("read shadow %s: %w", s.f.Name(), err)
	}
	return b, nil
}

// Close closes the shadow's file; the file stays.
func (s *Shadow) Close() error { return s.f.Close() }
