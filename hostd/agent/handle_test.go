package agent

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/broker"
	"github.com/shuntnet/shunt/hostd/config"
	"github.com/shuntnet/shunt/hostd/ctrack/cttest"
	"github.com/shuntnet/shunt/hostd/metrics"
	"github.com/shuntnet/shunt/policy"
)

// testAgent is an Agent with a broker of the given guests (and a fake
// conntrack) and a configuration naming cfgGuests, for handle's tests.
func testAgent(t *testing.T, guests []*broker.Guest, cfgGuests []config.Guest) *Agent {
	t.Helper()
	tab, err := policy.Compile(policy.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	m := metrics.New()
	b := broker.New(hclog.NewNullLogger(), &cttest.Table{}, m, tab, guests, broker.Options{})
	t.Cleanup(b.Close)
	return &Agent{log: hclog.NewNullLogger(), m: m, b: b,
		cfg: &config.Config{Path: filepath.Join(t.TempDir(), "none.hcl"), Guests: cfgGuests}}
}

// TestHandleKnowsEveryCommand: the agent answers every admin command the
// CLI may send, and names the known ones for any other.
func TestHandleKnowsEveryCommand(t *testing.T) {
	a := testAgent(t, nil, nil)
	for _, c := range admin.Commands {
		_, err := a.handle(admin.Request{Cmd: c, Flow: "t/0.1"})
		if err != nil && strings.Contains(err.Error(), "unknown command") {
			t.Errorf("%s: %v", c, err)
		}
	}
	if _, err := a.handle(admin.Request{Cmd: "stauts"}); err == nil || !strings.Contains(err.Error(), admin.CmdStatus) {
		t.Errorf("a typo got %v, want an error naming the known commands", err)
	}
}
