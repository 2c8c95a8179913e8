package proto

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"
)

// Version is the protocol version this package speaks. Version 2 named the
// region of every flow (RegionID) and added REGION and UNREGION: process
// guests get a region per guest pair as a file descriptor. Version 3 is
// path switching: a connection starts on TCP, READY moves it to the rings
// and DOWN back, any number of times (DOWN, LEFT; CLOSE names the request;
// HELLO and WELCOME carry the ring formats; REATTACH names the request).
// docs/protocol.md.
const Version = 3

// MinVersion is the oldest version this package decodes and encodes, so
// that hostd can tell an older guest library why it stays on TCP
// (ReasonVersion) instead of dropping it.
const MinVersion = 2

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
	Reattach       // guest -> hostd: ReqID (v3), RegionID, Slot, Gen, Side, Local/Remote of a flow it still holds
	Error          // hostd -> guest: Reason, Text; the channel closes after it (but see docs/protocol.md)
	RegionMsg      // hostd -> guest: RegionID, RegionSize; the region's fd rides along (SCM_RIGHTS)
	Unregion       // hostd -> guest: RegionID: no flow of this guest uses it any more; unmap it
	Down           // v3, hostd -> guest: ReqID, RegionID, Slot, Gen, Reason: leave the rings, go on over TCP
	Left           // v3, guest -> hostd: ReqID, RegionID, Slot, Gen, Side: this end has left both rings
	Resume         // v3, hostd -> guest: ReqID, RegionID, Slot, Gen, Reason, Offset: DOWN, and the writer resends on TCP from Offset (relayed flows)
	Ended          // v3, guest -> hostd: ReqID, RegionID, Slot, Gen, Side, Offset: the ring this end reads over a vsock stretch ended at Offset (after RESUME)
	numTypes
)

var typeNames = [...]string{"", "HELLO", "WELCOME", "LISTEN", "UNLISTEN", "INTENT", "OPEN", "READY", "TCP", "CLOSE", "RELEASE", "REVOKE", "KICK", "PING", "PONG", "REATTACH", "ERROR", "REGION", "UNREGION", "DOWN", "LEFT", "RESUME", "ENDED"}

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

// sideRelayed is READY's Side bit for a relayed flow (Msg.Relayed): the
// ring pair's other end is this host's relay, so the other guest's bytes
// reach the ring later than the kernel's FIN or RST may reach the socket.
// Sent only to libraries that announced CapResume, which all decode it.
const sideRelayed = 0x80

// Msg is one decoded message. Only the fields its Type lists are encoded;
// the rest are zero after Decode.
type Msg struct {
	// Version is the frame's protocol version when it is an older one
	// (MinVersion..Version-1); 0 means Version. Append encodes with it.
	Version uint8

	Type   Type
	ReqID  uint32
	Role   Role
	Side   Side
	Reason Reason
	// Relayed (READY) says the flow's other end is the relay to a peer
	// host (docs/crosshost.md): a kernel EOF or RST seen before the read
	// ring started or was left waits for it.
	Relayed bool

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
	// Formats (v3 HELLO) is the set of ring formats the guest reads and
	// writes, a bit per format (1<<ring.FormatVersion); in WELCOME, the one
	// hostd chose (a single bit), or 0 if none is common. HELLO's bit 31
	// is CapResume, not a ring format.
	Formats uint32
	// Offset (RESUME) is the stream offset of the writer's next TCP byte,
	// or ResumeAll or ResumeReset; (ENDED) where the ring a vsock
	// stretch's bridge wrote ended, or ResumeAll if it never started.
	Offset uint64
}

// CapResume is HELLO's Formats bit 31: the library handles RESUME. It is
// a capability, not a ring format: hostd masks it out before choosing
// WELCOME's format, and offers a cross-host (relayed) connection only to
// a guest that announced it (docs/crosshost.md). An older hostd ignores
// it (it looks only at the bits of formats it knows).
const CapResume uint32 = 1 << 31

// RESUME's special offsets. Any other Offset is a stream offset that must
// lie within the writer's stretch [start, W] and in bytes its ring still
// holds (docs/protocol.md, "RESUME").
const (
	// ResumeAll: nothing of the writer's ring reached the other end:
	// resend the whole stretch from its start (nothing if it never
	// started the ring).
	ResumeAll uint64 = ^uint64(0) - 1
	// ResumeReset: where the other end's ring ended is unknown: the
	// connection is reset (ECONNRESET to the application, RST to the
	// peer). An invalid Offset is handled alike.
	ResumeReset uint64 = ^uint64(0)
)

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
	fFormats
	fOffset
)

// layouts are version 3's; layoutV2 gives version 2's.
var layouts = [numTypes][]field{
	Hello:     {fPID, fFormats},
	Welcome:   {fGuestID, fGen, fRegionSize, fRegion, fFormats},
	Listen:    {fLocal},
	Unlisten:  {fLocal},
	Intent:    {fLocal, fRemote},
	Open:      {fReqID, fRole, fLocal, fRemote},
	Ready:     {fReqID, fRegionID, fSlot, fGen, fCapacity, fRingAB, fRingBA, fSide},
	TCP:       {fReqID, fReason},
	Close:     {fReqID, fRegionID, fSlot, fGen, fSide},
	Release:   {fRegionID, fSlot, fGen},
	Revoke:    {fRegionID, fSlot, fGen, fReason},
	Kick:      {fRegionID, fSlot, fGen, fSide},
	Ping:      {fNonce},
	Pong:      {fNonce},
	Reattach:  {fReqID, fRegionID, fSlot, fGen, fSide, fLocal, fRemote},
	Error:     {fReason, fText},
	RegionMsg: {fRegionID, fRegionSize},
	Unregion:  {fRegionID},
	Down:      {fReqID, fRegionID, fSlot, fGen, fReason},
	Left:      {fReqID, fRegionID, fSlot, fGen, fSide},
	Resume:    {fReqID, fRegionID, fSlot, fGen, fReason, fOffset},
	Ended:     {fReqID, fRegionID, fSlot, fGen, fSide, fOffset},
}

// layoutV2 returns version 2's fields for t, and whether v2 had the type.
func layoutV2(t Type) ([]field, bool) {
	switch t {
	case Hello:
		return []field{fPID}, true
	case Welcome:
		return []field{fGuestID, fGen, fRegionSize, fRegion}, true
	case Close:
		return []field{fRegionID, fSlot, fGen, fSide}, true
	case Reattach:
		return []field{fRegionID, fSlot, fGen, fSide, fLocal, fRemote}, true
	case Down, Left, Resume, Ended:
		return nil, false
	}
	return layouts[t], true
}

// layoutOf returns the fields of t in version v.
func layoutOf(v uint8, t Type) ([]field, bool) {
	if v == 2 {
		return layoutV2(t)
	}
	return layouts[t], true
}

var le = binary.LittleEndian

// Unmap returns ap in the form conntrack and hostd name it: an IPv4-mapped
// IPv6 address (::ffff:a.b.c.d, as an AF_INET6 socket names an IPv4 peer
// or a dual-stack listener's IPv4 side) as the IPv4 address a.b.c.d, and
// no zone (the wire has none). Every other address is unchanged. An
// address is 16 bytes on the wire, IPv4 as IPv4-mapped, so both forms of
// an IPv4 address encode alike, and Decode returns this form: a guest's
// OPEN for an IPv4 connection names its IPv4 conntrack tuple whether the
// socket was AF_INET or AF_INET6. The guest libraries name connections
// and listeners in this form too (the C library keeps the 16-byte wire
// form, in which the two are already one).
func Unmap(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap().WithZone(""), ap.Port())
}

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
	v := m.Version
	if v == 0 {
		v = Version
	}
	fields, ok := []field(nil), false
	if m.Type != 0 && m.Type < numTypes && v >= MinVersion && v <= Version {
		fields, ok = layoutOf(v, m.Type)
	}
	if !ok {
		return b, fmt.Errorf("encode %s in version %d: %w", m.Type, v, ErrMalformed)
	}
	start := len(b)
	b = append(b, v, byte(m.Type), 0, 0, 0, 0, 0, 0)
	for _, f := range fields {
		switch f {
		case fReqID:
			b = le.AppendUint32(b, m.ReqID)
		case fRole:
			b = append(b, byte(m.Role))
		case fSide:
			sb := byte(m.Side)
			if m.Relayed {
				sb |= sideRelayed
			}
			b = append(b, sb)
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
		case fFormats:
			b = le.AppendUint32(b, m.Formats)
		case fOffset:
			b = le.AppendUint64(b, m.Offset)
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

// ErrVersion marks a frame of a protocol version this package does not
// speak (it also wraps ErrMalformed): a guest library that sees it from
// hostd stays on TCP with ReasonVersion.
var ErrVersion = fmt.Errorf("unsupported protocol version: %w", ErrMalformed)

// ParseHeader validates a frame header and returns the type and payload
// length. The frame's version is h[0]; see ParseHeaderVersion.
func ParseHeader(h []byte) (Type, int, error) {
	_, t, n, err := ParseHeaderVersion(h)
	return t, n, err
}

// ParseHeaderVersion is ParseHeader that also returns the frame's version
// (MinVersion..Version).
func ParseHeaderVersion(h []byte) (uint8, Type, int, error) {
	if len(h) < HeaderSize {
		return 0, 0, 0, fmt.Errorf("header of %d bytes: %w", len(h), ErrMalformed)
	}
	v := h[0]
	if v < MinVersion || v > Version {
		return 0, 0, 0, fmt.Errorf("version %d, want %d to %d: %w", v, MinVersion, Version, ErrVersion)
	}
	t := Type(h[1])
	if t == 0 || t >= numTypes {
		return 0, 0, 0, fmt.Errorf("unknown message type %d: %w", h[1], ErrMalformed)
	}
	if _, ok := layoutOf(v, t); !ok {
		return 0, 0, 0, fmt.Errorf("%s in version %d: %w", t, v, ErrMalformed)
	}
	if h[2] != 0 || h[3] != 0 {
		return 0, 0, 0, fmt.Errorf("%s: reserved bytes set: %w", t, ErrMalformed)
	}
	n := le.Uint32(h[4:])
	if n > MaxPayload {
		return 0, 0, 0, fmt.Errorf("%s: payload %d bytes over %d: %w", t, n, MaxPayload, ErrMalformed)
	}
	return v, t, int(n), nil
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
	a := netip.AddrFrom16([16]byte(d.take(16))).Unmap() // as Unmap
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
	v, t, n, err := ParseHeaderVersion(frame)
	if err != nil {
		return Msg{}, err
	}
	if len(frame) != HeaderSize+n {
		return Msg{}, fmt.Errorf("%s: frame of %d bytes, header says %d: %w", t, len(frame), HeaderSize+n, ErrMalformed)
	}
	return DecodePayloadVersion(v, t, frame[HeaderSize:])
}

// DecodePayload decodes the payload of a version-3 message of type t. The
// payload must be exactly as long as the type's fields.
func DecodePayload(t Type, p []byte) (Msg, error) {
	return DecodePayloadVersion(Version, t, p)
}

// DecodePayloadVersion decodes the payload of a message of type t in
// protocol version v.
func DecodePayloadVersion(v uint8, t Type, p []byte) (Msg, error) {
	fields, ok := layoutOf(v, t)
	if v < MinVersion || v > Version || t == 0 || t >= numTypes || !ok {
		return Msg{}, fmt.Errorf("%s in version %d: %w", t, v, ErrMalformed)
	}
	m := Msg{Type: t}
	if v != Version {
		m.Version = v
	}
	d := decoder{b: p}
	for _, f := range fields {
		switch f {
		case fReqID:
			m.ReqID = le.Uint32(d.take(4))
		case fRole:
			m.Role = Role(d.take(1)[0])
			if m.Role != Active && m.Role != Passive {
				d.err = true
			}
		case fSide:
			sb := d.take(1)[0]
			m.Side, m.Relayed = Side(sb&^sideRelayed), sb&sideRelayed != 0
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
		case fFormats:
			m.Formats = le.Uint32(d.take(4))
		case fOffset:
			m.Offset = le.Uint64(d.take(8))
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
	v, t, n, err := ParseHeaderVersion(buf)
	if err != nil {
		return Msg{}, buf, err
	}
	buf = buf[:HeaderSize+n]
	if _, err := io.ReadFull(r, buf[HeaderSize:]); err != nil {
		return Msg{}, buf, fmt.Errorf("read %s payload: %w", t, err)
	}
	m, err := DecodePayloadVersion(v, t, buf[HeaderSize:])
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
