package dist

import (
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
