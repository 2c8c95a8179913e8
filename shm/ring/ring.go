package ring

import (
	"errors"
	"fmt"
	"math/bits"
	"sync/atomic"

	"github.com/shuntnet/shunt/shm/wait"
)

// Layout of the ring header. Each group of fields written by one party has a
// 128-byte line of its own: x86 prefetches cache lines in pairs, so 64-byte
// separation would still let the producer's and consumer's stores collide.
const (
	lineSize   = 64
	HeaderSize = 1024 // bytes before the data area

	OffMagic    = 0   // u32, hostd at Format; read once at Attach
	OffCapacity = 8   // u64, hostd at Format; read once at Attach
	OffTail     = 128 // u64, writer: bytes written, monotonic
	OffWMsgs    = 136 // u64, writer: publications, monotonic
	OffWFlags   = 144 // u32, writer: FlagFIN, FlagStarted, FlagLeft
	OffStart    = 152 // u64, writer: the stream offset of the ring's first byte (format 2; valid once FlagStarted)
	OffHead     = 256 // u64, reader: bytes read, monotonic
	OffRMsgs    = 264 // u64, reader: reads that consumed bytes, monotonic
	OffRWait    = 384 // u32, reader sets 1 before sleeping; writer swaps to 0 and wakes
	OffWWait    = 448 // u32, writer sets 1 before sleeping; reader swaps to 0 and wakes
	OffReset    = 512 // u32, anyone: non-zero = flow reset (revoked or aborted)
	OffReason   = 516 // u32, who reset and why (informational)
	OffRFlags   = 520 // u32, reader: FlagReaderClosed, FlagReaderAttached, FlagReaderLeft (here, not on the consumer line, because the writer checks it on every write)

	// Magic marks a formatted ring header ("SHRG").
	Magic = 0x47524853

	// MinCapacity and MaxCapacity bound the data area; capacities are
	// powers of two so that a byte index maps to an offset with a mask.
	MinCapacity = 4 << 10
	MaxCapacity = 1 << 30

	// Batch is the most a copy call publishes at once (see TryWrite).
	Batch = 32 << 10

	FlagFIN          = 1
	FlagReaderClosed = 1

	// Path switching (ring format 2, switch.go): the writer's and the
	// reader's marks for moving a stream between TCP and the ring.
	FlagStarted        = 2 // wflags: OffStart holds the offset; ring bytes follow
	FlagLeft           = 4 // wflags: no byte follows the tail; the stream goes on over TCP
	FlagReaderAttached = 2 // rflags: the reader reads this ring; the writer may start
	FlagReaderLeft     = 4 // rflags: the reader has left (drained, or told its writer is gone)

	// FormatVersion is the ring format: 2 adds the switching marks above.
	// HELLO and WELCOME carry it (proto.Msg.Formats, a bit per format).
	FormatVersion = 2
)

var (
	// ErrCorrupt means the peer (or something else with the mapping) wrote
	// an impossible index or header. The flow is unusable; nothing outside
	// the ring was touched.
	ErrCorrupt = errors.New("shunt ring: corrupt shared state")
	// ErrReset means the flow was reset: revoked by hostd or aborted by the
	// peer. It maps to ECONNRESET.
	ErrReset = errors.New("shunt ring: flow reset")
	// ErrPeerClosed means the reader has gone: writes fail like EPIPE.
	ErrPeerClosed = errors.New("shunt ring: reader closed")
	// ErrClosed means this end was closed (or shut for writing) locally.
	ErrClosed = errors.New("shunt ring: closed")
	// ErrBadCommit means Commit or Release was given more than was
	// reserved or peeked: a bug in the caller.
	ErrBadCommit = errors.New("shunt ring: commit or release beyond reservation")
)

// Size returns the bytes a ring of the given capacity occupies.
func Size(capacity int) int { return HeaderSize + capacity }

// validCapacity reports whether c is a power of two within bounds.
func validCapacity(c uint64) bool {
	return c >= MinCapacity && c <= MaxCapacity && bits.OnesCount64(c) == 1
}

// Format writes a fresh, empty ring header into mem[:Size(capacity)] and
// zeroes the counters. Only the allocator (hostd) formats rings, and only
// while no end is attached.
func Format(mem []byte, capacity int) error {
	if !validCapacity(uint64(capacity)) {
		return fmt.Errorf("ring capacity %d: want a power of two in [%d, %d]", capacity, MinCapacity, MaxCapacity)
	}
	if len(mem) < Size(capacity) || !aligned(mem) {
		return fmt.Errorf("ring window of %d bytes: want %d, %d-byte aligned", len(mem), Size(capacity), lineSize)
	}
	clear(mem[:HeaderSize])
	word64(mem, OffCapacity).Store(uint64(capacity))
	word32(mem, OffMagic).Store(Magic)
	return nil
}

// Ring is an attached view of one ring. It carries no per-end state, so
// Stats and Reset are safe for concurrent use by anyone; the ends use a
// Writer and a Reader.
type Ring struct {
	data []byte
	mask uint64

	tail, wmsgs   *atomic.Uint64
	wflags        *atomic.Uint32
	start         *atomic.Uint64
	head, rmsgs   *atomic.Uint64
	rflags        *atomic.Uint32
	rwait, wwait  *atomic.Uint32
	reset, reason *atomic.Uint32
}

// Attach validates the header in mem and returns a view of the ring. The
// capacity is read once here and never again, so a peer that rewrites the
// header later cannot move the data window. If want is non-zero the capacity
// must equal it (the directory says what the ring should be).
func Attach(mem []byte, want int) (*Ring, error) {
	if len(mem) < HeaderSize || !aligned(mem) {
		return nil, fmt.Errorf("attach ring: window of %d bytes, want at least %d and %d-byte aligned: %w", len(mem), HeaderSize, lineSize, ErrCorrupt)
	}
	if m := word32(mem, OffMagic).Load(); m != Magic {
		return nil, fmt.Errorf("attach ring: magic %#x, want %#x: %w", m, Magic, ErrCorrupt)
	}
	c := word64(mem, OffCapacity).Load()
	if !validCapacity(c) || uint64(len(mem)-HeaderSize) < c || (want != 0 && c != uint64(want)) {
		return nil, fmt.Errorf("attach ring: capacity %d in a %d-byte window (want %d): %w", c, len(mem), want, ErrCorrupt)
	}
	r := &Ring{
		data:   mem[HeaderSize : HeaderSize+int(c) : HeaderSize+int(c)],
		mask:   c - 1,
		tail:   word64(mem, OffTail),
		wmsgs:  word64(mem, OffWMsgs),
		wflags: word32(mem, OffWFlags),
		start:  word64(mem, OffStart),
		head:   word64(mem, OffHead),
		rmsgs:  word64(mem, OffRMsgs),
		rflags: word32(mem, OffRFlags),
		rwait:  word32(mem, OffRWait),
		wwait:  word32(mem, OffWWait),
		reset:  word32(mem, OffReset),
		reason: word32(mem, OffReason),
	}
	return r, nil
}

// Capacity returns the size of the data area in bytes.
func (r *Ring) Capacity() int { return len(r.data) }

// Stats is a snapshot of a ring's counters, as a third party sees them.
type Stats struct {
	Written, Read         uint64 // bytes, monotonic
	MsgsWritten, MsgsRead uint64 // publications, monotonic
	FIN, ReaderClosed     bool
	Reset                 bool
	Reason                uint32
	// Path switching: the writer started at Start (stream offset) and has
	// left, the reader is attached and has left.
	Started, Left              bool
	Start                      uint64
	ReaderAttached, ReaderLeft bool
}

// Stats reads the counters without disturbing either end (loads only).
// The fields come from different lines, so the snapshot is not atomic as a
// whole; each field is.
func (r *Ring) Stats() Stats {
	return Stats{
		Written:      r.tail.Load(),
		Read:         r.head.Load(),
		MsgsWritten:  r.wmsgs.Load(),
		MsgsRead:     r.rmsgs.Load(),
		FIN:          r.wflags.Load()&FlagFIN != 0,
		ReaderClosed: r.rflags.Load()&FlagReaderClosed != 0,
		Reset:        r.reset.Load() != 0,
		Reason:       r.reason.Load(),
		Started:      r.wflags.Load()&FlagStarted != 0,
		Left:         r.wflags.Load()&FlagLeft != 0,
		Start:        r.start.Load(),

		ReaderAttached: r.rflags.Load()&FlagReaderAttached != 0,
		ReaderLeft:     r.rflags.Load()&FlagReaderLeft != 0,
	}
}

// Reset marks the ring reset with a reason code. Both ends fail their next
// (and any pending) operation with ErrReset once woken; wake them with
// WakeAll. The first reason sticks.
func (r *Ring) Reset(reason uint32) {
	if r.reset.CompareAndSwap(0, 1) {
		r.reason.Store(reason)
	}
}

// Abort resets the ring with reason and wakes both ends if they sleep, so
// their pending calls fail with ErrReset: what hostd does on revocation and
// what an end does to abort a flow (a TCP RST). Safe for concurrent use.
func (r *Ring) Abort(reason uint32, p *wait.Policy) {
	r.Reset(reason)
	for _, f := range []*atomic.Uint32{r.rwait, r.wwait} {
		f.Store(1) // Wake skips flags that say nobody sleeps
		_ = p.Wake(f)
	}
}

// IsReset reports whether the ring was reset.
func (r *Ring) IsReset() bool { return r.reset.Load() != 0 }

// Waiters returns the reader's and writer's "waiting" flags, for a third
// party (hostd revoking a flow) that must wake both ends.
func (r *Ring) Waiters() (reader, writer *atomic.Uint32) { return r.rwait, r.wwait }
