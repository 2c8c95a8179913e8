package config

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/shuntnet/shunt/hostd/peers"
)

// peeringBlock is hostd.hcl's peering block: this hostd's side of the
// channel to other hosts' hostds (docs/crosshost.md).
type peeringBlock struct {
	Listen      string `hcl:"listen,optional"`
	Certificate string `hcl:"certificate"`
	Key         string `hcl:"key"`
	CA          string `hcl:"ca"`
	Interval    string `hcl:"interval,optional"`
	Relay       string `hcl:"relay,optional"`
}

// peerBlock is one remote hostd.
type peerBlock struct {
	Name     string   `hcl:"name,label"`
	Address  string   `hcl:"address"`
	Prefixes []string `hcl:"prefixes"`
}

// peering validates the peering and peer blocks; nil without them.
func peering(pb *peeringBlock, ps []peerBlock) (*peers.Config, error) {
	switch {
	case pb == nil && len(ps) == 0:
		return nil, nil
	case pb == nil:
		return nil, errors.New("peer blocks need a peering block (certificate, key, ca)")
	}
	c := &peers.Config{Listen: pb.Listen, Certificate: pb.Certificate, Key: pb.Key, CA: pb.CA, Relay: pb.Relay}
	var err error
	if c.Interval, err = duration(pb.Interval, 0); err != nil {
		return nil, fmt.Errorf("peering: interval: %w", err)
	}
	for _, p := range ps {
		pc := peers.Peer{Name: p.Name, Address: p.Address}
		for _, s := range p.Prefixes {
			q, err := netip.ParsePrefix(s)
			if err != nil {
				return nil, fmt.Errorf("peer %q: prefix %q: %w", p.Name, s, err)
			}
			pc.Prefixes = append(pc.Prefixes, q)
		}
		c.Peers = append(c.Peers, pc)
	}
	if err := c.Check(); err != nil {
		return nil, err
	}
	return c, nil
}
