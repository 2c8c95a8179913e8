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
