//go:build !linux

package witness

import (
	"errors"
	"net/netip"
)

// Witness needs Linux eBPF.
type Witness struct{}

// ErrNoSYN means no SYN with that tuple was seen.
var ErrNoSYN = errors.New("witness: no SYN seen for this tuple")

var errNotLinux = errors.New("the eBPF witness needs Linux")

func Load() (*Witness, error)                                { return nil, errNotLinux }
func (*Witness) Attach(ifindex int) error                    { return errNotLinux }
func (*Witness) Detach(ifindex int)                          {}
func (*Witness) Origin(src, dst netip.AddrPort) (int, error) { return 0, errNotLinux }
func (*Witness) Close() error                                { return nil }
