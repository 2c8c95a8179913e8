package vstretch

import (
	"encoding/binary"
	"errors"
)

// The daemon protocol: how the C library (guestlib/c/stretch.c) asks
// shunt-vstretchd for a stretch and steers it (docs/vsock.md, "The C
// library's stretches"). One SOCK_SEQPACKET connection per stretch; each
// message is one packet, little-endian:
//
//	request, ReqSize bytes              reply, ReplySize bytes
//	 0 magic "SVSD"                      0 magic "SVSD"
//	 4 op (OpOpen ...)                   4 op (the request's)
//	 5 reason (OpStop: DOWN's)           5 status (0 ok, 1 failed: Text says why)
//	 8 region  12 slot  16 gen (u64)     6 flag (OpStop: started; OpDrain: carried and flushed)
//	24 capacity (OpOpen)                 8 span (OpOpen: bytes per ring in the memfd, R at span)
//	                                    16 x (OpStop: where R's stretch ended)
//	                                    24 size (OpOpen: the memfd's size, 2*span)
//	                                    64 text (NUL-padded): an error, or the bridge's counters
//
// OpOpen's reply carries the memfd of the ring pair (SCM_RIGHTS). The
// connection ends cleanly with OpBye (the daemon then lets the bridge
// carry what is left, at most StretchEnd, and closes the stream with its
// last frames); any other end (the process died, exec closed it) is a
// break: the stream is closed at once, and hostd resets the other end's
// ring unless this side's LEFT already crossed.
const (
	ReqSize   = 64
	ReplySize = 192
	textAt    = 64

	OpOpen  = 1
	OpDrain = 2
	OpStop  = 3
	OpBye   = 4
)

var wireMagic = [4]byte{'S', 'V', 'S', 'D'}

// Req is a request to the daemon.
type Req struct {
	Op, Reason uint8
	Region     uint32
	Slot       uint32
	Gen        uint64
	Capacity   uint32
}

// Reply is the daemon's answer.
type Reply struct {
	Op, Status, Flag uint8
	Span, X, Size    uint64
	Text             string
}

var errBadReq = errors.New("vstretchd: not a request")

// Encode is r's packet.
func (r Req) Encode() []byte {
	b := make([]byte, ReqSize)
	copy(b, wireMagic[:])
	b[4], b[5] = r.Op, r.Reason
	binary.LittleEndian.PutUint32(b[8:], r.Region)
	binary.LittleEndian.PutUint32(b[12:], r.Slot)
	binary.LittleEndian.PutUint64(b[16:], r.Gen)
	binary.LittleEndian.PutUint32(b[24:], r.Capacity)
	return b
}

// DecodeReq parses a request packet (untrusted: any process of the VM
// may connect).
func DecodeReq(b []byte) (Req, error) {
	if len(b) != ReqSize || [4]byte(b[:4]) != wireMagic || b[4] < OpOpen || b[4] > OpBye {
		return Req{}, errBadReq
	}
	return Req{Op: b[4], Reason: b[5], Region: binary.LittleEndian.Uint32(b[8:]), Slot: binary.LittleEndian.Uint32(b[12:]),
		Gen: binary.LittleEndian.Uint64(b[16:]), Capacity: binary.LittleEndian.Uint32(b[24:])}, nil
}

// Encode is r's packet; Text is cut to fit.
func (r Reply) Encode() []byte {
	b := make([]byte, ReplySize)
	copy(b, wireMagic[:])
	b[4], b[5], b[6] = r.Op, r.Status, r.Flag
	binary.LittleEndian.PutUint64(b[8:], r.Span)
	binary.LittleEndian.PutUint64(b[16:], r.X)
	binary.LittleEndian.PutUint64(b[24:], r.Size)
	copy(b[textAt:ReplySize-1], r.Text)
	return b
}

// DecodeReply parses a reply packet.
func DecodeReply(b []byte) (Reply, error) {
	if len(b) != ReplySize || [4]byte(b[:4]) != wireMagic {
		return Reply{}, errors.New("vstretchd: not a reply")
	}
	t := b[textAt:]
	for i, c := range t {
		if c == 0 {
			t = t[:i]
			break
		}
	}
	return Reply{Op: b[4], Status: b[5], Flag: b[6], Span: binary.LittleEndian.Uint64(b[8:]), X: binary.LittleEndian.Uint64(b[16:]),
		Size: binary.LittleEndian.Uint64(b[24:]), Text: string(t)}, nil
}
