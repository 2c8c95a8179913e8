//go:build !linux

package mark

import (
	"errors"
	"time"

	"github.com/hashicorp/go-hclog"
)

// Table is the name of hostd's nftables table (family inet).
const Table = "shunt_hostd"

// Options configure a Marker.
type Options struct {
	Netns  string
	Mask   uint32
	Resync time.Duration
	Log    hclog.Logger
}

// Entry is one guest's rule.
type Entry struct {
	Guest   string
	GuestID uint32
	Ifname  string
	ID      uint32
	Value   uint32
}

// Marker needs Linux nftables.
type Marker struct{}

var errNotLinux = errors.New("marking connections needs Linux nftables")

func Open(Options) (*Marker, error)                       { return nil, errNotLinux }
func (*Marker) Field() Field                              { return Field{} }
func (*Marker) Add(string, uint32, string) (Entry, error) { return Entry{}, errNotLinux }
func (*Marker) Remove(string)                             {}
func (*Marker) Entries() []Entry                          { return nil }
func (*Marker) Reinstalls() uint64                        { return 0 }
func (*Marker) Close() error                              { return nil }

// Probe needs Linux nftables.
func Probe(string) (int, error) { return 0, errNotLinux }
