package main

import (
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/admin"
)

// TestUsageListsCommands: `hostd help` names every admin command.
func TestUsageListsCommands(t *testing.T) {
	for _, c := range admin.Commands {
		if !strings.Contains(usage, "\n  "+c+" ") {
			t.Errorf("usage does not list %q:\n%s", c, usage)
		}
	}
}
