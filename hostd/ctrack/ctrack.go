package ctrack

import (
	"context"
	"errors"
	"net/netip"
	"time"
)

// Tuple is one direction of a connection.
type Tuple struct {
	Src, Dst netip.AddrPort
}

func (t Tuple) String() string { return t.Src.String() + "->" + t.Dst.String() }

// Unmap returns t with IPv4-mapped IPv6 addresses (::ffff:a.b.c.d) as
// IPv4 and no zones: the form conntrack names an IPv4 connection in (its
// entry is AF_INET whether the sockets were AF_INET or AF_INET6). Lookup
// takes either form; Entry tuples are always in this one.
func (t Tuple) Unmap() Tuple {
	un := func(a netip.AddrPort) netip.AddrPort {
		return netip.AddrPortFrom(a.Addr().Unmap().WithZone(""), a.Port())
	}
	return Tuple{un(t.Src), un(t.Dst)}
}

// Reverse returns the other direction.
func (t Tuple) Reverse() Tuple { return Tuple{t.Dst, t.Src} }

// TCP states as ctnetlink reports them.
const (
	StateEstablished = 3
)

// Entry is the part of a conntrack entry hostd uses.
type Entry struct {
	ID          uint32 // the kernel's id of this entry (a reused tuple gets a new one)
	Orig, Reply Tuple
	TCPState    uint8
	Assured     bool
	Mark        uint32
	Zone        uint16
	// Start is when the entry was made (net.netfilter.nf_conntrack_timestamp=1
	// when it was made; zero otherwise).
	Start time.Time
	// Accounting counters (net.netfilter.nf_conntrack_acct=1), per
	// direction; all zero when the entry has none (accounting was off
	// when the entry was made).
	PacketsOrig, PacketsReply uint64
	BytesOrig, BytesReply     uint64
}

// Counted reports whether the entry carries accounting counters: any
// connection that got an entry has moved a packet, so zero means none.
func (e Entry) Counted() bool { return e.PacketsOrig != 0 || e.PacketsReply != 0 }

// Established reports whether the connection is ESTABLISHED and assured.
func (e Entry) Established() bool { return e.TCPState == StateEstablished && e.Assured }

// Opening reports whether the entry may still become Established: its
// handshake is under way (SYN_SENT, SYN_RECV, SYN_SENT2) or it is
// ESTABLISHED but not yet assured. A closing or closed connection
// (FIN_WAIT and later) never will.
func (e Entry) Opening() bool {
	switch e.TCPState {
	case 1, 2, 9: // SYN_SENT, SYN_RECV, SYN_SENT2
		return true
	}
	return e.TCPState == StateEstablished && !e.Assured
}

// ErrNotFound means the kernel has no entry for the tuple.
var ErrNotFound = errors.New("no conntrack entry")

// Tracker looks up entries and reports destroyed ones. Implementations are
// safe for concurrent use.
type Tracker interface {
	// Lookup finds the TCP entry that has t as its original or its reply
	// direction (IPv4 or IPv6; an IPv4 tuple may be in IPv4-mapped form).
	Lookup(t Tuple) (Entry, error)
	// ClearMark clears the given bits of the mark of the TCP entry that
	// has t as either direction (ErrNotFound if there is none).
	ClearMark(t Tuple, bits uint32) error
	// ClearMarks clears the given bits of the mark of every TCP entry
	// that has any of them set and was made before madeBefore (an entry
	// without a start timestamp counts as made before), and returns how
	// many entries it changed. An entry made meanwhile may keep its bits:
	// they were set after the call began.
	ClearMarks(bits uint32, madeBefore time.Time) (int, error)
	// Destroyed calls fn for every destroyed TCP entry until ctx ends or the
	// event stream fails (then it returns the error; ENOBUFS means events
	// were lost and the caller must resync).
	Destroyed(ctx context.Context, fn func(Entry)) error
	Close() error
}
