//go:build !linux

package agent

import (
	"errors"
	"net/netip"

	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/witness"
)

// guestAddrs returns the configured addresses; learning them from an
// interface needs Linux netlink.
func guestAddrs(nsPath string, gc config.Guest) (broker.Addrs, error) {
	var out broker.Addrs
	if gc.Interface != "" {
		return out, errors.New("learning guest addresses from an interface needs Linux")
	}
	for _, a := range gc.Addresses {
		out.Prefixes = append(out.Prefixes, netip.PrefixFrom(a, a.BitLen()))
	}
	return out, nil
}

func attachWitness(w *witness.Witness, nsPath, ifname string) (int, error) {
	return 0, errors.New("the eBPF witness needs Linux")
}
