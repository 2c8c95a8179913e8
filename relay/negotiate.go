package relay

import (
	"errors"
	"fmt"
	"net"
	"time"
)

// ErrUseTCP is what NegotiateRDMA returns when either end offers no RDMA:
// the side channel is clean, and the link's connections carry the TCP
// link as if nothing had been said. Its message says why.
var ErrUseTCP = errors.New("relay: the link is TCP")

const (
	offerSize  = 8
	offerMagic = "SHRN"
	offerVer   = 1
)

// NegotiateRDMA decides between the RDMA and the TCP link, on both ends
// of a link just made, over side (its first connection, already admitted
// by its token). Each end says whether it offers RDMA: it does if open
// gives it a queue pair (nil open, or an error such as ibv.ErrNoRDMA: it
// does not). If both offer, they set up an RDMA link over side
// (DialRDMA), which then watches side: the peer closing it (its relay
// gone) ends the link at once, even while no flow sends. Results:
//
//   - an RDMA link, and nil: use it; it owns side, and the caller may
//     close the link's other connections;
//   - nil and an error wrapping ErrUseTCP (no offer, here or there): side
//     is clean, use the TCP link on the connections as they are;
//   - nil and another error: the RDMA setup failed after both offered;
//     side is spent: close the connections and make the link again,
//     without RDMA for a while (the reason is the error's).
func NegotiateRDMA(side net.Conn, open func() (Verbs, error), o RDMAOptions) (*RDMALink, error) {
	if o.Timeout <= 0 {
		o.Timeout = 10 * time.Second
	}
	var v Verbs
	why := "this host offers no RDMA"
	if open != nil {
		var err error
		if v, err = open(); err != nil {
			v, why = nil, "this host offers no RDMA: "+err.Error()
		}
	}
	mine := make([]byte, offerSize)
	copy(mine, offerMagic)
	mine[4] = offerVer
	if v != nil {
		mine[5] = 1
	}
	side.SetDeadline(time.Now().Add(o.Timeout))
	theirs, err := exchange(side, mine, offerSize)
	side.SetDeadline(time.Time{})
	if err == nil && (string(theirs[:4]) != offerMagic || theirs[4] != offerVer || theirs[5] > 1 || theirs[6] != 0 || theirs[7] != 0) {
		err = fmt.Errorf("%w: not an RDMA offer: %q", ErrProtocol, theirs)
	}
	if err != nil {
		if v != nil {
			v.Close()
		}
		return nil, fmt.Errorf("relay: RDMA offer: %w", err)
	}
	if v == nil || theirs[5] == 0 {
		if v != nil {
			v.Close()
			why = "the peer offers no RDMA"
		}
		return nil, fmt.Errorf("%w: %s", ErrUseTCP, why)
	}
	l, err := dialRDMA(side, v, o, true)
	if err != nil {
		v.Close()
		return nil, err
	}
	return l, nil
}

// watch ends the link when side says anything or closes (nothing more is
// sent on it once the link runs); the link's teardown closes side.
func (l *RDMALink) watch(side net.Conn) {
	var b [1]byte
	_, err := side.Read(b[:])
	if err == nil {
		err = errors.New("bytes after setup")
	}
	l.fail(fmt.Errorf("relay rdma: the side channel ended: %w", err))
}
