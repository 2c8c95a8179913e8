package dist

import (
	"os"
	"strings"
	"testing"

	"github.com/shuntnet/shunt/hostd/config"
)

func TestExampleConfigParses(t *testing.T) {
	c, err := config.Load("hostd.hcl")
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Guests) != 2 || len(c.Policy.Rules) != 2 {
		t.Fatalf("example config: %d guests, %d rules", len(c.Guests), len(c.Policy.Rules))
	}
}

// TestUnitChecksFirst: the unit runs `hostd check` before `hostd agent`,
// with the same binary and configuration.
func TestUnitChecksFirst(t *testing.T) {
	src, err := os.ReadFile("shunt-hostd.service")
	if err != nil {
		t.Fatal(err)
	}
	cmds := map[string][]string{}
	section := ""
	for _, line := range strings.Split(string(src), "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "[") {
			section = line
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || section != "[Service]" || !strings.HasPrefix(k, "ExecStart") {
			continue
		}
		if _, dup := cmds[k]; dup {
			t.Errorf("%s given twice", k)
		}
		cmds[k] = strings.Fields(v)
	}
	start, pre := cmds["ExecStart"], cmds["ExecStartPre"]
	if len(start) != 4 || start[1] != "agent" || start[2] != "-config" {
		t.Fatalf("ExecStart: want BINARY agent -config FILE, got %q", start)
	}
	want := []string{start[0], "check", "-config", start[3]}
	if strings.Join(pre, " ") != strings.Join(want, " ") {
		t.Errorf("ExecStartPre: want %q (ExecStart's binary and config), got %q", want, pre)
	}
}
