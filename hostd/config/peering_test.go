package config_test

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/config"
)

// TestPeering: the peering and peer blocks parse into the peers room's
// configuration, and their mistakes are refused with the block named.
func TestPeering(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(good+`
peering {
  listen      = "10.99.0.1:7470"
  certificate = "/etc/shunt/peer.pem"
  key         = "/etc/shunt/peer.key"
  ca          = "/etc/shunt/peer-ca.pem"
  interval    = "500ms"
}
peer "h2" {
  address  = "10.99.0.2:7470"
  prefixes = ["10.78.0.0/16", "fd00:78::/32"]
}
`))
	if err != nil {
		t.Fatal(err)
	}
	p := c.Peering
	if p == nil || p.Listen != "10.99.0.1:7470" || p.Interval != 500*time.Millisecond || len(p.Peers) != 1 ||
		p.Peers[0].Name != "h2" || p.Peers[0].Prefixes[1] != netip.MustParsePrefix("fd00:78::/32") {
		t.Fatalf("peering %+v", p)
	}
	if c, err := config.Parse("hostd.hcl", []byte(good)); err != nil || c.Peering != nil {
		t.Fatalf("without peering: %+v, %v", c.Peering, err)
	}
	for bad, want := range map[string]string{
		`peer "h2" {` + "\n" + `address = "x:1"` + "\n" + `prefixes = ["10.0.0.0/8"]` + "\n}\n": "need a peering block",
		`peering {` + "\n" + `certificate = "c"` + "\n" + `key = "k"` + "\n" + `ca = "a"` + "\n}\n" +
			`peer "h2" {` + "\n" + `address = "x:1"` + "\n" + `prefixes = ["10.0.0.1/8"]` + "\n}\n": "masked prefix",
		`peering {` + "\n" + `certificate = "c"` + "\n" + `key = "k"` + "\n" + `ca = "a"` + "\n}\n" +
			`peer "h2" {` + "\n" + `address = "x:1"` + "\n" + `prefixes = ["nope"]` + "\n}\n": `prefix "nope"`,
	} {
		if _, err := config.Parse("hostd.hcl", []byte(good+bad)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", bad, err, want)
		}
	}
}
