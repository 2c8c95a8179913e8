package relay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// Verbs is the RDMA link's view of one reliable-connected (RC) queue pair
// and its registered memory: what the C shim over libibverbs gives
// (relay/ibv, build tag rdma) and what the tests fake. The link's logic
// (rdma.go) talks only to this, so it builds and is tested everywhere.
//
// Memory: Recv is this end's ring, registered for remote writes by the
// peer (its address and key go to the peer in Local); a small credit area
// beside it is registered the same way. Send is the local registered
// buffer a batch is built in before the NIC writes it to the same offset
// of the peer's ring. Nothing else is registered for remote access.
type Verbs interface {
	// Local is this end's parameters for the peer.
	Local() Endpoint
	// Connect moves the queue pair to ready-to-send toward peer, whose
	// endpoint the caller has checked (Endpoint.Check).
	Connect(peer Endpoint) error
	// Send and Recv are the registered buffers, each of Local().Size
	// bytes; they stay valid until Close.
	Send() []byte
	Recv() []byte
	// Credit is the credit area the peer writes (bytes and batches it
	// released of this end's writes, little endian as the frames: the
	// relay runs on little-endian hosts); read it with atomic loads.
	Credit() *[2]uint64
	// Write posts an RDMA WRITE WITH IMMEDIATE of Send()[off:off+n] to
	// the same offset of the peer's ring, with immediate n; its
	// completion is OpWrite.
	Write(off, n int) error
	// WriteCredit posts an RDMA WRITE of (bytes, batches) into the
	// peer's credit area; its completion is OpCredit. One at a time.
	WriteCredit(bytes, batches uint64) error
	// PostRecv posts k receives; each incoming write with immediate
	// takes one (OpRecv).
	PostRecv(k int) error
	// Poll reaps up to len(cs) completions without blocking.
	Poll(cs []Completion) (int, error)
	// Sleep waits on the completion channel for a completion, at most d.
	Sleep(d time.Duration) error
	// Close frees the queue pair and memory; no call may be running.
	Close() error
}

// DeviceWatch is implemented by Verbs whose device can be removed under
// the link: `rdma link delete`, a driver unbound, a NIC unplugged. Gone
// says why once the removal has begun (nil before). The link asks every
// DeviceCheck and then ends with ErrDeviceGone, which also releases the
// device: a driver without disassociate_ucontext (rxe in Linux 6.1)
// makes the removal wait until every process holding the device closes
// it, while the device keeps working, so a link that did not look would
// hold it, and the removal, until its peer went.
type DeviceWatch interface {
	Gone() error
}

// DeviceCheck is how often an RDMA link asks its DeviceWatch.
const DeviceCheck = 250 * time.Millisecond

// ErrDeviceGone ends an RDMA link whose device is being removed.
var ErrDeviceGone = errors.New("relay rdma: the RDMA device is being removed")

// Op is what a completion completes.
type Op uint8

// Completion kinds.
const (
	OpWrite  Op = 1 // a Write (this end's batch reached the peer's ring)
	OpCredit Op = 2 // a WriteCredit
	OpRecv   Op = 3 // the peer's write with immediate landed in Recv
)

// Completion is one work completion.
type Completion struct {
	Op     Op
	Imm    uint32 // OpRecv: the immediate (the batch's length)
	Status int    // 0: success; else ibv_wc_status
	Detail string // the status in words, for the link's error
}

// Endpoint is what one end of an RDMA link tells the other over the side
// channel (for example the peers' TLS channel).
type Endpoint struct {
	QPN, PSN uint32   // queue pair number and first packet sequence number (24 bits each)
	LID      uint16   // InfiniBand local id (0 on RoCE)
	MTU      uint8    // ibv_mtu: 1 (256) to 5 (4096)
	GID      [16]byte // RoCE / global route address
	Ring     uint64   // the address of the sender's receive ring (its credit area follows at Ring+Size)
	RKey     uint32   // the remote key of that region
	Size     uint32   // ring bytes
	Depth    uint32   // batches in flight (receives posted)
}

const (
	endpointSize  = 64
	endpointMagic = 0x44524853 // "SHRD"
	endpointVer   = 1
)

// Marshal gives e's 64 bytes on the side channel.
func (e Endpoint) Marshal() []byte {
	b := make([]byte, endpointSize)
	le := binary.LittleEndian
	le.PutUint32(b[0:], endpointMagic)
	le.PutUint32(b[4:], endpointVer)
	le.PutUint32(b[8:], e.QPN)
	le.PutUint32(b[12:], e.PSN)
	le.PutUint16(b[16:], e.LID)
	b[18] = e.MTU
	copy(b[20:36], e.GID[:])
	le.PutUint64(b[36:], e.Ring)
	le.PutUint32(b[44:], e.RKey)
	le.PutUint32(b[48:], e.Size)
	le.PutUint32(b[52:], e.Depth)
	return b
}

// UnmarshalEndpoint parses a peer's endpoint; Check decides whether it
// fits this end.
func UnmarshalEndpoint(b []byte) (Endpoint, error) {
	le := binary.LittleEndian
	if len(b) != endpointSize || le.Uint32(b[0:]) != endpointMagic {
		return Endpoint{}, fmt.Errorf("%w: not an RDMA endpoint", ErrProtocol)
	}
	if v := le.Uint32(b[4:]); v != endpointVer {
		return Endpoint{}, fmt.Errorf("%w: RDMA endpoint version %d, want %d", ErrProtocol, v, endpointVer)
	}
	for _, x := range append(b[19:20:20], b[56:]...) {
		if x != 0 {
			return Endpoint{}, fmt.Errorf("%w: RDMA endpoint: reserved bytes set", ErrProtocol)
		}
	}
	e := Endpoint{QPN: le.Uint32(b[8:]), PSN: le.Uint32(b[12:]), LID: le.Uint16(b[16:]), MTU: b[18],
		Ring: le.Uint64(b[36:]), RKey: le.Uint32(b[44:]), Size: le.Uint32(b[48:]), Depth: le.Uint32(b[52:])}
	copy(e.GID[:], b[20:36])
	return e, nil
}

// Check tells whether the peer's endpoint p fits this end's, e. The
// ring's address and key are not checked: this end's NIC writes into the
// peer's memory with them, and a wrong one only errors this end's queue
// pair (the link ends). The sizes must match: each end lays out its
// writes by the peer's ring, and mirrors it in its own Send buffer.
func (e Endpoint) Check(p Endpoint) error {
	switch {
	case p.QPN == 0 || p.QPN >= 1<<24:
		return fmt.Errorf("%w: RDMA endpoint: queue pair %d", ErrProtocol, p.QPN)
	case p.PSN >= 1<<24:
		return fmt.Errorf("%w: RDMA endpoint: PSN %d", ErrProtocol, p.PSN)
	case p.MTU < 1 || p.MTU > 5:
		return fmt.Errorf("%w: RDMA endpoint: MTU code %d", ErrProtocol, p.MTU)
	case p.Size != e.Size || p.Depth != e.Depth:
		return fmt.Errorf("%w: RDMA endpoint: ring %d bytes, depth %d; here %d, %d", ErrProtocol, p.Size, p.Depth, e.Size, e.Depth)
	}
	return nil
}

// Gather is implemented by Verbs that can register memory for the local
// NIC to read and gather one write from several places: the sending side
// of zero copy (zerocopy.go, docs/rdma.md "Zero copy of guests' rings").
// A registration made here grants the peer nothing: it has no remote
// key, and the NIC only reads it for this end's own writes.
type Gather interface {
	// Register registers mem (a guest region the relay maps) for the
	// local NIC to read, no remote access; its pages stay pinned until
	// Deregister, so a guest that truncates the region cannot fault the
	// NIC's read. The key is never 0 (0 names the Send buffer).
	Register(mem []byte) (key uint32, err error)
	// Deregister removes a registration; no posted write may still
	// gather from it (the link waits for their completions first).
	Deregister(key uint32) error
	// MaxSGE is how many scatter entries one WriteSG may have.
	MaxSGE() int
	// WriteSG posts an RDMA WRITE WITH IMMEDIATE of the bytes sg names,
	// in order, n in all, to offset off of the peer's ring (immediate
	// n); its completion is OpWrite. An entry outside its registration,
	// or of a key not registered, is refused (here, or by the NIC with
	// a local protection error: the link ends).
	WriteSG(off, n int, sg []SGE) error
}

// SGE is one scatter/gather entry of a WriteSG: Len bytes at Off of the
// registered memory Key (0: the Send buffer).
type SGE struct {
	Key uint32
	Off uint64
	Len uint32
}
