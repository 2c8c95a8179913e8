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
	// Flags: HelloHold, or 0 (a library before it).
	Flags uint32
}

// HelloHold says the VM's bridge holds its write ring unattached until
// the host's ATTACHED (Flow.Attached): the host's bridge sends it once
// the reader of the ring the VM's bytes go into (the other end's
// library, or the other VM's room) attached it, as the cross-host relays
// tell each other (docs/crosshost.md, "Attached end to end"). Without
// it, the VM's writer moved to its ring while the other end's reader, a
// C program asleep in recv since its READY, had not attached its own,
// and both waited (docs/vsock.md). A host sends ATTACHED only when
// asked: an older VM library's link ends on an unknown frame.
const HelloHold = 1

// Holds reports whether the VM asked for ATTACHED (HelloHold): the
// host's bridge of its stretch then calls Flow.Attached from
// BridgeOptions.Attached.
func (h Hello) Holds() bool { return h.Flags&HelloHold != 0 }

// ErrHello is a stream that did not open with a valid Hello.
var ErrHello = errors.New("vsock stretch: bad hello")

// Encode is h on the wire: magic, region, slot, flags, gen (little
// endian). The flags were 4 zero bytes before HelloHold, which a hostd
// of then refuses: hostd goes first in an upgrade.
func (h Hello) Encode() []byte {
	b := make([]byte, HelloSize)
	binary.LittleEndian.PutUint32(b[0:], helloMagic)
	binary.LittleEndian.PutUint32(b[4:], h.Region)
	binary.LittleEndian.PutUint32(b[8:], h.Slot)
	binary.LittleEndian.PutUint32(b[12:], h.Flags)
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
	fl := binary.LittleEndian.Uint32(b[12:])
	if fl&^HelloHold != 0 {
		return Hello{}, fmt.Errorf("%w: unknown flags %#x", ErrHello, fl)
	}
	return Hello{Region: binary.LittleEndian.Uint32(b[4:]), Slot: binary.LittleEndian.Uint32(b[8:]), Gen: binary.LittleEndian.Uint64(b[16:]), Flags: fl}, nil
}
