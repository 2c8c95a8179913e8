package preflight

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/shuntnet/shunt/hostd/peers/peertest"
	"github.com/shuntnet/shunt/relay"
)

// TestPeering: hostd check loads the peering TLS material and verifies
// this hostd's certificate against the CA, as its peers will; a
// certificate of another CA, and a peer block with this hostd's own
// name, are problems; one expiring within 30 days a warning.
func TestPeering(t *testing.T) {
	ca, err := peertest.NewCA(t.TempDir(), "ca")
	if err != nil {
		t.Fatal(err)
	}
	other, err := peertest.NewCA(t.TempDir(), "other")
	if err != nil {
		t.Fatal(err)
	}
	block := func(cert, key, peer string) []string {
		return []string{fmt.Sprintf("peering {\n  certificate = %q\n  key = %q\n  ca = %q\n}\npeer %q {\n  address = \"10.99.0.2:7470\"\n  prefixes = [\"10.78.0.0/16\"]\n}", cert, key, ca.Path, peer)}
	}
	cert, key, err := ca.Issue("h1")
	if err != nil {
		t.Fatal(err)
	}
	c := newConfig(t)
	c.top = block(cert, key, "h2")
	fs := run(t, c, healthy())
	only(t, fs, "peering")
	want(t, fs, "peering", OK, "peering as h1 with 1 peer", "")
	want(t, fs, "peering", Warning, "certificate expires", "renew it") // peertest's last a day
	want(t, fs, "rdma", OK, "no RDMA device", "")
	p := healthy()
	p.RDMA = func() ([]relay.RDMADevice, error) {
		return []relay.RDMADevice{{Name: "rxe0", Ports: []relay.RDMAPort{{Num: 1, State: "ACTIVE", LinkLayer: "Ethernet",
			GIDs: []relay.RDMAGID{{Index: 1, GID: netip.MustParseAddr("::ffff:10.99.0.1"), Type: "RoCE v2"}}}}}}, nil
	}
	want(t, run(t, c, p), "rdma", OK, "rxe0 port 1 Ethernet ACTIVE; the RDMA link would use rxe0 port 1 gid 1", "")

	c.top = block(cert, key, "h1")
	want(t, run(t, c, healthy()), "peering", Problem, `peer "h1" is this hostd's own name`, "remove that peer block")

	cert, key, err = other.Issue("h1")
	if err != nil {
		t.Fatal(err)
	}
	c.top = block(cert, key, "h2")
	want(t, run(t, c, healthy()), "peering", Problem, "does not verify against the CA", "signed by its ca")
}
