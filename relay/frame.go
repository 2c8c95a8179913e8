package relay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
)

// A frame is a 20-byte header, then Len bytes of payload (DATA only):
//
//	type u8 | 3 bytes zero | flow u32 | arg u64 | len u32   (little endian)
//
// DATA's arg is the stream offset of its first byte; CREDIT's is the
// offset the receiver's consumer has taken (the sender may send up to it
// plus the window); DOWN's is a proto.Reason; LEFT's is the final offset;
// ATTACHED's is 0 (vsock stretches only: the sender's guest reader
// attached the ring this flow's bytes go into, docs/vsock.md).
const (
	headerSize = 20
	// MaxPayload bounds a DATA frame: large enough for streaming writes,
	// small enough that flows on one connection take turns.
	MaxPayload = 256 << 10
)

// Frame types. The RDMA link uses the same frames (rdma.go).
const (
	fData   = 1
	fCredit = 2
	fDown   = 3
	fLeft   = 4
	// fAttached tells a vsock stretch's VM end that the ring its bytes
	// go into is attached end to end: its bridge may attach its guest's
	// write ring (BridgeOptions.HoldIn). Sent only to a VM whose Hello
	// asked for it (HelloHold): an older library's link ends on it.
	fAttached = 5
)

type frame struct {
	typ  uint8
	flow uint32
	arg  uint64
	data []byte
	pool *[]byte // data's buffer, from payloads, if it came from there
	// zc, if set, says data aliases a guest's ring in zc's registered
	// region, at zoff (checked when queued: offsetIn): the RDMA link's
	// writer gathers it by scatter entry, and calls zc.written once the
	// write completed (zerocopy.go).
	zc   *zcFlow
	zoff uint64
}

// payloadClasses are the sizes of the pooled buffers that carry a DATA
// frame's bytes from Flow.Write to the transport (the sender copies them
// out of guest memory, which a hostile guest may unmap). Smaller payloads
// are allocated; a pooled buffer is at most 4 times its payload, so what
// queued frames hold stays within a few windows.
var payloadClasses = [...]int{16 << 10, 64 << 10, MaxPayload}

var payloads [len(payloadClasses)]sync.Pool

// payload returns a copy of p, in a pooled buffer if p is large enough.
func payload(p []byte) ([]byte, *[]byte) {
	for i, c := range payloadClasses {
		if len(p) <= c && 4*len(p) >= c {
			b, _ := payloads[i].Get().(*[]byte)
			if b == nil {
				nb := make([]byte, c)
				b = &nb
			}
			return (*b)[:copy(*b, p)], b
		}
	}
	return append([]byte(nil), p...), nil
}

// release gives a sent frame's payload buffer back (a transport calls it
// once the bytes are written).
func (f *frame) release() {
	if f.pool == nil {
		return
	}
	for i, c := range payloadClasses {
		if len(*f.pool) == c {
			payloads[i].Put(f.pool)
		}
	}
	f.pool = nil
}

// ErrProtocol marks a peer relay that broke the link protocol: the link
// ends (a peer is another host's relay, and untrusted).
var ErrProtocol = errors.New("relay link: protocol error")

// header appends f's header to b.
func (f *frame) header(b []byte) []byte {
	var h [headerSize]byte
	h[0] = f.typ
	binary.LittleEndian.PutUint32(h[4:], f.flow)
	binary.LittleEndian.PutUint64(h[8:], f.arg)
	binary.LittleEndian.PutUint32(h[16:], uint32(len(f.data)))
	return append(b, h[:]...)
}

// readFrame reads one frame, validating its header; the payload is read
// into scratch (of MaxPayload bytes), which it aliases until the next
// call.
func readFrame(r io.Reader, scratch []byte) (frame, error) {
	var h [headerSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return frame{}, err
	}
	f, n, err := parseHeader(&h)
	if err != nil {
		return f, err
	}
	if n > 0 {
		f.data = scratch[:n]
		if _, err := io.ReadFull(r, f.data); err != nil {
			return f, err
		}
	}
	return f, nil
}

// parseHeader checks a header, read once into h (a peer's bytes are read
// once, then checked: in a ring the peer can rewrite them meanwhile), and
// returns its frame (without payload) and payload length.
func parseHeader(h *[headerSize]byte) (frame, uint32, error) {
	f := frame{typ: h[0], flow: binary.LittleEndian.Uint32(h[4:]), arg: binary.LittleEndian.Uint64(h[8:])}
	n := binary.LittleEndian.Uint32(h[16:])
	switch {
	case h[1] != 0 || h[2] != 0 || h[3] != 0:
		return f, 0, fmt.Errorf("%w: reserved header bytes set", ErrProtocol)
	case f.typ < fData || f.typ > fAttached:
		return f, 0, fmt.Errorf("%w: frame type %d", ErrProtocol, f.typ)
	case f.typ != fData && n != 0:
		return f, 0, fmt.Errorf("%w: a payload of %d bytes on frame type %d", ErrProtocol, n, f.typ)
	case n > MaxPayload:
		return f, 0, fmt.Errorf("%w: a payload of %d bytes, at most %d", ErrProtocol, n, MaxPayload)
	}
	return f, n, nil
}

// size is f's bytes on the wire.
func (f *frame) size() int { return headerSize + len(f.data) }
