//go:build !linux

package witness

import (
	"errors"
	"net/netip"
)

// Witness needs Linux eBPF.
type Witness struct{}

var errNotLinux = errors.New("the eBPF witness needs Linux")

func Load() (*Witness, error)                                { return nil, errNotLinux }
func LoadWith(Options) (*Witness, error)                     { return nil, errNotLinux }
func (*Witness) Attach(ifindex int) error                    { return errNotLinux }
func (*Witness) Detach(ifindex int)                          {}
func (*Witness) Origin(src, dst netip.AddrPort) (int, error) { return 0, errNotLinux }
func (*Witness) Stats() Stats                                { return Stats{} }
func (*Witness) Sweep() int                                  { return 0 }
func (*Witness) Close() error                                { return nil }
