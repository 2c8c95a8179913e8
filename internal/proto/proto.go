package proto

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"
)

// Version is the protocol version this package speaks. Version 2 names the
// region of every flow (RegionID) and adds REGION and UNREGION: process
// guests get a region per guest pair as a file descriptor (docs/protocol.md).
const Version = 2

// HeaderSize is the frame header; MaxPayload bounds a payload so a peer
// cannot make the receiver allocate without limit.
const (
	HeaderSize = 8
	MaxPayload = 4096
)

// ErrMalformed marks a frame that breaks the protocol.
var ErrMalformed = errors.New("shunt protocol: malformed message")

// Type is a message type.
type Type uint8

const (
	_         Type = iota
	Hello          // guest -> hostd: first message; PID
	Welcome        // hostd -> guest: GuestID, Region, RegionSize, Gen (region generation)
	Listen         // guest -> hostd: Local is a listening address
	Unlisten       // guest -> hostd: Local stops listening
	Intent         // guest -> hostd: Local/Remote of a connect about to start
	Open           // guest -> hostd: ReqID, Role, Local/Remote of an established connection
	Ready          // hostd -> guest: ReqID, Slot, Gen, Capacity, RingAB, RingBA, Side
	TCP            // hostd -> guest: ReqID, Reason: stay on TCP
	Close          // guest -> hostd: Slot, Gen, Side: this end is done with the flow
	Release        // hostd -> guest: Slot, Gen: the flow's slot was freed
	Revoke         // hostd -> guest: Slot, Gen, Reason: the flow is revoked
	Kick           // both: Slot, Gen, Side: wake the reader/writer of that side (VMs)
	Ping           // both: Nonce
	Pong           // both: Nonce
	Reattach       // guest -> hostd: RegionID, Slot, Gen, Side, Local/Remote of a flow it still holds
	Error          // hostd -> guest: Reason, Text; the channel closes after it (but see docs/protocol.md)
	RegionMsg      // hostd -> guest: RegionID, RegionSize; the region's fd rides along (SCM_RIGHTS)
	Unregion       // hostd -> guest: RegionID: no flow of this guest uses it any more; unmap it
	numTypes
)

var typeNames = [...]string{"", "HELLO", "WELCOME", "LISTEN", "UNLISTEN", "INTENT", "OPEN", "READY", "TCP", "CLOSE", "RELEASE", "REVOKE", "KICK", "PING", "PONG", "REATTACH", "ERROR", "REGION", "UNREGION"}

func (t Type) String() string {
	if t > 0 && t < numTypes {
		return typeNames[t]
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// Role says which end of a connection an OPEN describes.
type Role uint8

const (
	Active  Role = 1 // connect()
	Passive Role = 2 // accept()
)

// Side is a ring-pair side: A (active) writes ring AB, B (passive) ring BA.
type Side uint8

const (
	SideA Side = 1
	SideB Side = 2
)

// Msg is one decoded message. Only the fields its Type lists are encoded;
// the rest are zero after Decode.
type Msg struct {
	Type   Type
	ReqID  uint32
	Role   Role
	Side   Side
	Reason Reason

	Local, Remote netip.AddrPort

	Slot     uint32
	Gen      uint64
	Capacity uint32
	RingAB   uint64
	RingBA   uint64

	// RegionID names the region of a flow: 0 is the region WELCOME named
	// (a VM's BAR, or a trust group's region), others came by REGION.
	RegionID   uint32
	GuestID    uint32
	RegionSize uint64
	Region     string
	PID        uint32
	Nonce      uint64
	Text       string
}

// field kinds, in encoding order, for each type.
type field uint8

const (
	fReqID field = iota
	fRole
	fSide
	fReason
	fLocal
	fRemote
	fSlot
	fGen
	fCapacity
	fRingAB
	fRingBA
	fRegionID
	fGuestID
	fRegionSize
	fRegion
	fPID
	fNonce
	fText
)

var layouts = [numTypes][]field{
	Hello:     {fPID},
	Welcome:   {fGuestID, fGen, fRegionSize, fRegion},
	Listen:    {fLocal},
	Unlisten:  {fLocal},
	Intent:    {fLocal, fRemote},
	Open:      {fReqID, fRole, fLocal, fRemote},
	Ready:     {fReqID, fRegionID, fSlot, fGen, fCapacity, fRingAB, fRingBA, fSide},
	TCP:       {fReqID, fReason},
	Close:     {fRegionID, fSlot, fGen, fSide},
	Release:   {fRegionID, fSlot, fGen},
	Revoke:    {fRegionID, fSlot, fGen, fReason},
	Kick:      {fRegionID, fSlot, fGen, fSide},
	Ping:      {fNonce},
	Pong:      {fNonce},
	Reattach:  {fRegionID, fSlot, fGen, fSide, fLocal, fRemote},
	Error:     {fReason, fText},
	RegionMsg: {fRegionID, fRegionSize},
	Unregion:  {fRegionID},
}

var le = binary.LittleEndian

func appendAddrPort(b []byte, ap netip.AddrPort) []byte {
	a := ap.Addr().As16()
	if !ap.Addr().IsValid() {
		a = [16]byte{}
	}
	b = append(b, a[:]...)
	return le.AppendUint16(b, ap.Port())
}

// Append encodes m as a frame appended to b.
func (m *Msg) Append(b []byte) ([]byte, error) {
	if m.Type == 0 || m.Type >= numTypes {
		return b, fmt.Errorf("encode %s: %w", m.Type, ErrMalformed)
	}
	start := len(b)
	b = append(b, Version, byte(m.Type), 0, 0, 0, 0, 0, 0)
	for _, f := range layouts[m.Type] {
		switch f {
		case fReqID:
			b = le.AppendUint32(b, m.ReqID)
		case fRole:
			b = append(b, byte(m.Role))
		case fSide:
			b = append(b, byte(m.Side))
		case fReason:
			b = le.AppendUint16(b, uint16(m.Reason))
		case fLocal:
			b = appendAddrPort(b, m.Local)
		case fRemote:
			b = appendAddrPort(b, m.Remote)
		case fSlot:
			b = le.AppendUint32(b, m.Slot)
		case fGen:
			b = le.AppendUint64(b, m.Gen)
		case fCapacity:
			b = le.AppendUint32(b, m.Capacity)
		case fRingAB:
			b = le.AppendUint64(b, m.RingAB)
		case fRingBA:
			b = le.AppendUint64(b, m.RingBA)
		case fRegionID:
			b = le.AppendUint32(b, m.RegionID)
		case fGuestID:
			b = le.AppendUint32(b, m.GuestID)
		case fRegionSize:
			b = le.AppendUint64(b, m.RegionSize)
		case fRegion:
			b = appendString(b, m.Region)
		case fPID:
			b = le.AppendUint32(b, m.PID)
		case fNonce:
			b = le.AppendUint64(b, m.Nonce)
		case fText:
			b = appendString(b, m.Text)
		}
	}
	n := len(b) - start - HeaderSize
	if n > MaxPayload {
		return b[:start], fmt.Errorf("encode %s: payload %d bytes over %d: %w", m.Type, n, MaxPayload, ErrMalformed)
	}
	le.PutUint32(b[start+4:], uint32(n))
	return b, nil
}

// maxString keeps any frame within MaxPayload.
const maxString = 1024

func appendString(b []byte, s string) []byte {
	if len(s) > maxString {
		s = s[:maxString]
	}
	b = le.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

// ParseHeader validates a frame header and returns the type and payload
// length.
func ParseHeader(h []byte) (Type, int, error) {
	if len(h) < HeaderSize {
		return 0, 0, fmt.Errorf("header of %d bytes: %w", len(h), ErrMalformed)
	}
	if h[0] != Version {
		return 0, 0, fmt.Errorf("version %d, want %d: %w", h[0], Version, ErrMalformed)
	}
	t := Type(h[1])
	if t == 0 || t >= numTypes {
		return 0, 0, fmt.Errorf("unknown message type %d: %w", h[1], ErrMalformed)
	}
	if h[2] != 0 || h[3] != 0 {
		return 0, 0, fmt.Errorf("%s: reserved bytes set: %w", t, ErrMalformed)
	}
	n := le.Uint32(h[4:])
	if n > MaxPayload {
		return 0, 0, fmt.Errorf("%s: payload %d bytes over %d: %w", t, n, MaxPayload, ErrMalformed)
	}
	return t, int(n), nil
}

// decoder reads fields from a payload, remembering the first shortfall.
type decoder struct {
	b   []byte
	err bool
}

func (d *decoder) take(n int) []byte {
	if d.err || len(d.b) < n {
		d.err = true
		return make([]byte, n)
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) addrPort() netip.AddrPort {
	a := netip.AddrFrom16([16]byte(d.take(16))).Unmap()
	p := le.Uint16(d.take(2))
	if a == netip.IPv6Unspecified() && p == 0 {
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(a, p)
}

func (d *decoder) str() string {
	n := int(le.Uint16(d.take(2)))
	if n > maxString {
		d.err = true
		return ""
	}
	return string(d.take(n))
}

// Decode decodes one whole frame (header and payload).
func Decode(frame []byte) (Msg, error) {
	t, n, err := ParseHeader(frame)
	if err != nil {
		return Msg{}, err
	}
	if len(frame) != HeaderSize+n {
		return Msg{}, fmt.Errorf("%s: frame of %d bytes, header says %d: %w", t, len(frame), HeaderSize+n, ErrMalformed)
	}
	return DecodePayload(t, frame[HeaderSize:])
}

// DecodePayload decodes the payload of a message of type t. The payload must
// be exactly as long as the type's fields.
func DecodePayload(t Type, p []byte) (Msg, error) {
	m := Msg{Type: t}
	d := decoder{b: p}
	for _, f := range layouts[t] {
		switch f {
		case fReqID:
			m.ReqID = le.Uint32(d.take(4))
		case fRole:
			m.Role = Role(d.take(1)[0])
			if m.Role != Active && m.Role != Passive {
				d.err = true
			}
		case fSide:
			m.Side = Side(d.take(1)[0])
			if m.Side != SideA && m.Side != SideB {
				d.err = true
			}
		case fReason:
			m.Reason = Reason(le.Uint16(d.take(2)))
		case fLocal:
			m.Local = d.addrPort()
		case fRemote:
			m.Remote = d.addrPort()
		case fSlot:
			m.Slot = le.Uint32(d.take(4))
		case fGen:
			m.Gen = le.Uint64(d.take(8))
		case fCapacity:
			m.Capacity = le.Uint32(d.take(4))
		case fRingAB:
			m.RingAB = le.Uint64(d.take(8))
		case fRingBA:
			m.RingBA = le.Uint64(d.take(8))
		case fRegionID:
			m.RegionID = le.Uint32(d.take(4))
		case fGuestID:
			m.GuestID = le.Uint32(d.take(4))
		case fRegionSize:
			m.RegionSize = le.Uint64(d.take(8))
		case fRegion:
			m.Region = d.str()
		case fPID:
			m.PID = le.Uint32(d.take(4))
		case fNonce:
			m.Nonce = le.Uint64(d.take(8))
		case fText:
			m.Text = d.str()
		}
	}
	if d.err || len(d.b) != 0 {
		return Msg{}, fmt.Errorf("%s: payload of %d bytes does not match its fields: %w", t, len(p), ErrMalformed)
	}
	return m, nil
}

// Read reads one frame from r into buf (grown as needed) and decodes it.
func Read(r io.Reader, buf []byte) (Msg, []byte, error) {
	if cap(buf) < HeaderSize+MaxPayload {
		buf = make([]byte, HeaderSize+MaxPayload)
	}
	buf = buf[:HeaderSize]
	if _, err := io.ReadFull(r, buf); err != nil {
		return Msg{}, buf, err
	}
	t, n, err := ParseHeader(buf)
	if err != nil {
		return Msg{}, buf, err
	}
	buf = buf[:HeaderSize+n]
	if _, err := io.ReadFull(r, buf[HeaderSize:]); err != nil {
		return Msg{}, buf, fmt.Errorf("read %s payload: %w", t, err)
	}
	m, err := DecodePayload(t, buf[HeaderSize:])
	return m, buf, err
}

// Write encodes m and writes it to w in one call.
func Write(w io.Writer, m *Msg) error {
	var a [HeaderSize + 256]byte
	b, err := m.Append(a[:0])
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}
