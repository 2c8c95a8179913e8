package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"

	"golang.org/x/sys/unix"
)

// Front-end requests (vhost-user.rst, "Front-end message types"). Only
// those this back-end answers are named; any other is refused.
const (
	reqGetFeatures         = 1
	reqSetFeatures         = 2
	reqSetOwner            = 3
	reqResetOwner          = 4
	reqSetMemTable         = 5
	reqSetVringNum         = 8
	reqSetVringAddr        = 9
	reqSetVringBase        = 10
	reqGetVringBase        = 11
	reqSetVringKick        = 12
	reqSetVringCall        = 13
	reqSetVringErr         = 14
	reqGetProtocolFeatures = 15
	reqSetProtocolFeatures = 16
	reqGetQueueNum         = 17
	reqSetVringEnable      = 18
	reqGetConfig           = 24
	reqSetConfig           = 25
	reqResetDevice         = 34
)

// Header flags (vhost-user.rst, "Header"): version in bits 0-1 (0x1),
// reply in bit 2, need_reply in bit 3.
const (
	flagVersion   = 0x1
	flagReply     = 0x4
	flagNeedReply = 0x8

	headerSize = 12 // u32 request, u32 flags, u32 size

	// maxPayload bounds a message: the largest this back-end reads is
	// GET_CONFIG (12 + 256 bytes of config space) or a memory table of
	// maxRegions regions (8 + 32*8).
	maxPayload = 4096
	maxFDs     = 8
)

// Feature bits. VHOST_USER_F_PROTOCOL_FEATURES (30) is vhost-user's own;
// the rest are virtio's (virtio 1.2 §6 "Reserved Feature Bits").
const (
	FeatureIndirectDesc     = 1 << 28 // VIRTIO_RING_F_INDIRECT_DESC
	FeatureProtocolFeatures = 1 << 30 // VHOST_USER_F_PROTOCOL_FEATURES
	FeatureVersion1         = 1 << 32 // VIRTIO_F_VERSION_1
)

// Protocol feature bits (vhost-user.rst, "Protocol features").
const (
	ProtocolReplyAck = 1 << 3 // VHOST_USER_PROTOCOL_F_REPLY_ACK
	ProtocolConfig   = 1 << 9 // VHOST_USER_PROTOCOL_F_CONFIG
)

// maxRegions is VHOST_MEMORY_BASELINE_NREGIONS: a SET_MEM_TABLE carries at
// most 8 regions (more needs CONFIGURE_MEM_SLOTS, not offered).
const maxRegions = 8

// vringFDInvalid is bit 8 of SET_VRING_KICK/CALL/ERR's u64: no fd was sent
// (the "invalid FD flag"); bits 0-7 are the ring index.
const vringFDInvalid = 1 << 8

// maxConfig is VHOST_USER_MAX_CONFIG_SIZE, the config space's bound.
const maxConfig = 256

// msg is one message: the header's request and flags, the payload, and
// the fds that came with it (SCM_RIGHTS).
type msg struct {
	req, flags uint32
	payload    []byte
	fds        []int
}

func (m *msg) closeFDs() {
	for _, fd := range m.fds {
		unix.Close(fd)
	}
	m.fds = nil
}

// takeFD takes the message's only fd (SET_VRING_KICK and friends), or -1.
func (m *msg) takeFD() int {
	if len(m.fds) != 1 {
		return -1
	}
	fd := m.fds[0]
	m.fds = nil
	return fd
}

func (m *msg) u64() (uint64, error) {
	if len(m.payload) < 8 {
		return 0, fmt.Errorf("request %d: payload of %d bytes, want 8", m.req, len(m.payload))
	}
	return binary.LittleEndian.Uint64(m.payload), nil
}

// vringState is "A vring state description": u32 index, u32 num.
func (m *msg) vringState() (index, num uint32, err error) {
	if len(m.payload) < 8 {
		return 0, 0, fmt.Errorf("request %d: payload of %d bytes, want a vring state (8)", m.req, len(m.payload))
	}
	return binary.LittleEndian.Uint32(m.payload), binary.LittleEndian.Uint32(m.payload[4:]), nil
}

// vringAddr is "A vring address description": u32 index, u32 flags, then
// u64 descriptor, used and available ring addresses and log, in the
// front-end's virtual address space.
type vringAddr struct {
	index, flags      uint32
	desc, used, avail uint64
}

func (m *msg) vringAddr() (vringAddr, error) {
	if len(m.payload) < 40 {
		return vringAddr{}, fmt.Errorf("SET_VRING_ADDR: payload of %d bytes, want 40", len(m.payload))
	}
	p := m.payload
	le := binary.LittleEndian
	return vringAddr{index: le.Uint32(p), flags: le.Uint32(p[4:]), desc: le.Uint64(p[8:]), used: le.Uint64(p[16:]), avail: le.Uint64(p[24:])}, nil
}

// memRegion is "A memory region description": u64 guest_addr, u64 size,
// u64 user_addr, u64 mmap_offset.
type memRegion struct {
	gpa, size, va, offset uint64
}

// memTable is "Multiple Memory regions description": u32 nregions, u32
// padding, then nregions regions.
func (m *msg) memTable() ([]memRegion, error) {
	if len(m.payload) < 8 {
		return nil, fmt.Errorf("SET_MEM_TABLE: payload of %d bytes", len(m.payload))
	}
	n := binary.LittleEndian.Uint32(m.payload)
	if n == 0 || n > maxRegions || len(m.payload) < 8+32*int(n) {
		return nil, fmt.Errorf("SET_MEM_TABLE: %d regions in %d bytes (at most %d)", n, len(m.payload), maxRegions)
	}
	if int(n) != len(m.fds) {
		return nil, fmt.Errorf("SET_MEM_TABLE: %d regions but %d fds", n, len(m.fds))
	}
	rs := make([]memRegion, n)
	for i := range rs {
		p := m.payload[8+32*i:]
		le := binary.LittleEndian
		rs[i] = memRegion{gpa: le.Uint64(p), size: le.Uint64(p[8:]), va: le.Uint64(p[16:]), offset: le.Uint64(p[24:])}
	}
	return rs, nil
}

// readMsg reads one message and its fds.
func readMsg(c *net.UnixConn) (*msg, error) {
	hdr := make([]byte, headerSize)
	oob := make([]byte, unix.CmsgSpace(4*maxFDs))
	m := &msg{}
	got := 0
	for got < headerSize {
		n, oobn, _, _, err := c.ReadMsgUnix(hdr[got:], oob)
		if oobn > 0 {
			fds, perr := parseFDs(oob[:oobn])
			m.fds = append(m.fds, fds...)
			if perr != nil {
				m.closeFDs()
				return nil, perr
			}
		}
		if err != nil {
			m.closeFDs()
			return nil, err
		}
		if n == 0 {
			m.closeFDs()
			return nil, io.EOF
		}
		got += n
	}
	le := binary.LittleEndian
	m.req, m.flags = le.Uint32(hdr), le.Uint32(hdr[4:])
	size := le.Uint32(hdr[8:])
	if m.flags&0x3 != flagVersion || size > maxPayload || len(m.fds) > maxFDs {
		m.closeFDs()
		return nil, fmt.Errorf("bad message header: request %d, flags %#x, size %d, %d fds", m.req, m.flags, size, len(m.fds))
	}
	m.payload = make([]byte, size)
	if _, err := io.ReadFull(c, m.payload); err != nil {
		m.closeFDs()
		return nil, err
	}
	return m, nil
}

func parseFDs(oob []byte) ([]int, error) {
	cmsgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var files []int
	var bad error
	for _, cm := range cmsgs {
		fds, err := unix.ParseUnixRights(&cm)
		if err != nil {
			bad = errors.Join(bad, err)
			continue
		}
		for _, fd := range fds {
			unix.CloseOnExec(fd)
			files = append(files, fd)
		}
	}
	return files, bad
}

// writeReply answers m with payload.
func writeReply(c *net.UnixConn, m *msg, payload []byte) error {
	b := make([]byte, headerSize+len(payload))
	le := binary.LittleEndian
	le.PutUint32(b, m.req)
	le.PutUint32(b[4:], flagVersion|flagReply)
	le.PutUint32(b[8:], uint32(len(payload)))
	copy(b[headerSize:], payload)
	_, err := c.Write(b)
	return err
}

func u64(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }
