//go:build linux

package ctrack

import (
	"encoding/binary"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/shuntnet/shunt/internal/nsexec"
)

// getter does single-entry ctnetlink GETs on a raw netlink socket with a
// receive timeout. (ti-mo/conntrack's Get waits for a multipart end that
// kernel 6.x does not send after a found entry, and hangs.)
type getter struct {
	fd  int
	seq uint32
	buf []byte // for the replies; one lookup at a time uses it
}

// ctnetlink constants (linux/netfilter/nfnetlink_conntrack.h).
const (
	nfnlSubsysCTNetlink = 1
	ipctnlMsgCTNew      = 0
	ipctnlMsgCTGet      = 1
	ctaMark             = 8
	ctaMarkMask         = 21
	ctaTupleOrig        = 1
	ctaTupleIP          = 1
	ctaTupleProto       = 2
	ctaIPv4Src          = 1
	ctaIPv4Dst          = 2
	ctaIPv6Src          = 3
	ctaIPv6Dst          = 4
	ctaProtoNum         = 1
	ctaProtoSrcPort     = 2
	ctaProtoDstPort     = 3
)

func newGetter(netnsPath string) (*getter, error) {
	var fd int
	var err error
	open := func() error {
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		return err
	}
	if netnsPath == "" {
		err = open()
	} else {
		err = nsexec.In(netnsPath, open)
	}
	if err != nil {
		return nil, fmt.Errorf("conntrack netlink socket: %w", err)
	}
	tv := unix.NsecToTimeval(int64(2 * time.Second))
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, err
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &getter{fd: fd, buf: make([]byte, 16<<10)}, nil
}

func (g *getter) close() error { return unix.Close(g.fd) }

// get asks for the TCP entry with tuple t (either direction; t unmapped:
// AF_INET for IPv4, AF_INET6 for IPv6). The caller serializes calls.
func (g *getter) get(t Tuple) (conntrack.Flow, error) {
	if err := g.send(ipctnlMsgCTGet, t, nil); err != nil {
		return conntrack.Flow{}, err
	}
	return g.receive(true)
}

// setMark changes the bits mask of the mark of t's entry to value, with
// an update that never creates an entry (IPCTNL_MSG_CT_NEW without
// NLM_F_CREATE: the kernel's ctnetlink_change_mark computes
// (mark & ^mask) ^ value). The caller serializes calls.
func (g *getter) setMark(t Tuple, mask, value uint32) error {
	err := g.send(ipctnlMsgCTNew, t, func(ae *netlink.AttributeEncoder) {
		ae.Bytes(ctaMark, binary.BigEndian.AppendUint32(nil, value&mask))
		ae.Bytes(ctaMarkMask, binary.BigEndian.AppendUint32(nil, mask))
	})
	if err != nil {
		return err
	}
	_, err = g.receive(false)
	return err
}

// send sends one ctnetlink request of type typ for tuple t, with more
// attributes after the tuple.
func (g *getter) send(typ int, t Tuple, more func(*netlink.AttributeEncoder)) error {
	g.seq++
	ae := netlink.NewAttributeEncoder()
	ae.Nested(ctaTupleOrig|unix.NLA_F_NESTED, func(ae *netlink.AttributeEncoder) error {
		ae.Nested(ctaTupleIP|unix.NLA_F_NESTED, func(ae *netlink.AttributeEncoder) error {
			if t.Src.Addr().Is4() {
				ae.Bytes(ctaIPv4Src, t.Src.Addr().AsSlice())
				ae.Bytes(ctaIPv4Dst, t.Dst.Addr().AsSlice())
			} else {
				ae.Bytes(ctaIPv6Src, t.Src.Addr().AsSlice())
				ae.Bytes(ctaIPv6Dst, t.Dst.Addr().AsSlice())
			}
			return nil
		})
		ae.Nested(ctaTupleProto|unix.NLA_F_NESTED, func(ae *netlink.AttributeEncoder) error {
			ae.Uint8(ctaProtoNum, unix.IPPROTO_TCP)
			ae.Bytes(ctaProtoSrcPort, binary.BigEndian.AppendUint16(nil, t.Src.Port()))
			ae.Bytes(ctaProtoDstPort, binary.BigEndian.AppendUint16(nil, t.Dst.Port()))
			return nil
		})
		return nil
	})
	if more != nil {
		more(ae)
	}
	attrs, err := ae.Encode()
	if err != nil {
		return err
	}
	family := byte(unix.AF_INET)
	if !t.Src.Addr().Is4() {
		family = unix.AF_INET6
	}
	msg := netlink.Message{
		Header: netlink.Header{
			Type:     netlink.HeaderType(nfnlSubsysCTNetlink<<8 | typ),
			Flags:    netlink.Request | netlink.Acknowledge,
			Sequence: g.seq,
		},
		Data: append([]byte{family, 0, 0, 0}, attrs...), // nfgenmsg, then attributes
	}
	msg.Header.Length = uint32(16 + len(msg.Data)) // attributes keep 4-byte alignment
	b, err := msg.MarshalBinary()
	if err != nil {
		return err
	}
	if err := unix.Sendto(g.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	return nil
}

// receive reads the answer to the last request: an entry then the ACK
// (wantFlow), or the ACK alone.
func (g *getter) receive(wantFlow bool) (conntrack.Flow, error) {
	buf := g.buf
	var flow *conntrack.Flow
	for {
		n, _, err := unix.Recvfrom(g.fd, buf, 0)
		if err != nil {
			return conntrack.Flow{}, fmt.Errorf("receive: %w", err)
		}
		msgs, err := parseMessages(buf[:n])
		if err != nil {
			return conntrack.Flow{}, err
		}
		for _, m := range msgs {
			if m.Header.Sequence != g.seq {
				continue // a late reply to an earlier, timed-out request
			}
			if m.Header.Type == netlink.Error {
				code := int32(binary.NativeEndian.Uint32(m.Data))
				if code == 0 { // the ACK: the request is complete
					if !wantFlow {
						return conntrack.Flow{}, nil
					}
					if flow == nil {
						return conntrack.Flow{}, fmt.Errorf("conntrack acknowledged without an entry")
					}
					return *flow, nil
				}
				if syscall.Errno(-code) == unix.ENOENT {
					return conntrack.Flow{}, os.ErrNotExist
				}
				return conntrack.Flow{}, syscall.Errno(-code)
			}
			var ev conntrack.Event
			if err := ev.Unmarshal(m); err != nil {
				return conntrack.Flow{}, fmt.Errorf("decode conntrack entry: %w", err)
			}
			flow = ev.Flow
		}
	}
}

func parseMessages(b []byte) ([]netlink.Message, error) {
	var out []netlink.Message
	for len(b) >= 16 {
		l := int(binary.NativeEndian.Uint32(b))
		if l < 16 || l > len(b) {
			return nil, fmt.Errorf("netlink message length %d of %d bytes", l, len(b))
		}
		end := min(len(b), (l+3)&^3)
		var m netlink.Message
		if err := m.UnmarshalBinary(b[:end]); err != nil {
			return nil, err
		}
		out = append(out, m)
		b = b[end:]
	}
	return out, nil
}
