package vsock

import (
	"encoding/binary"
	"fmt"
)

// Hdr is struct virtio_vsock_hdr (virtio 1.2 §5.10.6 "Device Operation"),
// 44 bytes, packed, little-endian, in front of every packet on the rx
// and tx queues:
//
//	le64 src_cid; le64 dst_cid; le32 src_port; le32 dst_port; le32 len;
//	le16 type; le16 op; le32 flags; le32 buf_alloc; le32 fwd_cnt;
type Hdr struct {
	SrcCID, DstCID   uint64
	SrcPort, DstPort uint32
	Len              uint32 // payload bytes after the header
	Type, Op         uint16
	Flags            uint32
	BufAlloc, FwdCnt uint32 // the sender's receive buffer and what it consumed (credit)
}

// HdrSize is sizeof(struct virtio_vsock_hdr).
const HdrSize = 44

// Types and ops (virtio 1.2 §5.10.6).
const (
	TypeStream = 1 // VIRTIO_VSOCK_TYPE_STREAM
	// TypeSeqpacket (2) needs VIRTIO_VSOCK_F_SEQPACKET, not offered.

	OpRequest       = 1 // VIRTIO_VSOCK_OP_REQUEST
	OpResponse      = 2 // VIRTIO_VSOCK_OP_RESPONSE
	OpRst           = 3 // VIRTIO_VSOCK_OP_RST
	OpShutdown      = 4 // VIRTIO_VSOCK_OP_SHUTDOWN
	OpRW            = 5 // VIRTIO_VSOCK_OP_RW
	OpCreditUpdate  = 6 // VIRTIO_VSOCK_OP_CREDIT_UPDATE
	OpCreditRequest = 7 // VIRTIO_VSOCK_OP_CREDIT_REQUEST

	ShutdownRcv  = 1 // VIRTIO_VSOCK_SHUTDOWN_F_RECEIVE: the sender will receive no more
	ShutdownSend = 2 // VIRTIO_VSOCK_SHUTDOWN_F_SEND: the sender will send no more

	// HostCID is VMADDR_CID_HOST, the host's address as the guest sees it.
	HostCID = 2
	// MaxPayload bounds a packet's payload (VIRTIO_VSOCK_MAX_PKT_BUF_SIZE
	// in Linux, 64 KiB): a longer len is refused.
	MaxPayload = 64 << 10
)

// ParseHdr decodes the header at the start of b.
func ParseHdr(b []byte) (Hdr, error) {
	if len(b) < HdrSize {
		return Hdr{}, fmt.Errorf("vsock header of %d bytes, want %d", len(b), HdrSize)
	}
	le := binary.LittleEndian
	return Hdr{
		SrcCID: le.Uint64(b), DstCID: le.Uint64(b[8:]),
		SrcPort: le.Uint32(b[16:]), DstPort: le.Uint32(b[20:]), Len: le.Uint32(b[24:]),
		Type: le.Uint16(b[28:]), Op: le.Uint16(b[30:]),
		Flags: le.Uint32(b[32:]), BufAlloc: le.Uint32(b[36:]), FwdCnt: le.Uint32(b[40:]),
	}, nil
}

// Put encodes h into the first HdrSize bytes of b.
func (h Hdr) Put(b []byte) {
	le := binary.LittleEndian
	le.PutUint64(b, h.SrcCID)
	le.PutUint64(b[8:], h.DstCID)
	le.PutUint32(b[16:], h.SrcPort)
	le.PutUint32(b[20:], h.DstPort)
	le.PutUint32(b[24:], h.Len)
	le.PutUint16(b[28:], h.Type)
	le.PutUint16(b[30:], h.Op)
	le.PutUint32(b[32:], h.Flags)
	le.PutUint32(b[36:], h.BufAlloc)
	le.PutUint32(b[40:], h.FwdCnt)
}

func (h Hdr) String() string {
	return fmt.Sprintf("op %d type %d %d:%d -> %d:%d len %d flags %#x buf %d fwd %d", h.Op, h.Type, h.SrcCID, h.SrcPort, h.DstCID, h.DstPort, h.Len, h.Flags, h.BufAlloc, h.FwdCnt)
}
