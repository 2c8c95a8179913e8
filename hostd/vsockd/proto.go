package vsockd

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"

	"github.com/shuntnet/shunt/hostd/vsockhost"
	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/relay"
)

// Version is the newest protocol version this side speaks. A hello
// carries the sender's newest; the daemon accepts any from MinVersion up
// and answers with the one both speak (the lower), which the client then
// speaks, so upgrading hostd past a daemon left running (the package
// does not restart it: that costs the VMs their vsock) does not lock
// hostd out. The hello's fields are frozen for that.
const Version = 1

// MinVersion is the oldest version this side still speaks.
const MinVersion = 1

// MaxMsg bounds a message: one packet.
const MaxMsg = 4096

// Ports are the host's vsock ports shunt-vsockd forwards to hostd: the
// control channel and the stretches.
var Ports = []uint32{proto.VsockControlPort, relay.VsockPort}

// maxSocket is the longest device socket path: sun_path (107 bytes) less
// the longest forward suffix ("_1022").
const maxSocket = 107 - 5

// Ops.
const (
	OpHello    = "hello"
	OpDevice   = "device"
	OpList     = "list"
	OpForget   = "forget"
	OpStat     = "stat"
	OpEnd      = "end"
	OpFrontend = "frontend"
	OpError    = "error"
	OpBye      = "bye" // to a controller replaced by a newer hello
)

// Msg is one message either way; which fields an op carries is in the
// package doc.
type Msg struct {
	Op        string          `json:"op"`
	Version   int             `json:"version,omitempty"`
	PID       int             `json:"pid,omitempty"`
	Device    *Device         `json:"device,omitempty"`
	ID        uint32          `json:"id,omitempty"`
	Kept      bool            `json:"kept,omitempty"`
	Connected bool            `json:"connected,omitempty"`
	Stat      *vsockhost.Stat `json:"stat,omitempty"`
	Error     string          `json:"error,omitempty"`
}

// Device is one VM's vhost-user-vsock device: its guest (name and id),
// the socket QEMU connects to, its CID. The guest's connections to the
// host's Ports go to Socket_<port>.
type Device struct {
	Guest  string `json:"guest"`
	ID     uint32 `json:"id"`
	Socket string `json:"socket"`
	CID    uint32 `json:"cid"`
}

// ErrProto is a message that breaks the protocol.
var ErrProto = errors.New("vsockd protocol")

// Check validates a device: a printable name, an id, an absolute clean
// socket path short enough for its forwards, a CID a guest may have.
func (d *Device) Check() error {
	switch {
	case d.Guest == "" || len(d.Guest) > 64 || strings.ContainsFunc(d.Guest, func(r rune) bool { return r <= ' ' || r > '~' }):
		return fmt.Errorf("%w: guest name %q: want 1-64 printable characters", ErrProto, d.Guest)
	case d.ID == 0:
		return fmt.Errorf("%w: guest %s: no id", ErrProto, d.Guest)
	case !filepath.IsAbs(d.Socket) || filepath.Clean(d.Socket) != d.Socket || len(d.Socket) > maxSocket:
		return fmt.Errorf("%w: guest %s: socket %q: want a clean absolute path of at most %d bytes", ErrProto, d.Guest, d.Socket, maxSocket)
	case d.CID < 3 || d.CID > 0xfffffffe:
		return fmt.Errorf("%w: guest %s: cid %d: want 3 to %d", ErrProto, d.Guest, d.CID, uint32(0xfffffffe))
	}
	return nil
}

// check validates a message's fields for its op.
func (m *Msg) check() error {
	switch m.Op {
	case OpHello:
		if m.Version < MinVersion {
			return fmt.Errorf("%w: version %d, want %d or later (upgrade hostd)", ErrProto, m.Version, MinVersion)
		}
	case OpDevice:
		if m.Device != nil {
			return m.Device.Check()
		}
		if m.ID == 0 {
			return fmt.Errorf("%w: device without a device or an id", ErrProto)
		}
	case OpForget, OpFrontend:
		if m.ID == 0 {
			return fmt.Errorf("%w: %s without an id", ErrProto, m.Op)
		}
	case OpStat:
		if m.Stat == nil {
			return fmt.Errorf("%w: stat without a stat", ErrProto)
		}
	case OpList, OpEnd, OpError, OpBye:
	default:
		return fmt.Errorf("%w: unknown op %q", ErrProto, m.Op)
	}
	return nil
}

// Decode parses and validates one message.
func Decode(b []byte) (Msg, error) {
	var m Msg
	if len(b) > MaxMsg {
		return m, fmt.Errorf("%w: a message of more than %d bytes", ErrProto, MaxMsg)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return Msg{}, fmt.Errorf("%w: %w", ErrProto, err)
	}
	if dec.More() {
		return Msg{}, fmt.Errorf("%w: more than one message in a packet", ErrProto)
	}
	if err := m.check(); err != nil {
		return Msg{}, err
	}
	return m, nil
}

// Encode is a message's packet.
func Encode(m Msg) ([]byte, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	if len(b) > MaxMsg {
		return nil, fmt.Errorf("%w: a %s message of %d bytes (at most %d)", ErrProto, m.Op, len(b), MaxMsg)
	}
	return b, nil
}

// read reads one message from c.
func read(c *net.UnixConn) (Msg, error) {
	b := make([]byte, MaxMsg+1) // a longer packet is cut to MaxMsg+1: refused
	n, err := c.Read(b)
	if err != nil {
		return Msg{}, err
	}
	if n == 0 {
		return Msg{}, net.ErrClosed // the peer's end of a SEQPACKET socket
	}
	return Decode(b[:n])
}

// write writes one message to c.
func write(c *net.UnixConn, m Msg) error {
	b, err := Encode(m)
	if err != nil {
		return err
	}
	_, err = c.Write(b)
	return err
}
