package policy_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/policy"
)

func flow(from, to string) policy.Flow {
	return policy.Flow{From: netip.MustParseAddrPort(from), To: netip.MustParseAddrPort(to)}
}

func TestDecide(t *testing.T) {
	tab, err := policy.Compile(policy.Spec{
		Default:  "tcp",
		RingSize: "256KiB",
		Rules: []policy.RuleSpec{
			{Name: "no-ssh", Action: "tcp", Ports: []string{"22"}},
			{Name: "mpi", Action: "fastpath", From: []string{"10.77.0.0/16"}, To: []string{"10.77.0.0/16"}, Ports: []string{"5000-6000"}, RingSize: "1MiB"},
			{Name: "one-host", Action: "fastpath", To: []string{"10.88.0.9"}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		f    policy.Flow
		fast bool
		rule string
		ring int
	}{
		{"mpi port in range", flow("10.77.1.2:40000", "10.77.2.2:5201"), true, "mpi", 1 << 20},
		{"ssh first rule wins", flow("10.77.1.2:40000", "10.77.2.2:22"), false, "no-ssh", 256 << 10},
		{"port outside range", flow("10.77.1.2:40000", "10.77.2.2:8080"), false, "default", 256 << 10},
		{"source outside", flow("10.99.1.2:40000", "10.77.2.2:5201"), false, "default", 256 << 10},
		{"single address", flow("10.99.1.2:1", "10.88.0.9:80"), true, "one-host", 256 << 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := tab.Decide(tt.f)
			if v.FastPath != tt.fast || v.Rule != tt.rule || v.RingSize != tt.ring {
				t.Fatalf("Decide = %+v; want fast=%v rule=%s ring=%d", v, tt.fast, tt.rule, tt.ring)
			}
			if !v.FastPath && v.Reason != proto.ReasonPolicy {
				t.Fatalf("TCP verdict reason %s, want policy", v.Reason)
			}
		})
	}
}

// TestDecideIPv6: rules on IPv6 prefixes decide IPv6 flows and never
// IPv4 ones (nor the other way round); a rule written with an
// IPv4-mapped prefix is an IPv4 rule; a flow named with IPv4-mapped
// addresses (an AF_INET6 socket's IPv4 peer) is decided as its IPv4 form.
func TestDecideIPv6(t *testing.T) {
	tab, err := policy.Compile(policy.Spec{
		Rules: []policy.RuleSpec{
			{Name: "v6-tcp", Action: "tcp", From: []string{"fd00:77::/32"}, To: []string{"fd00:77:2::/64"}},
			{Name: "mapped-tcp", Action: "tcp", To: []string{"::ffff:10.88.0.0/112"}},
			{Name: "one-v6", Action: "tcp", To: []string{"fd00:99::9"}, Ports: []string{"80"}},
			{Name: "all-v6-ssh", Action: "tcp", To: []string{"::/0"}, Ports: []string{"22"}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name string
		f    policy.Flow
		rule string
	}{
		{"v6 in both prefixes", flow("[fd00:77:1::2]:40000", "[fd00:77:2::2]:5201"), "v6-tcp"},
		{"v6 to another guest", flow("[fd00:77:1::2]:40000", "[fd00:77:3::2]:5201"), "default"},
		{"v4 between the same guests", flow("10.77.1.2:40000", "10.77.2.2:5201"), "default"},
		{"mapped rule, v4 flow", flow("10.77.1.2:40000", "10.88.1.2:80"), "mapped-tcp"},
		{"mapped rule, mapped flow", flow("[::ffff:10.77.1.2]:40000", "[::ffff:10.88.1.2]:80"), "mapped-tcp"},
		{"single v6 address", flow("[fd00:1::1]:1", "[fd00:99::9]:80"), "one-v6"},
		{"::/0 is IPv6 only", flow("10.77.1.2:1", "10.77.2.2:22"), "default"},
		{"::/0 matches IPv6", flow("[fd00:1::1]:1", "[fd00:1::2]:22"), "all-v6-ssh"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if v := tab.Decide(tt.f); v.Rule != tt.rule || v.FastPath != (tt.rule == "default") {
				t.Fatalf("Decide = %+v; want rule %s", v, tt.rule)
			}
		})
	}
}

func TestDefaults(t *testing.T) {
	tab, err := policy.Compile(policy.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	v := tab.Decide(flow("10.0.0.1:1", "10.0.0.2:2"))
	if !v.FastPath || v.RingSize != policy.DefaultRingSize || tab.MaxFlowsPerGuest() != policy.DefaultMaxFlows {
		t.Fatalf("empty spec: %+v, max flows %d", v, tab.MaxFlowsPerGuest())
	}
}

func TestCompileErrors(t *testing.T) {
	tests := []struct {
		name string
		spec policy.Spec
		want string
	}{
		{"bad default", policy.Spec{Default: "fast"}, `action "fast"`},
		{"ring not power of two", policy.Spec{RingSize: "100KiB"}, "power of two"},
		{"ring garbage", policy.Spec{RingSize: "lots"}, `size "lots"`},
		{"negative limit", policy.Spec{MaxFlowsPerGuest: -1}, "max_flows_per_guest"},
		{"bad cidr", policy.Spec{Rules: []policy.RuleSpec{{Name: "r", Action: "tcp", From: []string{"10.0.0/8"}, Line: 7}}}, `rule "r" (line 7): from: "10.0.0/8"`},
		{"bad port", policy.Spec{Rules: []policy.RuleSpec{{Name: "r", Action: "tcp", Ports: []string{"6000-5000"}}}}, `"6000-5000"`},
		{"missing action", policy.Spec{Rules: []policy.RuleSpec{{Name: "r"}}}, `action ""`},
		{"mixed mapped prefix", policy.Spec{Rules: []policy.RuleSpec{{Name: "r", Action: "tcp", To: []string{"::ffff:0:0/80"}}}}, "IPv4-mapped"},
		{"zone", policy.Spec{Rules: []policy.RuleSpec{{Name: "r", Action: "tcp", To: []string{"fe80::1%eth0"}}}}, "zone"},
		{"duplicate", policy.Spec{Rules: []policy.RuleSpec{{Name: "r", Action: "tcp"}, {Name: "r", Action: "tcp"}}}, "already exists"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := policy.Compile(tt.spec)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Compile error = %v; want one containing %q", err, tt.want)
			}
		})
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"4096": 4096, "64KiB": 64 << 10, "1 MiB": 1 << 20, "2GiB": 2 << 30} {
		if got, err := policy.ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "MiB", "-1", "1.5MiB", "1TiB"} {
		if _, err := policy.ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q) succeeded", in)
		}
	}
}
