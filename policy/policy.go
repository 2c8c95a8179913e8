package policy

import (
	"fmt"
	"math/bits"
	"net/netip"
	"strconv"
	"strings"

	"github.com/shuntnet/shunt/internal/proto"
)

// Spec is a policy as written by an operator.
type Spec struct {
	// Default is "fastpath" or "tcp": what a flow gets when no rule matches.
	Default string `hcl:"default,optional"`
	// RingSize is the default ring capacity per direction, e.g. "1MiB".
	RingSize string `hcl:"ring_size,optional"`
	// MaxFlowsPerGuest bounds live fast-path flows per guest (0: 1024).
	MaxFlowsPerGuest int        `hcl:"max_flows_per_guest,optional"`
	Rules            []RuleSpec `hcl:"rule,block"`
}

// RuleSpec is one rule; the first rule that matches a flow decides it.
type RuleSpec struct {
	Name     string   `hcl:"name,label"`
	Action   string   `hcl:"action"`             // "fastpath" or "tcp"
	From     []string `hcl:"from,optional"`      // CIDRs of the connecting guest; empty: any
	To       []string `hcl:"to,optional"`        // CIDRs of the accepting guest; empty: any
	Ports    []string `hcl:"ports,optional"`     // "5201" or "5000-5999" of the accepting side; empty: any
	RingSize string   `hcl:"ring_size,optional"` // overrides the default
	Line     int      // where the rule was written, for errors (not an HCL field)
}

// Flow is what policy sees of a connection: the connecting side's address
// and the accepting side's real address (after any DNAT).
type Flow struct {
	From, To netip.AddrPort
}

// Verdict is the decision for one flow.
type Verdict struct {
	FastPath bool
	Reason   proto.Reason // ReasonPolicy when FastPath is false
	RingSize int
	// Floor is the ring size a flow of this verdict takes when RingSize
	// finds no room (the guest's quota, the region): the policy's default
	// ring_size when the rule asks for more, else RingSize. hostd's
	// default quotas and regions are sized for the default ring, so a
	// rule for bulk flows never leaves a connection on TCP where the
	// default would have given it rings (docs/config.md, "ring sizes").
	Floor int
	Rule  string // the rule that matched, or "default"
}

// Table is a compiled policy. It is immutable and safe for concurrent use.
type Table struct {
	defaultFast bool
	ringSize    int
	maxFlows    int
	rules       []rule
}

type rule struct {
	name     string
	fast     bool
	from, to []netip.Prefix
	ports    [][2]uint16
	ringSize int
}

// Defaults used when a Spec leaves them out.
const (
	DefaultRingSize = 1 << 20
	DefaultMaxFlows = 1024
	minRing         = 4 << 10
	maxRing         = 1 << 30
)

// Compile validates s and builds its Table.
func Compile(s Spec) (*Table, error) {
	t := &Table{defaultFast: true, ringSize: DefaultRingSize, maxFlows: DefaultMaxFlows}
	var err error
	if t.defaultFast, err = action(s.Default, true); err != nil {
		return nil, fmt.Errorf("policy default: %w", err)
	}
	if s.RingSize != "" {
		if t.ringSize, err = ParseRingSize(s.RingSize); err != nil {
			return nil, fmt.Errorf("policy ring_size: %w", err)
		}
	}
	if s.MaxFlowsPerGuest < 0 {
		return nil, fmt.Errorf("policy max_flows_per_guest %d: want 0 (default) or more", s.MaxFlowsPerGuest)
	}
	if s.MaxFlowsPerGuest > 0 {
		t.maxFlows = s.MaxFlowsPerGuest
	}
	seen := map[string]bool{}
	for _, rs := range s.Rules {
		where := fmt.Sprintf("rule %q", rs.Name)
		if rs.Line > 0 {
			where += fmt.Sprintf(" (line %d)", rs.Line)
		}
		if seen[rs.Name] {
			return nil, fmt.Errorf("%s: a rule with this name already exists", where)
		}
		seen[rs.Name] = true
		r := rule{name: rs.Name, ringSize: t.ringSize}
		if r.fast, err = action(rs.Action, false); err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if r.from, err = prefixes(rs.From); err != nil {
			return nil, fmt.Errorf("%s: from: %w", where, err)
		}
		if r.to, err = prefixes(rs.To); err != nil {
			return nil, fmt.Errorf("%s: to: %w", where, err)
		}
		for _, p := range rs.Ports {
			pr, err := portRange(p)
			if err != nil {
				return nil, fmt.Errorf("%s: ports: %w", where, err)
			}
			r.ports = append(r.ports, pr)
		}
		if rs.RingSize != "" {
			if r.ringSize, err = ParseRingSize(rs.RingSize); err != nil {
				return nil, fmt.Errorf("%s: ring_size: %w", where, err)
			}
		}
		t.rules = append(t.rules, r)
	}
	return t, nil
}

func action(s string, dflt bool) (bool, error) {
	switch s {
	case "fastpath":
		return true, nil
	case "tcp":
		return false, nil
	case "":
		if dflt {
			return true, nil
		}
	}
	return false, fmt.Errorf("action %q: want \"fastpath\" or \"tcp\"", s)
}

// prefixes parses CIDRs and single addresses. An IPv4 one written in
// IPv4-mapped IPv6 form (::ffff:10.0.0.0/104) is made the IPv4 prefix it
// names (10.0.0.0/8): flows carry IPv4 addresses in IPv4 form (Decide
// unmaps them too), so it matches the same flows as if written so. IPv6
// prefixes match IPv6 flows only, IPv4 ones IPv4 flows only ("::/0" is
// every IPv6 flow, not every flow).
func prefixes(ss []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range ss {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				return nil, fmt.Errorf("%q is neither a CIDR nor an address", s)
			}
			if a.Zone() != "" {
				return nil, fmt.Errorf("%q: an address with a zone; write it without", s)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		if p.Addr().Is4In6() {
			if p.Bits() < 96 {
				return nil, fmt.Errorf("%q mixes IPv4-mapped and other IPv6 addresses; write the IPv4 part as an IPv4 CIDR", s)
			}
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

func portRange(s string) ([2]uint16, error) {
	lo, hi, ok := strings.Cut(s, "-")
	if !ok {
		hi = lo
	}
	a, err1 := strconv.ParseUint(strings.TrimSpace(lo), 10, 16)
	b, err2 := strconv.ParseUint(strings.TrimSpace(hi), 10, 16)
	if err1 != nil || err2 != nil || a == 0 || a > b {
		return [2]uint16{}, fmt.Errorf("%q: want a port (1-65535) or a range like 5000-5999", s)
	}
	return [2]uint16{uint16(a), uint16(b)}, nil
}

// ParseRingSize parses "64KiB", "1MiB" or a byte count; it must be a power
// of two between 4 KiB and 1 GiB.
func ParseRingSize(s string) (int, error) {
	n, err := ParseSize(s)
	if err != nil {
		return 0, err
	}
	if n < minRing || n > maxRing || bits.OnesCount64(uint64(n)) != 1 {
		return 0, fmt.Errorf("ring size %q: want a power of two from 4KiB to 1GiB", s)
	}
	return int(n), nil
}

// ParseSize parses a byte size with an optional KiB, MiB or GiB suffix.
func ParseSize(s string) (int64, error) {
	num, mult := strings.TrimSpace(s), int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if strings.HasSuffix(num, u.suffix) {
			num, mult = strings.TrimSpace(strings.TrimSuffix(num, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n <= 0 || n > 1<<50/mult {
		return 0, fmt.Errorf("size %q: want a positive number with an optional KiB, MiB or GiB suffix", s)
	}
	return n * mult, nil
}

// Decide returns the verdict for f: the first matching rule, else the
// default.
func (t *Table) Decide(f Flow) Verdict {
	for i := range t.rules {
		r := &t.rules[i]
		if r.matches(f) {
			return verdict(r.fast, r.ringSize, min(r.ringSize, t.ringSize), r.name)
		}
	}
	return verdict(t.defaultFast, t.ringSize, t.ringSize, "default")
}

func verdict(fast bool, ring, floor int, name string) Verdict {
	v := Verdict{FastPath: fast, RingSize: ring, Floor: floor, Rule: name}
	if !fast {
		v.Reason = proto.ReasonPolicy
	}
	return v
}

func (r *rule) matches(f Flow) bool {
	return inAny(r.from, f.From.Addr()) && inAny(r.to, f.To.Addr()) && portIn(r.ports, f.To.Port())
}

func inAny(ps []netip.Prefix, a netip.Addr) bool {
	if len(ps) == 0 {
		return true
	}
	a = a.Unmap()
	for _, p := range ps {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

func portIn(rs [][2]uint16, p uint16) bool {
	if len(rs) == 0 {
		return true
	}
	for _, r := range rs {
		if p >= r[0] && p <= r[1] {
			return true
		}
	}
	return false
}

// MaxFlowsPerGuest is the limit of live fast-path flows per guest.
func (t *Table) MaxFlowsPerGuest() int { return t.maxFlows }

// Rules returns the rule names in order, for status output.
func (t *Table) Rules() []string {
	out := make([]string, len(t.rules))
	for i, r := range t.rules {
		out[i] = r.name
	}
	return out
}
