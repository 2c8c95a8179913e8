package mark

import (
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"strings"
)

// DefaultMask is the part of the conntrack mark hostd owns unless
// configured otherwise: the high 16 bits, two proof bits and room for
// 16383 guests.
const DefaultMask uint32 = 0xffff0000

// ProofPriority is where hostd's proof chains run: after every chain an
// operator can reasonably give (filter 0, security 50, srcnat 100, and
// anything up to here), just before conntrack confirms the entry
// (INT_MAX). A packet that reaches them went past the operator's filter.
const ProofPriority = 1<<31 - 2

// Field is the part of the conntrack mark that hostd owns: a contiguous run
// of bits. Its two highest bits are the proof of passage (a packet of the
// connection's original direction, and one of its reply direction, went
// past the operator's filter since hostd last cleared them: Proof); the
// rest holds guests' mark ids (IDMask). A plain value, safe to copy.
type Field struct {
	Mask uint32
}

// ParseMask reads a mask such as "0xffff0000": a non-empty, contiguous run
// of set bits.
func ParseMask(s string) (uint32, error) {
	v, err := strconv.ParseUint(strings.TrimSpace(s), 0, 32)
	if err != nil {
		return 0, fmt.Errorf("%q: want a 32-bit number such as \"0xffff0000\"", s)
	}
	m := uint32(v)
	if err := CheckMask(m); err != nil {
		return 0, err
	}
	return m, nil
}

// CheckMask reports whether m is a usable field: at least 4 bits (two
// proof bits, two or more for ids), all adjacent.
func CheckMask(m uint32) error {
	if bits.OnesCount32(m) < 4 {
		return fmt.Errorf("ct mark mask %#08x: want at least 4 bits (2 proof bits and the guests' ids), e.g. 0xffff0000", m)
	}
	if shifted := m >> bits.TrailingZeros32(m); shifted&(shifted+1) != 0 {
		return fmt.Errorf("ct mark mask %#08x: want one run of adjacent bits, e.g. 0xffff0000", m)
	}
	return nil
}

func (f Field) shift() int { return bits.TrailingZeros32(f.Mask) }

// PassOrig is the proof bit of the original direction: the field's
// highest bit. hostd's proof chains set it on a packet of that direction
// that went past the operator's filter.
func (f Field) PassOrig() uint32 {
	if f.Mask == 0 {
		return 0
	}
	return 1 << (31 - bits.LeadingZeros32(f.Mask))
}

// PassReply is the proof bit of the reply direction, below PassOrig.
func (f Field) PassReply() uint32 { return f.PassOrig() >> 1 }

// Proof is both proof bits.
func (f Field) Proof() uint32 { return f.PassOrig() | f.PassReply() }

// IDMask is the part of the field that holds mark ids.
func (f Field) IDMask() uint32 { return f.Mask &^ f.Proof() }

// MaxID is the largest mark id that fits in the field.
func (f Field) MaxID() uint32 { return f.IDMask() >> f.shift() }

// Value is the mark bits of id: id shifted into the field.
func (f Field) Value(id uint32) uint32 { return id << f.shift() & f.IDMask() }

// ID is the mark id a conntrack mark carries; 0 means none.
func (f Field) ID(mark uint32) uint32 { return mark & f.IDMask() >> f.shift() }

// Passed reports whether a conntrack mark shows packets of both
// directions past the filter since the bits were last cleared.
func (f Field) Passed(mark uint32) bool { p := f.Proof(); return p != 0 && mark&p == p }

// ErrNoIDs means every mark id of the field is in use.
var ErrNoIDs = errors.New("no free mark id: widen ct_mark_mask")

// ids hands out mark ids: the guest's own id if it fits and is free, else
// the id the guest had before, else the next free one counting down from
// the top, so an id that was just freed is reused as late as possible. Not
// safe for concurrent use.
type ids struct {
	max    uint32
	used   map[uint32]string // id -> guest name
	before map[string]uint32 // guest name -> its last id, kept after it goes
	next   uint32            // where the countdown goes on
}

func newIDs(max uint32) *ids {
	return &ids{max: max, used: map[uint32]string{}, before: map[string]uint32{}, next: max}
}

// take gives guest name (guest id want) a mark id.
func (a *ids) take(name string, want uint32) (uint32, error) {
	free := func(id uint32) bool { _, ok := a.used[id]; return id >= 1 && id <= a.max && !ok }
	id := uint32(0)
	switch {
	case free(want):
		id = want
	case free(a.before[name]):
		id = a.before[name]
	default:
		for range a.max {
			c := a.next
			if a.next--; a.next == 0 {
				a.next = a.max
			}
			if free(c) {
				id = c
				break
			}
		}
	}
	if id == 0 {
		return 0, ErrNoIDs
	}
	a.used[id] = name
	a.before[name] = id
	if len(a.before) > 4*int(min(a.max, 1<<16)) {
		// Forget names that are gone, so the map stays bounded.
		for n, old := range a.before {
			if a.used[old] != n {
				delete(a.before, n)
			}
		}
	}
	return id, nil
}

// give returns id.
func (a *ids) give(id uint32) { delete(a.used, id) }
