package peers

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
)

// The channel carries one JSON message a line. A line is at most
// maxLine bytes and an announcement at most maxAddrs addresses: a peer is
// another operator's hostd, and what it sends is bounded and validated
// like a guest's.
const (
	maxLine  = 1 << 20
	maxAddrs = 16384
	version  = 1
)

// Message types.
const (
	tHello    = "hello"    // first message each way: the channel's version
	tAnnounce = "announce" // the sender's whole set of guest addresses; replaces the last
	tRefused  = "refused"  // the receiver refused some announced addresses (Addrs), and why
	tPing     = "ping"
	tPong     = "pong"
	tClaim    = "claim"   // the sender claims a connection (Claim); answered by a verdict of the same id
	tVerdict  = "verdict" // the receiver's verdict on a claim: Reason, "none" if it holds
	tAcross   = "across"  // pairing and relaying across hosts (Across): the across room's own
)

// Announced is one guest prefix a hostd announces (a guest owns
// prefixes: a single address is a full-length one), with its guest's
// trust group (groups are matched by name across hosts).
type Announced struct {
	Prefix netip.Prefix `json:"prefix"`
	Group  string       `json:"group"`
}

// Refusal is an announced prefix the receiver refused, and why.
type Refusal struct {
	Prefix netip.Prefix `json:"prefix"`
	Reason string       `json:"reason"`
}

// Claim is a host's claim of a connection between one of its guests and
// one of the peer's (docs/crosshost.md): the connection as between the
// two hosts (Src is the claimant's guest), whether that guest connected,
// and its trust group's name.
type Claim struct {
	Src    netip.AddrPort `json:"src"`
	Dst    netip.AddrPort `json:"dst"`
	Active bool           `json:"active"`
	Group  string         `json:"group"`
}

type msg struct {
	Type    string      `json:"type"`
	ID      uint64      `json:"id,omitempty"`     // claim, verdict
	Claim   *Claim      `json:"claim,omitempty"`  // claim
	Reason  string      `json:"reason,omitempty"` // verdict
	Version int         `json:"version,omitempty"`
	Addrs   []Announced `json:"addrs,omitempty"`   // announce: the whole set
	Refused []Refusal   `json:"refused,omitempty"` // refused: all of the last announcement's
	Nonce   uint64      `json:"nonce,omitempty"`
	Across  *Across     `json:"across,omitempty"` // across
}

// Across is a message of the cross-host room (hostd/across), which the
// channel only carries: the room gives the fields their meaning and
// checks them. Bounded here like everything a peer sends.
type Across struct {
	Op     string `json:"op"`
	ID     uint64 `json:"id,omitempty"`     // the sender's id for the connection
	Peer   uint64 `json:"peer,omitempty"`   // the receiver's id for it, once known
	Flow   uint32 `json:"flow,omitempty"`   // a stretch's link flow
	At     uint64 `json:"at,omitempty"`     // a stream offset
	Reason string `json:"reason,omitempty"` // a verdict or a downgrade's reason
	Never  bool   `json:"never,omitempty"`  // a stop: the sender's ring never started
	Gone   bool   `json:"gone,omitempty"`   // a stop: the sender does not know the stretch
	Claim  *Claim `json:"claim,omitempty"`
	Token  []byte `json:"token,omitempty"` // the relay link's
	Port   uint16 `json:"port,omitempty"`  // the relay link's
}

var errMalformed = errors.New("peer channel: malformed message")

// readMsg reads one message, bounded.
func readMsg(r *bufio.Reader) (msg, error) {
	line, err := r.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		return msg{}, fmt.Errorf("%w: a line over %d bytes", errMalformed, maxLine)
	}
	if err != nil {
		if errors.Is(err, io.EOF) && len(line) > 0 {
			err = io.ErrUnexpectedEOF
		}
		return msg{}, err
	}
	var m msg
	if err := json.Unmarshal(line, &m); err != nil {
		return msg{}, fmt.Errorf("%w: %v", errMalformed, err)
	}
	switch m.Type {
	case tHello, tPing, tPong:
	case tClaim:
		if c := m.Claim; c == nil || !c.Src.IsValid() || !c.Dst.IsValid() || len(c.Group) > 256 {
			return msg{}, fmt.Errorf("%w: claim %+v", errMalformed, m.Claim)
		}
	case tAcross:
		x := m.Across
		if x == nil || len(x.Op) > 32 || len(x.Reason) > 64 || len(x.Token) > 64 ||
			x.Claim != nil && (!x.Claim.Src.IsValid() || !x.Claim.Dst.IsValid() || len(x.Claim.Group) > 256) {
			return msg{}, fmt.Errorf("%w: across %+v", errMalformed, m.Across)
		}
	case tVerdict:
		if len(m.Reason) > 64 {
			return msg{}, fmt.Errorf("%w: a verdict's reason of %d bytes", errMalformed, len(m.Reason))
		}
	case tRefused:
		if len(m.Refused) > maxAddrs {
			return msg{}, fmt.Errorf("%w: %d addresses refused, at most %d", errMalformed, len(m.Refused), maxAddrs)
		}
		for _, a := range m.Refused {
			if len(a.Reason) > 64 {
				return msg{}, fmt.Errorf("%w: a refusal's reason of %d bytes", errMalformed, len(a.Reason))
			}
		}
	case tAnnounce:
		if len(m.Addrs) > maxAddrs {
			return msg{}, fmt.Errorf("%w: %d addresses announced, at most %d", errMalformed, len(m.Addrs), maxAddrs)
		}
		for _, a := range m.Addrs {
			if !a.Prefix.IsValid() || a.Prefix != a.Prefix.Masked() || len(a.Group) > 256 {
				return msg{}, fmt.Errorf("%w: announced address %+v", errMalformed, a)
			}
		}
	default:
		return msg{}, fmt.Errorf("%w: type %q", errMalformed, m.Type)
	}
	return m, nil
}

// appendMsg appends m as one line.
func appendMsg(b []byte, m msg) []byte {
	j, _ := json.Marshal(m) // plain structs: never fails
	return append(append(b, j...), '\n')
}
