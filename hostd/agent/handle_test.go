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

// TestHandleKnowsEveryCommand: the agent answers every admin command the
// CLI may send, and names the known ones for any other.
func TestHandleKnowsEveryCommand(t *testing.T) {
	tab, err := policy.Compile(policy.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	m := metrics.New()
	b := broker.New(hclog.NewNullLogger(), &cttest.Table{}, m, tab, nil, broker.Options{})
	defer b.Close()
	a := &Agent{log: hclog.NewNullLogger(), cfg: &config.Config{Path: filepath.Join(t.TempDir(), "none.hcl")}, m: m, b: b}
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
