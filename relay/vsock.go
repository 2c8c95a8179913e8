package relay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// A vsock stretch (docs/vsock.md, "The data path over vsock"): a VM
// without a Shunt ivshmem device carries one flow's switched stretch over
// an AF_VSOCK stream of its own to the host (CID 2, VsockPort). The
// stream opens with a Hello naming the flow as hostd's READY named it (24 bytes), and
// then is a Link of one flow (id 0), with a Bridge at each end: in the VM
// on the guest library's rings in its own memory, on the host on the
// flow's real ring pair. So the stretch keeps the rings' contract (start
// offsets, LEFT marks, nothing freed before the other end holds it).

// VsockPort is the host port of vsock stretches.
// Below 1024, as VsockControlPort (internal/proto): on a host whose
// kernel serves vsock (vhost-vsock), only a privileged process may bind
// it, so no host user can pose as hostd to a VM's library.
const VsockPort = 1022

// VsockFlowID is the stretch's one flow on its link.
const VsockFlowID = 0

// HelloSize is the size of a Hello on the wire.
const HelloSize = 24

// helloMagic opens a Hello: "SHV1".
const helloMagic = 0x31564853

// Hello names the flow a vsock stretch carries: READY's region, slot and
// generation. hostd checks it against its own records of the VM's flows;
// nothing in it is trusted.
type Hello struct {
	Region uint32
	Slot   uint32
	Gen    uint64
}

// ErrHello is a stream that did not open with a valid Hello.
var ErrHello = errors.New("vsock stretch: bad hello")

// Encode is h on the wire: magic, region, slot, 4 zero bytes, gen
// (little endian).
func (h Hello) Encode() []byte {
	b := make([]byte, HelloSize)
	binary.LittleEndian.PutUint32(b[0:], helloMagic)
	binary.LittleEndian.PutUint32(b[4:], h.Region)
	binary.LittleEndian.PutUint32(b[8:], h.Slot)
	binary.LittleEndian.PutUint64(b[16:], h.Gen)
	return b
}

// ReadHello reads exactly one Hello from r (the caller bounds the wait
// with a deadline).
func ReadHello(r io.Reader) (Hello, error) {
	var b [HelloSize]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return Hello{}, fmt.Errorf("%w: %w", ErrHello, err)
	}
	if binary.LittleEndian.Uint32(b[0:]) != helloMagic {
		return Hello{}, fmt.Errorf("%w: magic %#x", ErrHello, binary.LittleEndian.Uint32(b[0:]))
	}
	if binary.LittleEndian.Uint32(b[12:]) != 0 {
		return Hello{}, fmt.Errorf("%w: reserved bytes set", ErrHello)
	}
	return Hello{Region: binary.LittleEndian.Uint32(b[4:]), Slot: binary.LittleEndian.Uint32(b[8:]), Gen: binary.LittleEndian.Uint64(b[16:])}, nil
}
