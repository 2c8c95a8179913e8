package virtq

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"
)

// Wire layout of a split virtqueue (virtio 1.2 §2.7), all little-endian:
//
//	struct virtq_desc  { le64 addr; le32 len; le16 flags; le16 next; }    // 16 bytes, table 16-aligned
//	struct virtq_avail { le16 flags; le16 idx; le16 ring[N]; le16 used_event; }   // 2-aligned
//	struct virtq_used  { le16 flags; le16 idx; struct { le32 id; le32 len; } ring[N]; le16 avail_event; } // 4-aligned
const (
	DescSize = 16

	DescFNext     = 1 // VIRTQ_DESC_F_NEXT
	DescFWrite    = 2 // VIRTQ_DESC_F_WRITE: device-writable
	DescFIndirect = 4 // VIRTQ_DESC_F_INDIRECT

	AvailFNoInterrupt = 1 // VIRTQ_AVAIL_F_NO_INTERRUPT

	// MaxSize is the largest queue size (virtio 1.2 §2.7: 32768).
	MaxSize = 32768
)

// Sizes returns the byte sizes of the descriptor table, the available
// ring and the used ring of a queue of n entries (without the event
// index fields: this device does not offer VIRTIO_RING_F_EVENT_IDX).
func Sizes(n int) (desc, avail, used int) {
	return DescSize * n, 4 + 2*n, 4 + 8*n
}

// ErrBroken wraps every rule a driver broke; the queue stays broken.
var ErrBroken = errors.New("virtqueue broken by the driver")

// Queue is the device's view of one split virtqueue. It is not safe for
// concurrent use: the vhost-user session's lock guards it.
type Queue struct {
	mem      *Memory
	size     uint16
	desc     []byte
	avail    []byte
	used     []byte
	indirect bool // VIRTIO_RING_F_INDIRECT_DESC negotiated

	lastAvail uint16 // next available entry to take
	usedIdx   uint16 // next used entry to fill
	err       error
}

// New returns a queue of size entries whose rings are desc, avail and used
// (already translated into guest memory, Sizes long), taking available
// entries from lastAvail on (SET_VRING_BASE) and filling used entries from
// the used ring's own idx on (as a device resuming a ring does).
func New(mem *Memory, size int, desc, avail, used []byte, lastAvail uint16, indirect bool) (*Queue, error) {
	if size < 1 || size > MaxSize || size&(size-1) != 0 {
		return nil, fmt.Errorf("queue size %d: want a power of 2 up to %d", size, MaxSize)
	}
	d, a, u := Sizes(size)
	if len(desc) < d || len(avail) < a || len(used) < u {
		return nil, fmt.Errorf("queue of %d: rings of %d/%d/%d bytes, want %d/%d/%d", size, len(desc), len(avail), len(used), d, a, u)
	}
	if addr(desc)%16 != 0 || addr(avail)%2 != 0 || addr(used)%4 != 0 {
		return nil, fmt.Errorf("queue rings misaligned (descriptors %#x, available %#x, used %#x; want 16, 2, 4)", addr(desc)%16, addr(avail)%2, addr(used)%4)
	}
	q := &Queue{mem: mem, size: uint16(size), desc: desc[:d], avail: avail[:a], used: used[:u], indirect: indirect, lastAvail: lastAvail}
	q.usedIdx = uint16(atomic.LoadUint32(word(q.used, 0)) >> 16)
	return q, nil
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

// word is the aligned 32-bit word at off, for atomic access.
func word(b []byte, off int) *uint32 { return (*uint32)(unsafe.Pointer(&b[off])) }

// availIdx reads avail.idx atomically: the 16 bits sit in the aligned word
// at 0 (ring 4-aligned) or at 2 (ring 2-aligned). The atomic load orders
// every later read of the ring and the descriptors after it.
func (q *Queue) availIdx() uint16 {
	if addr(q.avail)%4 == 0 {
		return uint16(atomic.LoadUint32(word(q.avail, 0)) >> 16)
	}
	return uint16(atomic.LoadUint32(word(q.avail, 2)))
}

func (q *Queue) availFlags() uint16 { return binary.LittleEndian.Uint16(q.avail[0:]) }

// LastAvail is the next available entry the device will take
// (GET_VRING_BASE answers it).
func (q *Queue) LastAvail() uint16 { return q.lastAvail }

// Err is why the queue is broken, or nil.
func (q *Queue) Err() error { return q.err }

func (q *Queue) fail(format string, args ...any) error {
	q.err = fmt.Errorf("%w: %s", ErrBroken, fmt.Sprintf(format, args...))
	return q.err
}

// Pending is how many chains the driver made available that the device
// has not taken yet.
func (q *Queue) Pending() (int, error) {
	if q.err != nil {
		return 0, q.err
	}
	n := q.availIdx() - q.lastAvail
	if n > q.size {
		return 0, q.fail("available idx %d is %d entries ahead of the device (queue size %d)", q.availIdx(), n, q.size)
	}
	return int(n), nil
}

// Pop takes the next available chain; ok is false when there is none. An
// error breaks the queue.
func (q *Queue) Pop() (c Chain, ok bool, err error) {
	n, err := q.Pending()
	if err != nil || n == 0 {
		return Chain{}, false, err
	}
	slot := int(q.lastAvail % q.size)
	head := binary.LittleEndian.Uint16(q.avail[4+2*slot:])
	if head >= q.size {
		return Chain{}, false, q.fail("available ring names descriptor %d of %d", head, q.size)
	}
	c, err = q.walk(head)
	if err != nil {
		q.err = fmt.Errorf("%w: chain at descriptor %d: %v", ErrBroken, head, err)
		return Chain{}, false, q.err
	}
	q.lastAvail++
	return c, true, nil
}

// Push returns a chain to the driver with written bytes written into its
// device-writable part. The used element is stored before used.idx moves
// (the atomic store is the release the driver's read of idx pairs with).
func (q *Queue) Push(head uint16, written uint32) {
	slot := int(q.usedIdx % q.size)
	binary.LittleEndian.PutUint32(q.used[4+8*slot:], uint32(head))
	binary.LittleEndian.PutUint32(q.used[8+8*slot:], written)
	q.usedIdx++
	// used.flags is the device's and stays 0 (it never asks the driver
	// not to notify).
	atomic.StoreUint32(word(q.used, 0), uint32(q.usedIdx)<<16)
}

// Interrupts reports whether the driver wants a notification for used
// buffers (it did not set VIRTQ_AVAIL_F_NO_INTERRUPT).
func (q *Queue) Interrupts() bool { return q.availFlags()&AvailFNoInterrupt == 0 }

// Unpop gives back the chain Pop took last, before anything was pushed for
// it: the device found it had nothing to put in it after all.
func (q *Queue) Unpop() { q.lastAvail-- }

// Break breaks the queue for a rule of the device's own (a receive buffer
// too small for a packet header, say).
func (q *Queue) Break(format string, args ...any) error { return q.fail(format, args...) }
